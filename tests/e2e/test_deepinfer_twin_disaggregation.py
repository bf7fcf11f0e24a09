"""Prefill/decode disaggregation on DeepInfer's own engines (the CPU twin): a PROMPT twin server
and a COMPLETION twin server, each its own process tree, with Mooncake's Transfer Engine moving
the KV between their rank processes, and the test playing the PD gateway's part as
`test_disaggregation.py` does.

What the twin's forward checks makes the provenance real: before every forward, each position
a scheduled sequence attends to must hold exactly its own token at its own position, and its
state slot must be at that position with the digest of its prefix (DEEPINFER_TWIN_CHECK_KV=1:
a violation fails the rank). The decode server computes only the prompt's last token, so every
other position its first decode step reads came through the transfer, written by the prefill
server's prompt step. Answers must equal a NORMAL twin server's under
DEEPINFER_BATCH_INVARIANT=1 with a seed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import psutil
import pytest

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.handoff.signing import HandoffSigner
from tests.checkpoint import write_checkpoint
from tests.conftest import MODEL
from tests.deepinfer_twin import engine_env
from tests.lanes import require_disaggregation
from tests.metrics_scrape import scrape, value
from tests.paths import PD_SECRET, PD_SECRET_ARGS
from tests.server import LiveServer, wait_until

require_disaggregation()
pytestmark = [pytest.mark.deepinfer_twin, pytest.mark.disaggregation]

#: Several KV blocks (128 tokens each) and a partial last one.
QUESTION = "Tell me about the lighthouse keeper and the storm that night. " * 30
#: Eight GPUs on the node: DeepInfer's grammar workers need CPUs per GPU (structured output).
ENV = {
    **engine_env("0,1,2,3,4,5,6,7"),
    "DEEPINFER_BATCH_INVARIANT": "1",
    "DEEPINFER_TWIN_CHECK_KV": "1",
}
COMMON = ("--ep", "1", "--max-model-len", "4096", "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin-pd") / "DeepSeek-V4.1-Flash")


def start(checkpoint: Path, *args: str) -> LiveServer:
    return LiveServer(
        str(checkpoint),
        *COMMON,
        *PD_SECRET_ARGS,
        *args,
        engine="deepinfer",
        env=ENV,
        startup_timeout=180,
    )


#: Seconds the shared prefill server holds KV no decode server releases.
HOLD_TIMEOUT = 20
#: Seconds the shared decode server waits for a request's KV.
TRANSFER_TIMEOUT = 8


def start_prefill(checkpoint: Path) -> LiveServer:
    return start_prefill_with(checkpoint)


def start_prefill_with(checkpoint: Path, *args: str) -> LiveServer:
    """`start_prefill` with more options."""
    return start(
        checkpoint,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        "0",
        "--disaggregation-kv-hold-timeout",
        str(HOLD_TIMEOUT),
        *args,
    )


@pytest.fixture(scope="module")
def normal(checkpoint: Path) -> Iterator[LiveServer]:
    with start(checkpoint) as server:
        yield server


@pytest.fixture(scope="module")
def prefill(checkpoint: Path) -> Iterator[LiveServer]:
    with start_prefill(checkpoint) as server:
        yield server


@pytest.fixture(scope="module")
def decode(checkpoint: Path) -> Iterator[LiveServer]:
    with start(
        checkpoint,
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-timeout",
        str(TRANSFER_TIMEOUT),
    ) as server:
        yield server


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 40,
        "seed": 7,
        **extra,
    }


def handoff(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg, as smg sends it: not streamed, one output token."""
    leg = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    leg["max_tokens"] = 1
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=leg, timeout=60)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert isinstance(params, dict) and params["do_remote_prefill"] is True
    return params


