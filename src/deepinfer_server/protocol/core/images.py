"""Image input: the conversation's image sources resolved into DeepInfer's `multi_modal_data`.

deepseek-recipe converts every protocol's image parts (Chat `image_url`, Responses
`input_image`, Anthropic `image` blocks) into image sources and renders one placeholder token
per image; its resolver decodes each image (OpenCV: PNG, JPEG, WebP, GIF), rejects corrupt and
oversized ones, and resizes and re-encodes it as the V4.1 vision encoder expects. This module
applies the server's limits (images per request, bytes per image) and turns the result into
`ipc.messages.Images`. External URLs are fetched only from `--allowed-media-domains`
(`AllowedOrigins` here; the API layer's `api.image_fetch` fetches them); otherwise only `data:`
URLs and inline base64 are accepted.

Preparation never fetches: it may run on a preparation worker, which a slow host must not hold.
An image URL not fetched yet stops it with `ImagesToFetch`; the API layer fetches the URLs on
the event loop and prepares again with their bytes in `FETCHED_IMAGES` (a context variable,
which `asyncio.to_thread` carries to the worker).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType

import httpx
import msgspec
from deepseek_recipe import (
    BytesImageSource,
    ConversationRequest,
    ImageError,
    ImageQuota,
    ImageResolver,
    ImageSource,
    MultiModalData,
    OpenCvImagePreprocessor,
    ReqwestImageFetcher,
)

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.config.media_origins import parse_origin
from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.ipc.messages import Images
from deepinfer_server.model.images import ImagePolicy

#: deepseek-recipe ImageError kinds that mean "too large" (413); the others are 400s.
_TOO_LARGE = frozenset({"ImageTooLarge", "TotalSizeTooLarge", "ImageDimensionsTooLarge"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class AllowedOrigins:
    """The hosts and ports image URLs may be fetched from (`parse_origin` entries)."""

    origins: frozenset[tuple[str, int | None]] = frozenset()

    @classmethod
    def of(cls, entries: Iterable[str]) -> AllowedOrigins:
        return cls(frozenset(parse_origin(entry) for entry in entries))

    def __bool__(self) -> bool:
        return bool(self.origins)

    def allows(self, url: str) -> bool:
        """Whether `url` is http(s) on an allowed host and port (parsed as httpx parses what
        it fetches: the check and the fetch never disagree about the host)."""
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            return False
        default = _DEFAULT_PORTS.get(parsed.scheme)
        host = parsed.raw_host.decode("ascii").lower()  # IDNA names as punycode
        if default is None or not host:
            return False
        port = default if parsed.port is None else parsed.port
        return (port == default and (host, None) in self.origins) or (host, port) in self.origins


def _not_fetched(param: str | None) -> BadRequestError:
    return BadRequestError(
        "image URLs are not fetched by this server: send the image inline as a "
        "`data:image/...;base64,...` URL",
        param=param,
        kind=ErrorKind.UNSUPPORTED,
        code="unsupported_content",
    )


def check_fetchable(url: str, allowed: AllowedOrigins, param: str | None) -> None:
    """400 for a URL this server never fetches (decided from the URL alone)."""
    if not allowed:
        raise _not_fetched(param)
    if not allowed.allows(url):
        raise BadRequestError(
            f"image URL {url!r} is not on this server's --allowed-media-domains (hosts on "
            "their default port, or host:port entries)",
            param=param,
            kind=ErrorKind.UNSUPPORTED,
        )


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send."""

    max_images: int = 8
    max_image_bytes: int = 10 * 1024 * 1024
    #: Hosts and ports whose http(s) image URLs are fetched (none: URLs are refused).
    allowed: AllowedOrigins = field(default_factory=AllowedOrigins)
    #: Seconds one image URL's whole fetch may take.
    fetch_timeout: float = 10.0

    @classmethod
    def of(cls, config: ResolvedConfig) -> ImageLimits:
        """The limits the server's configuration sets."""
        return cls(
            config.max_images_per_request,
            config.max_image_bytes,
            AllowedOrigins.of(config.allowed_media_domains),
            config.media_fetch_timeout,
        )


#: The bytes of the image URLs fetched for the request being prepared, by URL.
FETCHED_IMAGES: ContextVar[Mapping[str, bytes]] = ContextVar(
    "FETCHED_IMAGES", default=MappingProxyType({})
)


class ImagesToFetch(Exception):
    """Preparation met image URLs that are not fetched yet: fetch them, then prepare again."""

    def __init__(self, urls: list[tuple[str, str | None]]) -> None:
        super().__init__(f"{len(urls)} image URLs to fetch")
        #: (url, the request's param naming the image) of each.
        self.urls = urls


def image_sources(converted: ConversationRequest) -> list[ImageSource]:
    """Every image of the conversation, in the order of the prompt's placeholders."""
    return [
        source for message in converted.conversation.messages for source in message.image_sources
    ]


