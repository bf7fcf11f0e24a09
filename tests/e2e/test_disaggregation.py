"""Prefill/decode disaggregation end to end: a prefill server and a decode server (simulated
engine, Mooncake's Transfer Engine between their rank processes), with the test playing a PD
gateway's part as smg does it: the prefill leg first, not streamed, its output cap set to 1;
then the client's own request to the decode server with the prefill answer's top-level
`kv_transfer_params`. Answers must equal a NORMAL server's (the shared server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_call
from tests.conftest import MODEL
from tests.lanes import require_disaggregation
from tests.metrics_scrape import scrape, value
from tests.paths import PD_SECRET_ARGS
from tests.server import LiveServer, wait_until

require_disaggregation()
pytestmark = pytest.mark.disaggregation

COMMON = ("--sim-ttft-ms", "5", "--sim-itl-ms", "2", "--max-model-len", "4096")
#: Long enough for several KV blocks (128 tokens each).
QUESTION = "Tell me about the lighthouse keeper and the storm that night. " * 40


def start_prefill() -> LiveServer:
    """A prefill server whose rank binds a bootstrap port of its own choosing (read back with
    `LiveServer.bootstrap_ports`): no port is picked ahead for it to race other processes for."""
    return start_prefill_with()


def start_prefill_with(*args: str) -> LiveServer:
    """`start_prefill()` with more options."""
    return LiveServer(
        *COMMON,
        *PD_SECRET_ARGS,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        "0",
        *args,
    )


@pytest.fixture(scope="module")
def prefill() -> Iterator[LiveServer]:
    with start_prefill() as server:
        yield server


@pytest.fixture(scope="module")
def decode() -> Iterator[LiveServer]:
    with LiveServer(*COMMON, *PD_SECRET_ARGS, "--disaggregation-mode", "decode") as server:
        yield server


def handoff(server: LiveServer, path: str, body: dict[str, Any], cap: str) -> dict[str, Any]:
    """The prefill leg, as smg sends it: not streamed, one output token."""
    leg = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    leg[cap] = 1
    answer = httpx.post(server.base_url + path, json=leg, timeout=30)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert isinstance(params, dict) and params["do_remote_prefill"] is True
    return params


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def anthropic_client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 60}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_both_legs_is_the_normal_servers_answer(
    prefill: LiveServer, decode: LiveServer, shared_server: LiveServer, stream: bool
) -> None:
    before = scrape(decode.base_url)
    params = handoff(prefill, "/v1/chat/completions", CHAT, "max_tokens")
    messages = CHAT["messages"]
    with openai_client(shared_server) as normal, openai_client(decode) as pd:
        expected = normal.chat.completions.create(model=MODEL, messages=messages, max_tokens=60)
        extra = {"kv_transfer_params": params}
        if stream:
            chunks = pd.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=60, stream=True, extra_body=extra
            )
            parts = [c.choices[0].delta for c in chunks if c.choices]
            content = "".join(d.content or "" for d in parts)
            reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in parts)
        else:
            answer = pd.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=60, extra_body=extra
            )
            content = answer.choices[0].message.content or ""
            reasoning = (answer.choices[0].message.model_extra or {}).get("reasoning_content")
            assert answer.usage == expected.usage
    message = expected.choices[0].message
    assert (content, reasoning) == (message.content, message.model_extra["reasoning_content"])
    after = scrape(decode.base_url)
    computed = "deepinfer:prompt_tokens_computed_total"
    assert value(after, computed) - value(before, computed) <= 128  # at most one block
    moved = "deepinfer:kv_transfer_bytes_total"
    assert value(after, moved) > value(before, moved)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_both_legs_is_the_normal_servers_answer(
    prefill: LiveServer, decode: LiveServer, shared_server: LiveServer, stream: bool
) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 60, "store": False}
    params = handoff(prefill, "/v1/responses", body, "max_output_tokens")
    with openai_client(shared_server) as normal, openai_client(decode) as pd:
        expected = normal.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=60, store=False
        )
        extra = {"kv_transfer_params": params}
        if stream:
            events = pd.responses.create(
                model=MODEL,
                input=QUESTION,
                max_output_tokens=60,
                store=False,
                stream=True,
                extra_body=extra,
            )
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        else:
            text = pd.responses.create(
                model=MODEL, input=QUESTION, max_output_tokens=60, store=False, extra_body=extra
            ).output_text
    assert text == expected.output_text


def blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """The content blocks without thinking signatures (each names its own message)."""
    return [block.model_dump(exclude={"signature"}) for block in message.content]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_through_both_legs_is_the_normal_servers_answer(
    prefill: LiveServer, decode: LiveServer, shared_server: LiveServer, stream: bool
) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 60}
    params = handoff(prefill, "/v1/messages", body, "max_tokens")
    with anthropic_client(shared_server) as normal, anthropic_client(decode) as pd:
        expected = normal.messages.create(model=MODEL, messages=messages, max_tokens=60)  # type: ignore[arg-type]
        extra = {"kv_transfer_params": params}
        if stream:
            with pd.messages.stream(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=60,
                extra_body=extra,
            ) as events:
                answer = events.get_final_message()
        else:
            answer = pd.messages.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=60,
                extra_body=extra,
            )
    assert blocks(answer) == blocks(expected)
    assert answer.stop_reason == expected.stop_reason


def test_the_bootstrap_port_a_prefill_rank_bound_is_reported_and_named_by_its_handoffs(
    prefill: LiveServer, decode: LiveServer
) -> None:
    """With `--disaggregation-bootstrap-port 0` the rank binds a port itself: its server info
    (what gateways read) and its startup log name it, its handoffs carry it, and a decode
    server's health probe reaches it there."""
    (port,) = prefill.bootstrap_ports()
    assert port > 0
    info = httpx.get(f"{prefill.base_url}/server_info", timeout=10).json()
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == ("prefill", port)
    prefill.wait_for_line(f"DP rank 0: disaggregation bootstrap port {port}", 10)
    params = handoff(prefill, "/v1/chat/completions", CHAT, "max_tokens")
    assert (params["remote_bootstrap_port"], params["remote_dp_rank"]) == (port, 0)
    decode_info = httpx.get(f"{decode.base_url}/server_info", timeout=10).json()
    assert decode_info["disaggregation_mode"] == "decode"
    assert decode_info["disaggregation_bootstrap_ports"] == []


