"""Inline images kept once: a stored item's `input_image` data URLs as references to blobs.

A client that resends a conversation resends its images; stored as they came, every turn would
keep another copy. Before a save, each inline image (an `input_image` part whose `image_url` is a
`data:` URL of at least `MIN_BYTES`, in any item, message content or tool output alike) is
replaced by `REFERENCE` and its content hash; the store keeps each such blob once per scope
(never shared across API keys) and puts the URL back in every item it reads.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: Smaller data URLs stay inline (a reference would save nothing).
MIN_BYTES = 4096
REFERENCE = "deepinfer-blob:sha256:"


def extract(item: Any, blobs: dict[str, str]) -> Any:
    """The item with its inline images replaced by references, each blob added to `blobs`
    (by content hash)."""
    if isinstance(item, list):
        return [extract(value, blobs) for value in item]
    if not isinstance(item, dict):
        return item
    url = item.get("image_url")
    if (
        item.get("type") == "input_image"
        and isinstance(url, str)
        and url.startswith("data:")
        and len(url) >= MIN_BYTES
    ):
        digest = hashlib.sha256(url.encode()).hexdigest()
        blobs[digest] = url
        return {**item, "image_url": REFERENCE + digest}
    return {key: extract(value, blobs) for key, value in item.items()}


def references(item: Any, found: set[str]) -> set[str]:
    """The blob hashes the item refers to (added to `found`)."""
    if isinstance(item, list):
        for value in item:
            references(value, found)
    elif isinstance(item, dict):
        url = item.get("image_url")
        if item.get("type") == "input_image" and isinstance(url, str) and url.startswith(REFERENCE):
            found.add(url.removeprefix(REFERENCE))
        for value in item.values():
            references(value, found)
    return found


def inflate(item: Any, blobs: dict[str, str]) -> Any:
    """The item with each reference to a blob in `blobs` replaced by its data URL."""
    if isinstance(item, list):
        return [inflate(value, blobs) for value in item]
    if not isinstance(item, dict):
        return item
    url = item.get("image_url")
    if item.get("type") == "input_image" and isinstance(url, str) and url.startswith(REFERENCE):
        data = blobs.get(url.removeprefix(REFERENCE))
        return item if data is None else {**item, "image_url": data}
    return {key: inflate(value, blobs) for key, value in item.items()}
