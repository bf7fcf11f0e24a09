"""The `kv_transfer_params` handoff: what a prefill server's answer hands a decode server.

A prefill server's answer carries a top-level `kv_transfer_params` object (vLLM's field, which
the gateways copy verbatim from the prefill answer into the decode request); `KVTransferParams`
is its schema, validated on the decode side.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from deepinfer_server.model.kv_block import BLOCK_SIZE

_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """Where a decode server pulls one prefilled prompt's KV from, and what it must find there.

    `remote_port` is the prefill rank's transfer-engine session port, `remote_bootstrap_port`
    the bootstrap port of the rank holding the KV (`remote_dp_rank`), `remote_kv_address` and
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
    block_size: Annotated[int, msgspec.Meta(ge=1)] = BLOCK_SIZE
    #: A digest of the held rows (sampled windows of each block row and the state row) the
    #: decode side compares after its pull (None: the prefill engine computes none).
    kv_digest: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    #: Unix second after which the handoff is refused (`handoff.signing`).
    expires_at: int | None = None
    #: The prefill server's HMAC-SHA256 over the other fields, the prompt and `expires_at`.
    signature: str | None = None
    #: Set by the decode server once the handoff verified: the proof its release carries. Never
    #: read from a request nor written into an answer.
    release_proof: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The object a prefill answer carries."""
        wire: dict[str, Any] = msgspec.to_builtins(self)
        del wire["release_proof"]
        return wire


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
    params.release_proof = None
    if params.block_size != BLOCK_SIZE:
        raise ValueError(f"kv_transfer_params.block_size must be {BLOCK_SIZE}")
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
