"""The bootstrap port's small protocol, spoken between servers in prefill/decode disaggregation.

The bootstrap port (prefill DP rank r listens on `--disaggregation-bootstrap-port` + r, or with
0 on a port of its own choosing; a handoff names its rank's port) takes
one JSON line per connection and answers one: `{"op": "release", "transfer_id": ...,
"proof": ...}` (the decode side has the KV, or gives up on it: the prefill side frees it when
the proof verifies, `handoff.signing`) and `{"op": "ping"}` (a decode server's health probe).
The listening side is `transfer.bootstrap.BootstrapServer`.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Mapping
from typing import Any

_MAX_LINE = 4096


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
        return False
    try:
        answer = json.loads(line)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get("ok") is True
