"""A tiny logging reverse proxy: records every exchange between a real client and the server.

The server's own `--log-requests` lines carry neither headers nor query strings and cut bodies at
64 KiB (Claude Code's first request is larger), so the client tests put this in between instead.
It streams responses through unbuffered (server-sent events arrive as the server writes them).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}
KEPT_RESPONSE_BYTES = 1 << 20


@dataclass
class Exchange:
    """One request as the client sent it, and the server's answer."""

    method: str
    target: str  # path with query string, as sent
    headers: dict[str, str]  # lower-case names
    body: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytes = b""  # first KEPT_RESPONSE_BYTES of the response body

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> str:
        return urlsplit(self.target).query

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def response_json(self) -> Any:
        return json.loads(self.response)

    @property
    def response_text(self) -> str:
        return self.response.decode(errors="replace")

    def summary(self) -> str:
        """One line for failure messages: what was asked and what came back."""
        body = self.response_text
        if len(body) > 600:
            body = body[:600] + "…"
        return f"{self.method} {self.target} -> {self.status} {body}"


class _QuietServer(ThreadingHTTPServer):
    """A client closing its keep-alive connection between requests is not an error."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class LoggingProxy:
    """Forwards http://127.0.0.1:<port>/… to `upstream` and keeps every `Exchange`."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream_host = parts.hostname or "127.0.0.1"
        self._upstream_port = parts.port or 80
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                exchange = Exchange(
                    self.command,
                    self.path,
                    {name.lower(): value for name, value in self.headers.items()},
                    body,
                )
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                upstream = http.client.HTTPConnection(
                    proxy._upstream_host, proxy._upstream_port, timeout=120
                )
                try:
                    headers = {
                        name: value
                        for name, value in self.headers.items()
                        if name.lower() not in HOP_BY_HOP
                    }
                    headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    exchange.status = response.status
                    exchange.response_headers = {k.lower(): v for k, v in response.getheaders()}
                    self.send_response(response.status)
                    for name, value in response.getheaders():
                        if name.lower() not in HOP_BY_HOP:
                            self.send_header(name, value)
                    if self.command == "HEAD" or response.status in (204, 304):
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while chunk := response.read1(65536):
                        if len(exchange.response) < KEPT_RESPONSE_BYTES:
                            exchange.response += chunk
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                finally:
                    upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _forward

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def mark(self) -> int:
        """The count so far: `since(mark)` gives the exchanges after it."""
        with self._lock:
            return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges[mark:])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LoggingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
