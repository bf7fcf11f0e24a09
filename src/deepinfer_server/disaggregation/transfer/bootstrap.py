"""BootstrapServer: a prefill rank's bootstrap port (`handoff.bootstrap`'s protocol).

A ping's answer carries the rank's engine ID and its KV layout (`disaggregation.layout`), which
a decode server compares with its own before it pulls. It runs in threads of its own beside the
rank's loop: a release notice is queued for the loop's thread (the engine's owner), which frees
the held KV at its next step. A release without a valid proof (`handoff.signing`) is ignored
and counted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.transfer.queues import drain

logger = logging.getLogger(__name__)


class _Handler(socketserver.StreamRequestHandler):
    server: _Server
    timeout = 5.0

    def handle(self) -> None:
        try:
            message = json.loads(self.rfile.readline(4096))
        except (ValueError, OSError):
            return
        answer: dict[str, Any] = {"ok": False}
        if isinstance(message, dict):
            op = message.get("op")
            if op == "ping":
                answer = {
                    "ok": True,
                    "engine_id": self.server.engine_id,
                    "layout": self.server.layout,
                }
            elif op == "release" and isinstance(message.get("transfer_id"), str):
                answer = self.server.release(message["transfer_id"], message.get("proof"))
        with contextlib.suppress(OSError):
            self.wfile.write(json.dumps(answer).encode() + b"\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    engine_id: str
    layout: dict[str, object] | None
    released: queue.SimpleQueue[str]
    verify_release: Callable[[str, object], bool]
    refused: int = 0
    lock: threading.Lock

    def release(self, transfer_id: str, proof: object) -> dict[str, Any]:
        """Queue a proven release; count and ignore one without a valid proof."""
        if self.verify_release(transfer_id, proof):
            self.released.put(transfer_id)
            return {"ok": True}
        with self.lock:
            self.refused += 1
        logger.warning("ignored a release of transfer %s without a valid proof", transfer_id)
        return {"ok": False, "error": "release proof does not verify"}


class BootstrapServer:
    """Listens on `host:port` until `close()`; `take_released()` drains the release notices."""

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        verify_release: Callable[[str, object], bool],
    ) -> None:
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            raise RuntimeError(
                f"the disaggregation bootstrap port {host}:{port} is not free: {exc}"
            ) from exc
        self._server.engine_id = engine_id
        self._server.layout = None
        self._server.released = queue.SimpleQueue()
        self._server.verify_release = verify_release
        self._server.lock = threading.Lock()
        #: The bound port (the one asked for, or the kernel's choice when that was 0).
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pd-bootstrap", daemon=True
        )
        self._thread.start()

    def publish(self, layout: KVLayout) -> None:
        """Answer pings with the rank's KV layout from now on (decode servers compare it with
        theirs before they pull)."""
        self._server.layout = layout.as_json()

    def take_released(self) -> list[str]:
        """The transfer IDs released since the last call."""
        return drain(self._server.released)

    @property
    def refused_releases(self) -> int:
        """Releases ignored since the start because their proof did not verify."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
