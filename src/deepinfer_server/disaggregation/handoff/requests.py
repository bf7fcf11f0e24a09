"""The API side of the handoff: a request's `kv_transfer_params`, checked against the server's
role, and the prefill answer's handoff.

- NORMAL server (`--disaggregation-mode null`): a non-null `kv_transfer_params` is refused
  (400): this server neither hands off nor takes over KV.
- Prefill server: the field is optional (vLLM's `{"do_remote_decode": true}` is accepted, as
  is its absence); a handoff meant for a decode server is refused. One choice only: the
  answer carries one handoff.
- Decode server: the field is required (a COMPLETION engine cannot prefill, so a request
  without it, for example one a gateway sent straight here because of `n > 1`, is a 400
  naming the parameter) and must be a prefill answer's handoff of this very prompt, signed by
  a prefill server sharing this server's secret and not expired (`handoff.signing`): one that
  does not verify is refused with a 403 before anything is read or reserved.

A prefill server's JSON answer gets the handoff, signed, as a top-level `kv_transfer_params`
object, which gateways copy verbatim into the decode request; a streamed prefill answer has
none.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from deepinfer_server.disaggregation.handoff.params import (
    KVTransferParams,
    check_prefill_request_params,
    parse_kv_transfer_params,
)
from deepinfer_server.disaggregation.handoff.signing import HandoffRefused, HandoffSigner
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import BadRequestError, HandoffUnverifiedError

_PARAM = "kv_transfer_params"


def request_kv_transfer(
    body: dict[str, Any],
    mode: DisaggregationRole,
    choices: int,
    prompt_token_ids: Sequence[int],
    signer: HandoffSigner | None,
    thinking_budget: bool = False,
) -> KVTransferParams | None:
    """The decode request's verified handoff, with its release proof (None on the other
    roles); BadRequestError when it is malformed, HandoffUnverifiedError when it does not verify.

    A decode server cannot honour a reasoning budget: ending the reasoning adds an engine
    request whose prompt holds the reasoning, which a decode engine would have to prefill."""
    value = body.get(_PARAM)
    try:
        if mode is DisaggregationRole.NULL:
            if value is not None:
                raise ValueError(
                    "this server runs no prefill/decode disaggregation role "
                    "(--disaggregation-mode null): kv_transfer_params is not accepted"
                )
            return None
        if choices > 1:
            raise ValueError(
                f"a {mode} server serves one choice per request (n = 1): the KV of one "
                "prompt is handed off once"
            )
        if mode is DisaggregationRole.PREFILL:
            check_prefill_request_params(value)
            return None
        if thinking_budget:
            raise ValueError(
                "a decode server cannot honour a reasoning budget (ending the reasoning "
                "needs a prefill of prompt and reasoning): send the budget to a server "
                "without a disaggregation role"
            )
        if value is None:
            raise ValueError(
                "this is a decode server: it continues prompts a prefill server computed, so a "
                "request needs the kv_transfer_params of the prefill server's answer (send it "
                "through a prefill/decode gateway, or to a prefill server first)"
            )
        params = parse_kv_transfer_params(value, len(prompt_token_ids))
    except ValueError as exc:
        raise BadRequestError(str(exc), param=_PARAM) from None
    return _verified(params, prompt_token_ids, signer)


def _verified(
    params: KVTransferParams, prompt_token_ids: Sequence[int], signer: HandoffSigner | None
) -> KVTransferParams:
    if signer is None:
        raise HandoffUnverifiedError(
            "this decode server has no --disaggregation-secret-file to verify handoffs with",
            param=_PARAM,
        )
    try:
        signer.verify(params, prompt_token_ids, time.time())
    except HandoffRefused as exc:
        raise HandoffUnverifiedError(str(exc), param=_PARAM) from None
    return signer.armed(params)


def with_handoff(
    body: bytes,
    params: KVTransferParams | None,
    signer: HandoffSigner | None,
    prompt_token_ids: Sequence[int],
) -> bytes:
    """A JSON answer with the prefill engine's handoff, signed, as its top-level
    `kv_transfer_params` (unsigned only on a server without a secret, which no decode server
    accepts)."""
    if params is None:
        return body
    if signer is not None:
        params = signer.sign(params, prompt_token_ids, time.time())
    answer = orjson.loads(body)
    answer[_PARAM] = params.as_json()
    return orjson.dumps(answer)
