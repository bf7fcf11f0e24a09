"""The Shepherd Model Gateway (PyPI `smg`, scripts/install-smg.sh) in prefill/decode mode in
front of two plain simulated servers: what each leg receives.

smg classifies our servers as vLLM-runtime workers (from `owned_by` and `/version`) and so
dispatches vLLM-style: the prefill leg first, not streamed, with its output cap set to 1; then
the decode leg with the client's own body (relayed as SSE when it streams). Servers without a
`--disaggregation-mode` answer both legs in full, so here the decode leg computes the prompt
again; tests/e2e/test_disaggregation.py puts the same gateway (`fleet.pd_gateway`) in front of
real prefill and decode servers, where the prefill answer's `kv_transfer_params` reaches the
decode leg.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.routers.conftest import MakePdGateway
from tests.routers.fleet import MODEL, REPLICA_ARGS, Router, metric_sum, wait_for
from tests.server import LiveServer

pytestmark = [pytest.mark.routers, pytest.mark.e2e, pytest.mark.timeout(120)]

_BODY_LINE = re.compile(r"request \S+ body: (\{.*\})$", re.MULTILINE)
_GENERATED = "deepinfer:request_generation_tokens_sum"
MESSAGES: Any = [{"role": "user", "content": "Tell me about the sea"}]
NO_THINKING = {"thinking": {"type": "disabled"}}


def bodies(server: LiveServer) -> list[dict[str, Any]]:
    """The JSON bodies a `--log-requests` server has received, in order."""
    return [json.loads(raw) for raw in _BODY_LINE.findall(server.log)]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LiveServer, LiveServer]]:
    """A prefill-side and a decode-side server (today's plain servers), logging bodies."""
    with (
        LiveServer(*REPLICA_ARGS, "--log-requests") as prefill,
        LiveServer(*REPLICA_ARGS, "--log-requests") as decode,
    ):
        yield prefill, decode


def legs(
    servers: tuple[LiveServer, LiveServer], before: tuple[int, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one body each server received since `before` (their body counts then)."""
    # Both servers logged the body before answering it; their output reaches this process
    # through a pipe-reading thread, so it may trail the answers a little.
    for server, count in zip(servers, before, strict=True):
        wait_for(lambda s=server, n=count: len(bodies(s)) > n, "the leg's body logged", 10)
    (prefill_leg,) = bodies(servers[0])[before[0] :]
    (decode_leg,) = bodies(servers[1])[before[1] :]
    return prefill_leg, decode_leg


def counts(servers: tuple[LiveServer, LiveServer]) -> tuple[int, int]:
    return len(bodies(servers[0])), len(bodies(servers[1]))


@pytest.fixture()
def gateway(servers: tuple[LiveServer, LiveServer], make_pd_gateway: MakePdGateway) -> Router:
    prefill, decode = servers
    return make_pd_gateway([(prefill.base_url, 8998)], [decode.base_url])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_prefill_leg_is_one_token_then_the_decode_leg_is_the_clients(
    servers: tuple[LiveServer, LiveServer], gateway: Router, stream: bool
) -> None:
    prefill, decode = servers
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    before = counts(servers)
    generated = metric_sum(prefill.base_url, _GENERATED), metric_sum(decode.base_url, _GENERATED)
    extra = {"ignore_eos": True, **NO_THINKING}
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, extra_body=extra
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=extra
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 12
        text = answer.choices[0].message.content or ""
    assert text

    prefill_leg, decode_leg = legs(servers, before)
    assert prefill_leg["max_tokens"] == 1, prefill_leg
    assert not prefill_leg.get("stream"), prefill_leg
    assert prefill_leg["messages"] == MESSAGES
    assert decode_leg["max_tokens"] == 12, decode_leg
    assert bool(decode_leg.get("stream")) is stream, decode_leg
    assert decode_leg["messages"] == MESSAGES
    assert decode_leg["thinking"] == NO_THINKING["thinking"], decode_leg
    assert metric_sum(prefill.base_url, _GENERATED) - generated[0] == 1
    assert metric_sum(decode.base_url, _GENERATED) - generated[1] == 12


def test_responses_and_messages_are_routed_in_pd_mode(
    servers: tuple[LiveServer, LiveServer], gateway: Router
) -> None:
    before = counts(servers)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    # smg checks Responses bodies against its own schema: `thinking` there is a 400.
    response = client.responses.create(
        model=MODEL, input="Tell me about the sea", max_output_tokens=10
    )
    assert response.usage is not None and response.usage.output_tokens > 1
    prefill_leg, decode_leg = legs(servers, before)
    assert (prefill_leg["max_output_tokens"], decode_leg["max_output_tokens"]) == (1, 10)
    assert prefill_leg["input"] == decode_leg["input"] == "Tell me about the sea"
    # The client sent no `store`; smg sets OpenAI's default on both legs.
    assert prefill_leg["store"] is decode_leg["store"] is True

    before = counts(servers)
    second = client.responses.create(
        model=MODEL, input="And the sky?", previous_response_id=response.id, max_output_tokens=10
    )
    assert second.previous_response_id == response.id
    prefill_leg, decode_leg = legs(servers, before)
    assert prefill_leg["previous_response_id"] == decode_leg["previous_response_id"] == response.id

    before = counts(servers)
    messages = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    message = messages.messages.create(
        model=MODEL, max_tokens=10, messages=MESSAGES, extra_body=NO_THINKING
    )
    assert message.usage.output_tokens > 1
    prefill_leg, decode_leg = legs(servers, before)
    assert (prefill_leg["max_tokens"], decode_leg["max_tokens"]) == (1, 10)
    # smg keeps `thinking` on both legs.
    assert prefill_leg["thinking"] == decode_leg["thinking"] == NO_THINKING["thinking"]