def _encoded_size(source: ImageSource) -> int:
    """The byte size of an inline image (a 400 for an external URL)."""
    if source.kind == "bytes":
        return len(source.data or b"")
    if source.kind != "data_url":
        raise _not_fetched(source.path.lstrip(".") or None)
    header, _, payload = (source.data_url or "").partition(",")
    if not header.endswith(";base64"):
        return len(payload)  # percent-encoded: at least as long as its bytes
    try:
        return len(base64.b64decode(payload, validate=False))
    except (binascii.Error, ValueError):
        return len(payload) * 3 // 4


def _too_large(limit: int, param: str | None) -> BadRequestError:
    return BadRequestError(
        f"an image is larger than this server's limit of {limit} bytes",
        param=param,
        kind=ErrorKind.REQUEST_TOO_LARGE,
    )


def resolve_images(
    sources: list[ImageSource], limits: ImageLimits, resolver: ImageResolver
) -> Images:
    """Decode, check and preprocess the images (400 corrupt or unsupported, 413 too large)."""
    if len(sources) > limits.max_images:
        raise BadRequestError(
            f"a request may hold at most {limits.max_images} images; this one has {len(sources)}",
            param="messages",
        )
    sources = _with_fetched_images(sources, limits)
    for source in sources:
        if _encoded_size(source) > limits.max_image_bytes:
            raise _too_large(limits.max_image_bytes, source.path.lstrip(".") or None)
    param = sources[0].path.lstrip(".") or None if len(sources) == 1 else "messages"
    quota = ImageQuota()
    try:
        data: MultiModalData = resolver.resolve(sources, quota)
        extra = data.image_token_adjustment()
    except ImageError as exc:
        if exc.kind in _TOO_LARGE:
            raise BadRequestError(
                f"the image is too large: {exc}", param=param, kind=ErrorKind.REQUEST_TOO_LARGE
            ) from exc
        raise BadRequestError(f"the image could not be used: {exc}", param=param) from exc
    except ValueError as exc:
        raise BadRequestError(f"the image could not be used: {exc}", param=param) from exc
    images = data.images
    if any(len(image.data) > limits.max_image_bytes for image in images):
        raise _too_large(limits.max_image_bytes, None)
    return Images(
        sizes=[(image.width, image.height) for image in images],
        data=[bytes(image.data) for image in images],
        extra_tokens=int(extra),
    )


def _with_fetched_images(sources: list[ImageSource], limits: ImageLimits) -> list[ImageSource]:
    """The sources with every image URL replaced by its fetched bytes; `ImagesToFetch` when
    some are not fetched yet (after the checks that need no fetch: a 400 comes first)."""
    fetched = FETCHED_IMAGES.get()
    missing: list[tuple[str, str | None]] = []
    for source in sources:
        if source.kind == "url" and (source.url or "") not in fetched:
            param = source.path.lstrip(".") or None
            check_fetchable(source.url or "", limits.allowed, param)
            missing.append((source.url or "", param))
    if missing:
        raise ImagesToFetch(missing)
    return [
        BytesImageSource(fetched[source.url or ""], source.detail, path=source.path)
        if source.kind == "url"
        else source
        for source in sources
    ]


def new_resolver(limits: ImageLimits) -> ImageResolver:
    """The recipe's resolver; its fetcher is never used (URLs are refused before it)."""
    return ImageResolver(
        ReqwestImageFetcher.with_max_bytes(limits.max_image_bytes), OpenCvImagePreprocessor()
    )


def mentions_images(raw: bytes) -> bool:
    """Whether a request body may hold images (cheap; a false positive only costs a thread)."""
    return b"image" in raw


def place_images(
    prompt_token_ids: list[int], images: Images, policy: ImagePolicy
) -> tuple[list[int], Images]:
    """The prompt with the engine's image placeholder where the recipe rendered its own, and
    the images counted at the engine's token counts (`ImagePolicy`); a 400 where the engine
    takes no images."""
    if policy.placeholder_id is None:
        raise BadRequestError(
            f"this server cannot take images: {policy.refusal}",
            param="messages",
            kind=ErrorKind.UNSUPPORTED,
            code="unsupported_content",
        )
    rendered = policy.rendered_id
    positions = [index for index, token in enumerate(prompt_token_ids) if token == rendered]
    if len(positions) != len(images.sizes):
        raise BadRequestError(
            f"the prompt holds {len(positions)} image placeholders for {len(images.sizes)} "
            "images (a message's text spells the image placeholder token)",
            param="messages",
        )
    if policy.placeholder_id != rendered:
        prompt_token_ids = list(prompt_token_ids)
        for index in positions:
            prompt_token_ids[index] = policy.placeholder_id
    if policy.geometry is not None:
        geometry = policy.geometry
        extra = sum(geometry.token_count(width, height) - 1 for width, height in images.sizes)
        images = msgspec.structs.replace(images, extra_tokens=extra)
    return prompt_token_ids, images
