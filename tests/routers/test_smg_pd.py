"""The Shepherd Model Gateway (PyPI `smg`, scripts/install-smg.sh) in prefill/decode mode in
front of two plain simulated servers: what each leg receives.

smg classifies our servers as vLLM-runtime workers (from `owned_by` and `/version`) and so
dispatches vLLM-style: the prefill leg first, not streamed, with its output cap set to 1; then
the decode leg with the client's own body (relayed as SSE when it streams). Servers without a
`--disaggregation-mode` answer both legs in full, so here the decode leg computes the prompt
again; the prefill/decode lane reuses this gateway (the `make_pd_gateway` fixture) with real
prefill and decode servers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from tests.routers.conftest import MakePdGateway
from tests.routers.fleet import MODEL, REPLICA_ARGS, metric_sum, wait_for
from tests.server import LiveServer

pytestmark = [pytest.mark.routers, pytest.mark.e2e, pytest.mark.timeout(120)]

_BODY_LINE = re.compile(r"request \S+ body: (\{.*\})$", re.MULTILINE)
_GENERATED = "deepinfer:request_generation_tokens_sum"


def generation_bodies(server: LiveServer) -> list[dict[str, Any]]:
    """The chat bodies a `--log-requests` server has received, in order."""
    bodies = [json.loads(raw) for raw in _BODY_LINE.findall(server.log)]
    return [body for body in bodies if "messages" in body]


def test_smg_sends_a_one_token_prefill_then_the_full_decode(
    make_pd_gateway: MakePdGateway,
) -> None:
    with (
        LiveServer(*REPLICA_ARGS, "--log-requests") as prefill,
        LiveServer(*REPLICA_ARGS, "--log-requests") as decode,
    ):
        gateway = make_pd_gateway([(prefill.base_url, 8998)], [decode.base_url])
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        messages: Any = [{"role": "user", "content": "Tell me about the sea"}]
        extra = {"ignore_eos": True, "thinking": {"type": "disabled"}}

        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, extra_body=extra
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 12
        streamed = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, stream=True, extra_body=extra
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == answer.choices[0].message.content

        # Both servers logged each body before answering it; their output reaches this
        # process through a pipe-reading thread, so it may trail the answers a little.
        for server in (prefill, decode):
            wait_for(lambda s=server: len(generation_bodies(s)) == 2, "two chat bodies logged", 10)
        prefill_legs, decode_legs = generation_bodies(prefill), generation_bodies(decode)
        for leg in prefill_legs:
            assert leg["max_tokens"] == 1, leg
            assert not leg.get("stream"), leg
            assert leg["messages"] == messages
        for leg, streams in zip(decode_legs, (False, True), strict=True):
            assert leg["max_tokens"] == 12, leg
            assert bool(leg.get("stream")) is streams, leg
            assert leg["messages"] == messages
            assert leg["thinking"] == {"type": "disabled"}, leg
        assert metric_sum(prefill.base_url, _GENERATED) == 2
        assert metric_sum(decode.base_url, _GENERATED) == 24
