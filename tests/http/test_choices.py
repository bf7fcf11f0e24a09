"""Several choices per request in-process: n > 1 for chat, several completion prompts, logprobs."""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson
import pytest

from deepinfer_server.ipc.messages import AbortReason
from tests.http.harness import MODEL, Script, failures, run, serve

CHAT = "/v1/chat/completions"
NO_THINKING = {"thinking": {"type": "disabled"}}


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **NO_THINKING, **extra}


def test_n_makes_n_engine_requests_with_derived_seeds_and_merged_choices() -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(CHAT, json=chat_body(n=3, seed=42))
            assert response.status_code == 200, response.text
            data = response.json()
            assert [c["index"] for c in data["choices"]] == [0, 1, 2]
            seeds = [sampling.seed for _, _, sampling in h.coordinator.submitted]
            assert seeds[0] == 42 and len(set(seeds)) == 3
            single = (await h.client.post(CHAT, json=chat_body(seed=42))).json()["usage"]
            usage = data["usage"]
            assert usage["prompt_tokens"] == single["prompt_tokens"]
            assert usage["completion_tokens"] == 3 * single["completion_tokens"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            # The same seed gives the same seeds again: a seeded request stays reproducible.
            await h.client.post(CHAT, json=chat_body(n=3, seed=42))
            assert [s.seed for _, _, s in h.coordinator.submitted[4:]] == seeds

    run(body)


def test_n_stream_interleaves_indices_and_sends_one_usage_chunk() -> None:
    async def body() -> None:
        async with serve() as h:
            options = {"include_usage": True}
            response = await h.client.post(
                CHAT, json=chat_body(n=2, stream=True, stream_options=options)
            )
            frames = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert frames[-1] == "[DONE]"
            chunks = [orjson.loads(frame) for frame in frames[:-1]]
            usage_chunks = [c for c in chunks if not c["choices"]]
            assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
            texts = {0: "", 1: ""}
            for chunk in chunks[:-1]:
                for choice in chunk["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
            assert texts == {0: "Hello from the fake engine", 1: "Hello from the fake engine"}

    run(body)


def test_admission_counts_n_slots_and_releases_them_on_refusal() -> None:
    async def body() -> None:
        async with serve() as h:
            h.coordinator.capacity = 2
            response = await h.client.post(CHAT, json=chat_body(n=3))
            assert response.status_code == 429
            assert [closed[2] for closed in h.coordinator.closed] == [AbortReason.ROLLBACK] * 2
            assert h.coordinator.num_in_flight == 0
            assert failures(h.metrics) == {"429": 1.0}

    run(body)


def test_a_timeout_aborts_every_choice() -> None:
    async def body() -> None:
        async with serve("--request-timeout", "0.2", script=Script(hold=True)) as h:
            response = await h.client.post(CHAT, json=chat_body(n=3))
            assert response.status_code == 408, response.text
            assert len(h.coordinator.closed) == 3
            assert all(aborted for _, aborted, _ in h.coordinator.closed)
            assert h.coordinator.num_in_flight == 0

    run(body)


def test_n_out_of_range_is_400() -> None:
    async def body() -> None:
        async with serve() as h:
            for n in (0, 129, "2"):
                response = await h.client.post(CHAT, json=chat_body(n=n))
                assert response.status_code == 400 and response.json()["error"]["param"] == "n"
            assert not h.coordinator.submitted

    run(body)


def test_chat_logprobs_follow_the_tokens_of_the_content() -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(CHAT, json=chat_body(logprobs=True, top_logprobs=2))
            choice = response.json()["choices"][0]
            entries = choice["logprobs"]["content"]
            assert "".join(e["token"] for e in entries) == choice["message"]["content"]
            assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 2 for e in entries)
            sampling = h.coordinator.submitted[0][2]
            assert (sampling.logprobs, sampling.top_logprobs) == (True, 2)

    run(body)


def test_completions_prompt_list_gives_one_choice_per_prompt() -> None:
    async def body() -> None:
        async with serve(script=Script(text=" continued")) as h:
            payload = {"model": MODEL, "prompt": ["one", "two"], "n": 2, "max_tokens": 5}
            response = await h.client.post("/v1/completions", json=payload)
            data = response.json()
            assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
            prompts = [ids for _, ids, _ in h.coordinator.submitted]
            assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
            assert data["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[2])

    run(body)


def test_more_choices_than_the_server_ever_admits_is_a_400_not_a_429() -> None:
    """n: 17 on a server of capacity 16 was a 429 with Retry-After even when idle, which SDKs
    retry forever: a request that can never be admitted is a 400 saying why."""

    async def body() -> None:
        async with serve("--max-num-seqs", "4", "--max-queued-requests", "0") as h:
            assert h.state.config.admission_capacity == 4
            too_many = [
                (CHAT, chat_body(n=5)),
                ("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2}),
            ]
            for path, request in too_many:
                response = await h.client.post(path, json=request)
                assert response.status_code == 400, response.text
                assert "retry-after" not in response.headers
                error = response.json()["error"]
                assert error["param"] == "n" and "at most 4" in error["message"]
            assert not h.coordinator.submitted
            fits = await h.client.post(CHAT, json=chat_body(n=4))
            assert fits.status_code == 200, fits.text

    run(body)


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        (CHAT, chat_body(n=3)),
        ("/v1/completions", {"model": MODEL, "prompt": ["a b", "c d e f"], "n": 2}),
    ],
    ids=["chat-n3", "completions-2-prompts-n2"],
)
def test_the_access_log_counts_every_choice_as_usage_does(
    path: str, request_body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with serve() as h:
            with caplog.at_level(logging.INFO, logger="deepinfer_server.access"):
                response = await h.client.post(path, json=request_body)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            (line,) = [r.getMessage() for r in caplog.records if r.name.endswith("access")]
            logged = dict(re.findall(r"(prompt_tokens|completion_tokens)=(\d+)", line))
            assert logged == {
                "prompt_tokens": str(usage["prompt_tokens"]),
                "completion_tokens": str(usage["completion_tokens"]),
            }, line

    run(body)
