"""The bootstrap port's small protocol, spoken between servers in prefill/decode disaggregation.

The bootstrap port (prefill DP rank r listens on `--disaggregation-bootstrap-port` + r, or with
0 on a port of its own choosing; a handoff names its rank's port) takes
one JSON line per connection and answers one: `{"op": "release", "transfer_id": ...,
"proof": ...}` (the decode side has the KV, or gives up on it: the prefill side frees it when
the proof verifies, `handoff.signing`) and `{"op": "ping"}` (a decode server's health probe and
layout handshake: the answer carries the rank's `engine_id` and its KV `layout`,
`disaggregation.layout.KVLayout`). The listening side is `transfer.bootstrap.BootstrapServer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Mapping
from typing import Any

from deepinfer_server.disaggregation.handoff.params import KVTransferParams

_MAX_LINE = 4096
#: Seconds a release notice may take; a prefill side that misses it frees on its timeout.
RELEASE_TIMEOUT = 2.0

logger = logging.getLogger(__name__)


def bootstrap_call(
    host: str, port: int, message: Mapping[str, object], timeout: float
) -> dict[str, Any]:
    """Send one message to a prefill rank's bootstrap port and return its answer (blocking).

    Raises OSError when the peer cannot be reached or answers nothing in `timeout` seconds.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < _MAX_LINE:
            chunk = sock.recv(_MAX_LINE)
            if not chunk:
                break
            data += chunk
    try:
        answer = json.loads(data)
    except ValueError:
        raise OSError(f"bootstrap {host}:{port} answered no JSON line") from None
    if not isinstance(answer, dict):
        raise OSError(f"bootstrap {host}:{port} answered no JSON object")
    return answer


async def bootstrap_ping(host: str, port: int, timeout: float) -> bool:
    """Whether a prefill rank's bootstrap port answers a ping within `timeout` seconds."""
    return await bootstrap_hello(host, port, timeout) is not None


async def bootstrap_hello(host: str, port: int, timeout: float) -> dict[str, object] | None:
    """A prefill rank's answer to a ping (its engine ID and KV layout) within `timeout`
    seconds, or None when it does not answer one."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b'{"op": "ping"}\n')
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        return None
    return answer


def release(params: KVTransferParams) -> None:
    """Tell the prefill rank of `params` it may free that transfer's KV (best effort)."""
    try:
        bootstrap_call(
            params.remote_host,
            params.remote_bootstrap_port,
            {"op": "release", "transfer_id": params.transfer_id, "proof": params.release_proof},
            RELEASE_TIMEOUT,
        )
    except OSError as exc:
        logger.info("release of transfer %s not delivered: %s", params.transfer_id, exc)
