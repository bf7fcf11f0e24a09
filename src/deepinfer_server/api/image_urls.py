"""Requests with image URLs: the images are fetched on the event loop, then the body prepared.

Preparation (conversion, image decoding, tokenizing) may run on the preparation workers, and a
fetch must never hold one: a slow host would keep other clients' prompts waiting. Preparation
that meets an image URL not fetched yet stops with `ImagesToFetch` (having taken a worker for
the conversion only); the URLs are fetched here, concurrently, each within
`--media-fetch-timeout`, and cancelled if the client leaves; then the body is prepared again,
with the fetched bytes in `FETCHED_IMAGES`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

from deepinfer_server.api.disconnect import until_disconnect
from deepinfer_server.api.image_fetch import fetch_images
from deepinfer_server.protocol.core.images import FETCHED_IMAGES, ImageLimits, ImagesToFetch

T = TypeVar("T")


async def prepare_fetching_images(
    prepare: Callable[[], Awaitable[T]], limits: ImageLimits, receive: Receive
) -> T:
    """`await prepare()`, after fetching the image URLs it asks for (ClientDisconnected when
    the client leaves during the fetches, which ends them)."""
    fetched: dict[str, bytes] = {}
    token = FETCHED_IMAGES.set(fetched)
    try:
        try:
            return await prepare()
        except ImagesToFetch as needed:
            images = fetch_images(
                needed.urls, limits.allowed, limits.fetch_timeout, limits.max_image_bytes
            )
            fetched.update(await until_disconnect(receive, images))
        return await prepare()
    finally:
        FETCHED_IMAGES.reset(token)
