"""Inline images kept once: a stored item's `input_image` data URLs as references to blobs.

A client that resends a conversation resends its images; stored as they came, every turn would
keep another copy. Before a save, each inline image (an `input_image` part whose `image_url` is a
`data:` URL of at least `MIN_BYTES`, in any item, message content or tool output alike) is
replaced by `REFERENCE` and its content hash; the store keeps each such blob once per scope
(never shared across API keys) and puts the URL back in every item it reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

#: Smaller data URLs stay inline (a reference would save nothing).
MIN_BYTES = 4096
REFERENCE = "deepinfer-blob:sha256:"


def _image_url(item: dict[str, Any]) -> str | None:
    """The URL of an `input_image` part (None: not one, or without a URL)."""
    url = item.get("image_url")
    return url if item.get("type") == "input_image" and isinstance(url, str) else None


def _with_image_urls(item: Any, replace: Callable[[str], str | None]) -> Any:
    """The item rebuilt with each `input_image` part's URL that `replace` maps (None: the part
    kept as it is)."""
    if isinstance(item, list):
        return [_with_image_urls(value, replace) for value in item]
    if not isinstance(item, dict):
        return item
    url = _image_url(item)
    new_url = None if url is None else replace(url)
    if new_url is not None:
        return {**item, "image_url": new_url}
    return {key: _with_image_urls(value, replace) for key, value in item.items()}


def extract(item: Any, blobs: dict[str, str]) -> Any:
    """The item with its inline images replaced by references, each blob added to `blobs`
    (by content hash)."""

    def reference(url: str) -> str | None:
        if not url.startswith("data:") or len(url) < MIN_BYTES:
            return None
        digest = hashlib.sha256(url.encode()).hexdigest()
        blobs[digest] = url
        return REFERENCE + digest

    return _with_image_urls(item, reference)


def references(item: Any, found: set[str]) -> set[str]:
    """The blob hashes the item refers to (added to `found`)."""
    if isinstance(item, list):
        for value in item:
            references(value, found)
    elif isinstance(item, dict):
        url = _image_url(item)
        if url is not None and url.startswith(REFERENCE):
            found.add(url.removeprefix(REFERENCE))
        for value in item.values():
            references(value, found)
    return found


def inflate(item: Any, blobs: dict[str, str]) -> Any:
    """The item with each reference to a blob in `blobs` replaced by its data URL."""

    def data_url(url: str) -> str | None:
        return blobs.get(url.removeprefix(REFERENCE)) if url.startswith(REFERENCE) else None

    return _with_image_urls(item, data_url)