def resigned(server: LiveServer, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`params` signed again with the pair's secret for `body`'s prompt (as `/tokenize` renders
    it: the rendering Chat uses)."""
    tokenized = httpx.post(
        server.base_url + "/tokenize",
        json={"model": MODEL, "messages": body["messages"]},
        timeout=30,
    )
    assert tokenized.status_code == 200, tokenized.text
    signer = HandoffSigner(PD_SECRET.read_bytes().strip(), HOLD_TIMEOUT)
    unsigned = msgspec.convert(params, KVTransferParams)
    return signer.sign(unsigned, tokenized.json()["tokens"], time.time()).as_json()


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def idle(server: LiveServer) -> bool:
    """No request, no KV block in use and (a prefill server) no prompt held."""
    return idle_rank(server, "0")


def idle_rank(server: LiveServer, dp_rank: str) -> bool:
    """`idle` for one DP rank (the held prompts: the server's)."""
    samples = scrape(server.base_url)
    rank = frozenset({("model_name", MODEL), ("dp_rank", dp_rank)})
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    names = [(f"deepinfer:{gauge}", rank) for gauge in gauges]
    names.append(("deepinfer:kv_transfer_held_requests", frozenset({("model_name", MODEL)})))
    assert all(name in samples for name in names)
    return all(samples[name] == 0 for name in names)


@pytest.mark.parametrize("stream", [False, True])
def test_the_decode_servers_answer_from_pulled_kv_is_the_normal_servers(
    checkpoint: Path,
    normal: LiveServer,
    prefill: LiveServer,
    decode: LiveServer,
    stream: bool,
) -> None:
    body = chat()
    with client(normal) as plain:
        expected = plain.chat.completions.create(**body)
    before = scrape(decode.base_url)
    params = handoff(prefill, body)
    blocks = -(-params["prompt_length"] // 128)
    assert len(params["remote_block_ids"]) == blocks > 1
    with client(decode) as pd:
        extra = {"kv_transfer_params": params}
        if stream:
            chunks = pd.chat.completions.create(**body, stream=True, extra_body=extra)
            parts = [c.choices[0].delta for c in chunks if c.choices]
            content = "".join(d.content or "" for d in parts)
            reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in parts)
        else:
            answer = pd.chat.completions.create(**body, extra_body=extra)
            content = answer.choices[0].message.content or ""
            reasoning = (answer.choices[0].message.model_extra or {}).get("reasoning_content")
            assert answer.usage == expected.usage
    message = expected.choices[0].message
    assert content
    assert (content, reasoning or None) == (
        message.content,
        (message.model_extra or {}).get("reasoning_content") or None,
    )
    after = scrape(decode.base_url)
    # The decode server computed the prompt's last token only: every other position its
    # decode steps attended to (checked by the twin's forward) came from the prefill server.
    computed = "deepinfer:prompt_tokens_computed_total"
    assert value(after, computed) - value(before, computed) == 1
    moved = "deepinfer:kv_transfer_bytes_total"
    assert value(after, moved) - value(before, moved) > 0
    wait_until(lambda: idle(decode), 20, "the decode server's slots and KV back to idle")
    # Released by the decode side at once, long before the hold would time out.
    wait_until(lambda: idle(prefill), HOLD_TIMEOUT / 2, "the prefill server's held KV released")
    assert httpx.get(decode.base_url + "/health", timeout=10).status_code == 200


def test_concurrent_requests_share_both_servers_steps_and_each_gets_its_own_answer(
    normal: LiveServer, prefill: LiveServer, decode: LiveServer
) -> None:
    # Prompts that reach the prefill rank together are placed as a batch (in reverse: DeepInfer
    # takes forks from the front of its queue); pulls and forks share the decode batch.
    bodies = [
        chat(messages=[{"role": "user", "content": f"Story {n}: " + QUESTION[: 300 * (n + 1)]}])
        for n in range(4)
    ]
    with client(normal) as plain:
        expected = [plain.chat.completions.create(**b).choices[0].message.content for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        handoffs = list(pool.map(lambda b: handoff(prefill, b), bodies))
        with client(decode) as pd:
            answers = list(
                pool.map(
                    lambda pair: pd.chat.completions.create(
                        **pair[0], extra_body={"kv_transfer_params": pair[1]}
                    ),
                    zip(bodies, handoffs, strict=True),
                )
            )
    assert len({tuple(h["remote_block_ids"]) for h in handoffs}) == len(bodies)
    assert [a.choices[0].message.content for a in answers] == expected
    assert len(set(expected)) == len(bodies)
    wait_until(lambda: idle(decode), 20, "the decode server's slots and KV back to idle")
    wait_until(lambda: idle(prefill), HOLD_TIMEOUT / 2, "the prefill server's held KV released")


def test_two_dp_ranks_on_each_side_hand_off_between_any_pair(
    checkpoint: Path, normal: LiveServer
) -> None:
    # Each prefill rank holds its prompts behind its own bootstrap port (with 0, one it bound) and
    # transfer engine; each decode rank pulls from whichever rank its handoff names. Without
    # zero-overhead scheduling (a PROMPT engine's default) DeepInfer's work check all-reduces
    # over the DP group on the GPU; the twin has none, so its ranks schedule with it on.
    env = {**ENV, "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"}
    common = ("--max-model-len", "4096", "--served-model-name", MODEL, "--ep", "2", "--dp", "2")
    prefill_args = (
        *PD_SECRET_ARGS,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        "0",
    )
    bodies = [
        chat(messages=[{"role": "user", "content": f"Tale {n}: " + QUESTION[: 250 * (n + 2)]}])
        for n in range(4)
    ]
    with client(normal) as plain:
        expected = [plain.chat.completions.create(**b).choices[0].message.content for b in bodies]
    with (
        LiveServer(
            str(checkpoint),
            *common,
            *prefill_args,
            engine="deepinfer",
            env=env,
            startup_timeout=240,
        ) as prefill,
        LiveServer(
            str(checkpoint),
            *common,
            *PD_SECRET_ARGS,
            "--disaggregation-mode",
            "decode",
            engine="deepinfer",
            env=env,
            startup_timeout=240,
        ) as decode,
        ThreadPoolExecutor(len(bodies)) as pool,
    ):
        handoffs = list(pool.map(lambda b: handoff(prefill, b), bodies))
        with client(decode) as pd:
            answers = list(
                pool.map(
                    lambda pair: pd.chat.completions.create(
                        **pair[0], extra_body={"kv_transfer_params": pair[1]}
                    ),
                    zip(bodies, handoffs, strict=True),
                )
            )
        assert [a.choices[0].message.content for a in answers] == expected
        wait_until(lambda: all(idle_rank(decode, r) for r in "01"), 20, "decode ranks idle")
        wait_until(lambda: all(idle_rank(prefill, r) for r in "01"), 20, "prefill ranks idle")


def test_structured_output_and_responses_through_both_legs_are_the_normal_servers(
    normal: LiveServer, prefill: LiveServer, decode: LiveServer
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    body = chat(
        messages=[{"role": "user", "content": '{"city": "Paris"} ' * 60}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": schema, "strict": True},
        },
    )
    with client(normal) as plain:
        expected = plain.chat.completions.create(**body).choices[0].message.content
    params = handoff(prefill, body)
    with client(decode) as pd:
        answer = pd.chat.completions.create(**body, extra_body={"kv_transfer_params": params})
    assert answer.choices[0].message.content == expected == '{"city": "Paris"}'

    request = {"model": MODEL, "input": QUESTION, "max_output_tokens": 30, "store": False}
    leg = httpx.post(
        prefill.base_url + "/v1/responses", json={**request, "max_output_tokens": 1}, timeout=60
    )
    assert leg.status_code == 200, leg.text
    extra = {"kv_transfer_params": leg.json()["kv_transfer_params"]}
    with client(normal) as plain, client(decode) as pd:
        expected = plain.responses.create(**request).output_text
        assert pd.responses.create(**request, extra_body=extra).output_text == expected != ""


def failure(decode: LiveServer, body: dict[str, Any], params: dict[str, Any]) -> str:
    """The decode server's 503 for a handoff it could not pull: its message."""
    with client(decode) as pd, pytest.raises(openai.APIStatusError) as failed:
        pd.chat.completions.create(**body, extra_body={"kv_transfer_params": params})
    assert failed.value.status_code == 503
    error: dict[str, Any] = failed.value.body  # type: ignore[assignment]
    assert error["code"] == "kv_transfer_failed"
    return str(error["message"])


def test_a_prefill_server_that_stalls_then_dies_mid_transfer_costs_a_503_each_and_no_leak(
    checkpoint: Path, decode: LiveServer
) -> None:
    body = chat()
    with start_prefill(checkpoint) as doomed:
        known = handoff(doomed, body)  # the decode side reads from it once while it is well
        with client(decode) as pd:
            pd.chat.completions.create(**body, extra_body={"kv_transfer_params": known})
        stalled, gone = handoff(doomed, body), handoff(doomed, body)
        parent = psutil.Process(doomed.process.pid)
        for process in [parent, *parent.children(recursive=True)]:
            process.suspend()
        try:
            # The pull hangs on the stopped peer: the decode side gives up at its transfer
            # timeout; the blocks the pull may still write into stay reserved until it returns.
            assert "timeout" in failure(decode, body, stalled)
        finally:
            doomed.kill_tree()
    # The stalled peer is skipped for a while (peer_unhealthy), or found gone (transfer_error).
    assert re.search(r"\((peer_unhealthy|transfer_error)\)", failure(decode, body, gone))
    wait_until(lambda: idle(decode), 30, "the decode server's slots and KV back to idle")
    # Its rank serves on: at worst /health says no prefill peer it knows of answers.
    health = httpx.get(decode.base_url + "/health", timeout=10)
    assert health.status_code == 200 or health.json()["status"] == "degraded", health.text


def test_a_prefill_server_of_another_layout_is_refused_at_pairing_before_any_pull(
    checkpoint: Path, prefill: LiveServer, decode: LiveServer
) -> None:
    # Prefill speculating one token, decode not: DeepInfer sizes the state row by the
    # backtracking depth, so the rows differ. Without the handshake the transfer "succeeds"
    # and the twin's provenance check kills the decode rank; with it nothing is pulled.
    body = chat()
    before = scrape(decode.base_url)
    with start_prefill_with(checkpoint, "--speculative-tokens", "1") as speculating:
        params = handoff(speculating, body)
        with client(decode) as pd, pytest.raises(openai.APIStatusError) as refused:
            pd.chat.completions.create(**body, extra_body={"kv_transfer_params": params})
        health = httpx.get(decode.base_url + "/health", timeout=30)
    assert refused.value.status_code == 503
    error: dict[str, Any] = refused.value.body  # type: ignore[assignment]
    assert error["code"] == "kv_layout_mismatch", error
    assert "speculative_tokens (prefill 1, decode 0)" in error["message"]
    assert health.json()["status"] == "degraded", health.text
    assert "speculative_tokens (prefill 1, decode 0)" in health.json()["reason"]
    moved = "deepinfer:kv_transfer_bytes_total"
    assert value(scrape(decode.base_url), moved) == value(before, moved)
    # The decode rank lives on: a matching pair still answers.
    params = handoff(prefill, body)
    with client(decode) as pd:
        answer = pd.chat.completions.create(**body, extra_body={"kv_transfer_params": params})
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_kv_from_the_wrong_blocks_fails_the_digest_check_and_without_it_the_twins(
    checkpoint: Path, prefill: LiveServer, decode: LiveServer
) -> None:
    # The same prompt's KV pulled from its blocks in the wrong order: the handoff's digest of
    # the rows catches it after the pull (kv_mismatch), and the decode rank serves on. The test
    # holds the pair's secret: it re-signs each tampered handoff, as a faulty prefill would.
    body = chat()
    params = handoff(prefill, body)
    params["remote_block_ids"] = params["remote_block_ids"][::-1]
    params = resigned(prefill, body, params)
    failures = "deepinfer:kv_transfer_failures_total"
    before = value(scrape(decode.base_url), failures, reason="kv_mismatch")
    assert "kv_mismatch" in failure(decode, body, params)
    assert value(scrape(decode.base_url), failures, reason="kv_mismatch") == before + 1
    # The control for the provenance the other tests rely on: without the digest (a prefill
    # engine that computes none), the wrong rows are caught by the decode side's first forward
    # (a rank failure on the twin; on a GPU it would be a wrong answer), so a right answer
    # above means every position read held its own token, as the prefill side wrote it.
    params = handoff(prefill, body)
    params["remote_block_ids"] = params["remote_block_ids"][::-1]
    assert isinstance(params.pop("kv_digest"), str)
    params = resigned(prefill, body, params)
    with start(checkpoint, "--disaggregation-mode", "decode") as doomed:
        answer = httpx.post(
            doomed.base_url + "/v1/chat/completions",
            json={**body, "kv_transfer_params": params},
            timeout=60,
        )
        assert answer.status_code == 503
        assert "the twin's KV check failed" in answer.json()["error"]["message"]
        assert "KV position 0 " in answer.json()["error"]["message"]


def test_kv_no_decode_server_pulls_is_freed_when_its_hold_times_out(prefill: LiveServer) -> None:
    # A decode server that died (or a gateway that gave up) before pulling never releases.
    wait_until(lambda: idle(prefill), 3 * HOLD_TIMEOUT, "the prefill server idle")
    handoff(prefill, chat())
    samples = scrape(prefill.base_url)
    assert value(samples, "deepinfer:kv_transfer_held_requests") == 1
    assert value(samples, "deepinfer:kv_cache_usage_perc", dp_rank="0") > 0
    wait_until(lambda: idle(prefill), 3 * HOLD_TIMEOUT, "the prefill server's hold timed out")


def test_prompt_logprobs_on_a_prefill_twin_server_are_refused_in_the_protocols_shape(
    prefill: LiveServer,
) -> None:
    # Scheduler.fork_seq, the way the PROMPT role places a prompt, refuses them.
    body = {"model": MODEL, "prompt": QUESTION, "echo": True, "logprobs": 1, "max_tokens": 1}
    answer = httpx.post(prefill.base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "engine_rejected" and "prompt logprobs" in error["message"]
