"""The HTTP option groups: CORS, media, request limits and timeouts, the grammar compile
queue and connections."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from deepinfer_server.config.option_field import float_option, int_option, option


@dataclass(frozen=True)
class HttpOptions:
    """CORS, images, request sizes and timeouts, grammar compiles and connection limits."""

    allowed_origins: tuple[str, ...] = option(
        (),
        "--allowed-origins",
        help="CORS: an allowed origin, or '*'; repeatable (default: no CORS)",
        action="append",
    )
    allowed_methods: tuple[str, ...] = option(
        (),
        "--allowed-methods",
        help="CORS: an allowed method; repeatable (default with origins: '*')",
        action="append",
    )
    allowed_headers: tuple[str, ...] = option(
        (),
        "--allowed-headers",
        help="CORS: an allowed request header; repeatable (default with origins: '*')",
        action="append",
    )
    max_request_bytes: int = int_option(
        8 * 1024 * 1024,
        "--max-request-bytes",
        help="largest request body accepted; larger ones get 413 (default: %(default)s)",
    )
    max_images_per_request: int = int_option(
        8,
        "--max-images-per-request",
        help="most images one request may hold; more get 400 (default: %(default)s)",
    )
    max_image_bytes: int = int_option(
        10 * 1024 * 1024,
        "--max-image-bytes",
        help="largest image (encoded bytes) accepted; larger ones get 413 (default: %(default)s)",
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        "--allowed-media-domains",
        help="fetch http(s) image URLs from this host: HOST (exact name, its default port 80 or "
        "443 only) or HOST:PORT; repeatable (default: none, image URLs are refused and only "
        "inline images accepted)",
        action="append",
    )
    media_fetch_timeout: float = float_option(
        10.0,
        "--media-fetch-timeout",
        help="seconds an image URL's whole fetch may take: connecting, headers, body and "
        "redirects (default: %(default)s)",
    )
    body_read_timeout: float = float_option(
        60.0,
        "--body-read-timeout",
        help="seconds a client may take to send its request body before 408 (default: %(default)s)",
    )
    header_timeout: float = float_option(
        20.0,
        "--header-timeout",
        help="seconds a client may take to send a request's headers, from its first byte or "
        "from connecting; the connection is then closed (default: %(default)s)",
    )
    write_timeout: float = float_option(
        30.0,
        "--write-timeout",
        help="seconds a client may take no data of a response (acknowledge nothing while data "
        "waits) before the connection is closed and its request aborted (default: %(default)s)",
    )
    sse_keepalive_seconds: float = float_option(
        15.0,
        "--sse-keepalive-seconds",
        help="seconds a stream may send nothing (its request waiting in the queue or "
        "prefilling) before a keep-alive goes out, and again each as long: Anthropic's `ping` "
        "event on /v1/messages, an SSE comment elsewhere; under common proxy idle timeouts; "
        "0 sends none (default: %(default)s)",
    )
    max_queued_compiles_per_key: int = int_option(
        8,
        "--max-queued-compiles-per-key",
        help="structured-output grammars one API key may have compiling or waiting to compile "
        "in an API server process; beyond it 429 with Retry-After (default: %(default)s)",
    )
    grammar_queue_timeout: float = float_option(
        60.0,
        "--grammar-queue-timeout",
        help="seconds a grammar may wait for a compile worker (taken in turn between API keys) "
        "before its request gets 503 with Retry-After (default: %(default)s)",
    )
    grammar_warmup: bool = option(
        True,
        "--grammar-warmup",
        help="prepare the grammar compile workers and vocabulary in the background once the "
        "server listens (and each simulated rank's once it is ready), so that the first "
        "structured request does not wait for them (/health says 503 starting until they are "
        "warm, at most 180 s); about 20 s of CPU per server, which --no-grammar-warmup leaves "
        "to the first structured request (default: on)",
        action=argparse.BooleanOptionalAction,
    )
    max_connections: int = int_option(
        1000,
        "--max-connections",
        help="open HTTP connections served; beyond it only /health and /metrics are answered "
        "(default: %(default)s)",
    )
    max_header_bytes: int = int_option(
        64 * 1024,
        "--max-header-bytes",
        help="largest request head (request line and headers) accepted; larger ones get 431 "
        "(default: %(default)s)",
    )
    max_header_line_bytes: int = int_option(
        8 * 1024,
        "--max-header-line-bytes",
        help="longest request line or header line accepted, its CRLF included, as nginx's "
        "large_client_header_buffers; a longer header gets 431, a longer request line 414 "
        "(default: %(default)s)",
    )
    max_receive_buffer_mb: int = int_option(
        256,
        "--max-receive-buffer-mb",
        help="memory in MiB the requests still being received (their headers and bodies) may "
        "hold in each API server process; past it new ones get 503 with Retry-After "
        "(default: %(default)s)",
    )
