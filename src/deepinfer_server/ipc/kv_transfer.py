"""What crosses servers in prefill/decode disaggregation: the `kv_transfer_params` handoff and
the bootstrap port's small protocol.

A prefill server's answer carries a top-level `kv_transfer_params` object (vLLM's field, which
the gateways copy verbatim from the prefill answer into the decode request); `KVTransferParams`
is its schema, validated on the decode side. The bootstrap port (prefill DP rank r listens on
`--disaggregation-bootstrap-port` + r) takes one JSON line per connection and answers one:
`{"op": "release", "transfer_id": ...}` (the decode side has the KV, or gives up on it: the
prefill side frees it) and `{"op": "ping"}` (a decode server's health probe).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Annotated, Any

import msgspec

#: Positions per KV block in the handoff (both engines' block size).
KV_BLOCK_SIZE = 128

_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """Where a decode server pulls one prefilled prompt's KV from, and what it must find there.

    `remote_port` is the prefill rank's transfer-engine session port, `remote_kv_address` and
    `remote_state_address` the registered memory its blocks and state slot sit in;
    `remote_engine_id` names the prefill engine that wrote them (provenance).
    """

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    remote_port: _Port
    remote_bootstrap_port: _Port
    remote_dp_rank: _NonNegative
    remote_engine_id: _Id
    transfer_id: _Id
    remote_block_ids: list[Annotated[int, msgspec.Meta(ge=1)]]
    remote_kv_address: Annotated[int, msgspec.Meta(ge=1)]
    remote_state_address: Annotated[int, msgspec.Meta(ge=1)]
    remote_state_slot: Annotated[int, msgspec.Meta(ge=1)]
    first_token_id: _NonNegative
    prompt_length: Annotated[int, msgspec.Meta(ge=1)]
    block_size: Annotated[int, msgspec.Meta(ge=1)] = KV_BLOCK_SIZE

    def as_json(self) -> dict[str, Any]:
        """The object a prefill answer carries."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


def parse_kv_transfer_params(value: object, prompt_length: int | None = None) -> KVTransferParams:
    """A decode request's `kv_transfer_params`, checked; ValueError names what is wrong.

    With `prompt_length` (the decode server's own encoding of the prompt) the handoff must be
    of a prompt of that length: the gateway sends both legs the same body.
    """
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_params must be an object")
    if not value.get("do_remote_prefill"):
        raise ValueError(
            "kv_transfer_params is not a prefill server's handoff (do_remote_prefill is not "
            "true): a decode server only continues prompts a prefill server computed"
        )
    try:
        params = msgspec.convert(value, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer_params: {exc}") from None
    if params.block_size != KV_BLOCK_SIZE:
        raise ValueError(f"kv_transfer_params.block_size must be {KV_BLOCK_SIZE}")
    blocks = -(-params.prompt_length // params.block_size)
    if len(params.remote_block_ids) != blocks:
        raise ValueError(
            f"kv_transfer_params.remote_block_ids must hold {blocks} blocks for a "
            f"{params.prompt_length}-token prompt"
        )
    if prompt_length is not None and prompt_length != params.prompt_length:
        raise ValueError(
            f"kv_transfer_params describe a {params.prompt_length}-token prompt, but this "
            f"request's prompt has {prompt_length} tokens: the decode request must repeat the "
            "prefill request"
        )
    return params


def check_prefill_request_params(value: object) -> None:
    """A prefill request's `kv_transfer_params` (vLLM's `{"do_remote_decode": true}`, or
    nothing): anything else is refused."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_params must be an object")
    if value.get("do_remote_prefill"):
        raise ValueError(
            "this is a prefill server: kv_transfer_params with do_remote_prefill belong in a "
            "request to a decode server"
        )


# The bootstrap port's protocol

_MAX_LINE = 4096


def bootstrap_call(host: str, port: int, message: dict[str, Any], timeout: float) -> dict[str, Any]:
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