def test_each_server_names_the_kv_transport_it_chose_in_its_log_info_and_metrics(
    prefill: LiveServer, decode: LiveServer
) -> None:
    """`auto` on this machine (no RDMA device given, Mooncake's non-CUDA wheel, KV in host
    memory) is TCP: each rank's startup line says so and why, `/server_info` and the
    `kv_transfer_transport_info` gauge name it."""
    for server in (prefill, decode):
        server.wait_for_line("over tcp (auto: no RDMA device given", 10)
        info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
        assert info["disaggregation_transport"] == "tcp"
        info_gauge = "deepinfer:kv_transfer_transport_info"
        assert value(scrape(server.base_url), info_gauge, transport="tcp") == 1


def test_nvlink_is_refused_at_start_by_a_mooncake_build_without_it() -> None:
    """The non-CUDA wheel has no NVLink transport: the rank refuses to start, saying so, and
    the server exits instead of serving over another transport."""
    with pytest.raises(RuntimeError, match=r"server exited \(1\)") as exited:
        LiveServer(
            *COMMON,
            *PD_SECRET_ARGS,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transport",
            "nvlink",
        )
    assert "[startup] failed: DP rank 0 failed: TransportUnavailable" in str(exited.value)
    assert "has no NVLink transport" in str(exited.value)


