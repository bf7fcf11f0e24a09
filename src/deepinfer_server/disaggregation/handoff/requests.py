"""The API side of the handoff: a request's `kv_transfer_params`, checked against the server's
role, and the prefill answer's handoff.

- NORMAL server (`--disaggregation-mode null`): a non-null `kv_transfer_params` is refused
  (400): this server neither hands off nor takes over KV.
- Prefill server: the field is optional (vLLM's `{"do_remote_decode": true}` is accepted, as
  is its absence); a handoff meant for a decode server is refused. One choice only: the
  answer carries one handoff.
- Decode server: the field is required (a COMPLETION engine cannot prefill, so a request
  without it, for example one a gateway sent straight here because of `n > 1`, is a 400
  naming the parameter) and must be a prefill answer's handoff of this very prompt.

A prefill server's JSON answer gets the handoff as a top-level `kv_transfer_params` object,
which gateways copy verbatim into the decode request; a streamed prefill answer has none.
"""

from __future__ import annotations

from typing import Any

import orjson

from deepinfer_server.disaggregation.handoff.params import (
    KVTransferParams,
    check_prefill_request_params,
    parse_kv_transfer_params,
)
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.errors import BadRequestError

_PARAM = "kv_transfer_params"


def request_kv_transfer(
    body: dict[str, Any],
    mode: DisaggregationRole,
    choices: int,
    prompt_length: int,
    thinking_budget: bool = False,
) -> KVTransferParams | None:
    """The decode request's handoff (None on the other roles); BadRequestError otherwise.

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
        return parse_kv_transfer_params(value, prompt_length)
    except ValueError as exc:
        raise BadRequestError(str(exc), param=_PARAM) from None


def with_handoff(body: bytes, params: KVTransferParams | None) -> bytes:
    """A JSON answer with the prefill engine's handoff as its top-level `kv_transfer_params`."""
    if params is None:
        return body
    answer = orjson.loads(body)
    answer[_PARAM] = params.as_json()
    return orjson.dumps(answer)