def test_a_decode_request_without_a_handoff_is_refused_in_the_protocols_shape(
    decode: LiveServer,
) -> None:
    with openai_client(decode) as pd, pytest.raises(openai.BadRequestError) as refused:
        pd.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "kv_transfer_params"  # type: ignore[index]
    with anthropic_client(decode) as pd, pytest.raises(anthropic.BadRequestError) as malformed:
        pd.messages.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"kv_transfer_params": {"do_remote_prefill": True}},
        )
    assert malformed.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_a_forged_handoff_reads_nothing_and_only_a_proven_release_frees_a_hold(
    prefill: LiveServer, decode: LiveServer
) -> None:
    params = handoff(prefill, "/v1/chat/completions", CHAT, "max_tokens")
    forged = {**params, "remote_kv_address": params["remote_kv_address"] + 4096}
    moved, held = "deepinfer:kv_transfer_bytes_total", "deepinfer:kv_transfer_held_requests"
    before = scrape(decode.base_url)
    with openai_client(decode) as pd, pytest.raises(openai.PermissionDeniedError) as refused:
        pd.chat.completions.create(
            model=MODEL,
            messages=CHAT["messages"],  # type: ignore[arg-type]
            max_tokens=5,
            extra_body={"kv_transfer_params": forged},
        )
    assert refused.value.body["code"] == "kv_transfer_params_unverified"  # type: ignore[index]
    assert value(scrape(decode.base_url), moved) == value(before, moved)  # nothing read
    # A release without the pair's proof (as anyone reaching the bootstrap port could send).
    release = {"op": "release", "transfer_id": params["transfer_id"]}
    answer = bootstrap_call("127.0.0.1", params["remote_bootstrap_port"], release, 10)
    assert answer["ok"] is False
    unverified = "deepinfer:kv_transfer_failures_total"
    wait_until(
        lambda: value(scrape(prefill.base_url), unverified, reason="release_unverified") >= 1,
        20,
        "the prefill server counting the unproven release",
    )
    holding = value(scrape(prefill.base_url), held)
    assert holding >= 1  # the hold is still there
    with openai_client(decode) as pd:
        pd.chat.completions.create(
            model=MODEL,
            messages=CHAT["messages"],  # type: ignore[arg-type]
            max_tokens=5,
            extra_body={"kv_transfer_params": params},
        )
    wait_until(
        lambda: value(scrape(prefill.base_url), held) < holding,
        20,
        "the decode server's proven release freeing the hold",
    )


def test_a_prefill_server_gone_before_the_pull_is_a_503_and_leaks_nothing(
    decode: LiveServer,
) -> None:
    with start_prefill() as doomed:
        params = handoff(doomed, "/v1/chat/completions", CHAT, "max_tokens")
        doomed.kill_tree()
    before = scrape(decode.base_url)
    with openai_client(decode) as pd, pytest.raises(openai.APIStatusError) as failed:
        pd.chat.completions.create(
            model=MODEL,
            messages=CHAT["messages"],  # type: ignore[arg-type]
            max_tokens=60,
            extra_body={"kv_transfer_params": params},
        )
    assert failed.value.status_code == 503
    assert failed.value.body["code"] == "kv_transfer_failed"  # type: ignore[index]
    assert "transfer_error" in failed.value.body["message"]  # type: ignore[index]

    def settled() -> bool:
        samples = scrape(decode.base_url)
        gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        return all(value(samples, f"deepinfer:{g}", dp_rank="0") == 0 for g in gauges)

    wait_until(settled, 20, "the decode server's slots and KV back to idle")
    failures = "deepinfer:kv_transfer_failures_total"
    after = scrape(decode.base_url)
    assert value(after, failures, reason="transfer_error") == 1 + value(
        before, failures, reason="transfer_error"
    )


def test_a_prefill_server_of_another_layout_is_refused_at_pairing_and_nothing_is_pulled(
    decode: LiveServer,
) -> None:
    """Prefill with a speculative token, decode without: the state rows are sized differently,
    so the decode server refuses the pair before any pull, naming the field and both values,
    and tells the prefill server to free the prompt's KV at once (not at its hold timeout)."""
    before = scrape(decode.base_url)
    held = "deepinfer:kv_transfer_held_requests"
    with start_prefill_with("--speculative-tokens", "1") as speculating:
        params = handoff(speculating, "/v1/chat/completions", CHAT, "max_tokens")
        wait_until(lambda: value(scrape(speculating.base_url), held) == 1, 20, "the KV held")
        with openai_client(decode) as pd, pytest.raises(openai.APIStatusError) as refused:
            pd.chat.completions.create(
                model=MODEL,
                messages=CHAT["messages"],  # type: ignore[arg-type]
                max_tokens=60,
                extra_body={"kv_transfer_params": params},
            )
        health = httpx.get(decode.base_url + "/health", timeout=30)
        # Well within the default 60 s hold: only the release notice frees it this soon.
        wait_until(lambda: value(scrape(speculating.base_url), held) == 0, 20, "the KV freed")
    assert refused.value.status_code == 503
    body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
    assert body["code"] == "kv_layout_mismatch" and body["param"] == "kv_transfer_params"
    assert "speculative_tokens (prefill 1, decode 0)" in body["message"]
    # 503 when this is the only prefill server the decode server knows, else 200: degraded.
    assert health.json()["status"] == "degraded"
    assert "speculative_tokens (prefill 1, decode 0)" in health.json()["reason"]
    after = scrape(decode.base_url)
    moved = "deepinfer:kv_transfer_bytes_total"
    assert value(after, moved) == value(before, moved)


def two_stored_turns(normal: openai.OpenAI, routed: openai.OpenAI) -> int:
    """Two Responses turns with the openai client's defaults (smg adds `store: true` to both
    legs), the second by `previous_response_id`: the decode server stores each turn, the
    prefill server stores none and reads the first from the store both share (the tests'
    servers share one SQLite store). Returns the requests sent through the gateway."""
    answers: list[list[str]] = []
    for client in (normal, routed):
        first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30)
        second = client.responses.create(
            model=MODEL,
            input="And what did the keeper see?",
            previous_response_id=first.id,
            max_output_tokens=30,
        )
        assert second.previous_response_id == first.id
        answers.append([first.output_text, second.output_text])
    assert answers[1] == answers[0]
    return 2


def test_smg_in_pd_mode_answers_each_api_as_a_normal_server(
    prefill: LiveServer, decode: LiveServer, shared_server: LiveServer, tmp_path: Path
) -> None:
    """The real gateway: `smg launch --pd-disaggregation --prefill URL PORT --decode URL`
    sends the prefill leg, reads its answer's `kv_transfer_params` and hands it to the decode
    leg; Chat (JSON and SSE), Responses (stored and continued too) and Messages come back as a
    NORMAL server answers them, the decode server computing at most one block of each prompt
    while KV bytes move."""
    from tests.routers.fleet import pd_gateway  # skips without scripts/install-smg.sh's smg

    messages: Any = CHAT["messages"]
    with pd_gateway(
        [(prefill.base_url, prefill.bootstrap_ports()[0])], [decode.base_url], tmp_path / "smg.log"
    ) as gateway:
        before = scrape(decode.base_url)
        requests = 0
        with (
            openai_client(shared_server) as normal,
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as routed,
        ):
            expected = (
                normal.chat.completions.create(model=MODEL, messages=messages, max_tokens=60)
                .choices[0]
                .message
            )
            answer = routed.chat.completions.create(model=MODEL, messages=messages, max_tokens=60)
            assert answer.choices[0].message.content == expected.content
            chunks = routed.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=60, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == expected.content
            text = normal.responses.create(
                model=MODEL, input=QUESTION, max_output_tokens=60, store=False
            ).output_text
            routed_text = routed.responses.create(
                model=MODEL, input=QUESTION, max_output_tokens=60, store=False
            ).output_text
            assert routed_text == text
            requests += 3
            requests += two_stored_turns(normal, routed)
        with (
            anthropic_client(shared_server) as normal_messages,
            anthropic.Anthropic(
                base_url=gateway.url, api_key="unused", max_retries=0
            ) as routed_messages,
        ):
            wanted = normal_messages.messages.create(model=MODEL, messages=messages, max_tokens=60)
            got = routed_messages.messages.create(model=MODEL, messages=messages, max_tokens=60)
            assert blocks(got) == blocks(wanted)
            requests += 1
        after = scrape(decode.base_url)
    computed = "deepinfer:prompt_tokens_computed_total"
    assert value(after, computed) - value(before, computed) <= 128 * requests
    moved = "deepinfer:kv_transfer_bytes_total"
    assert value(after, moved) > value(before, moved)
