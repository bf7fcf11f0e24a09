"""Oversized prompts: rejected before tokenizing, prepared off the loop a few at a time, and
counted under admission."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest

from deepinfer_server.api.preparation_gate import PER_KEY_PREPARATIONS, PreparationGate
from deepinfer_server.errors import OverloadedError
from tests.http.harness import MODEL, Script, run, serve

CHAT = "/v1/chat/completions"


class CountingEncoding:
    """The recipe's encoding, counting calls to encode()."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded = 0

    def render_conversation(self, conversation: Any) -> Any:
        return self.inner.render_conversation(conversation)

    def encode(self, conversation: Any) -> list[int]:
        self.encoded += 1
        return list(self.inner.encode(conversation))


def chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


def test_a_prompt_provably_over_the_context_is_rejected_without_tokenizing() -> None:
    async def body() -> None:
        async with serve() as h:  # --max-model-len 4096
            encoding = CountingEncoding(h.state.recipe.encoding)
            h.state.recipe = dataclasses.replace(h.state.recipe, encoding=encoding)
            size = 4096 * h.state.recipe.max_token_bytes + 1000
            response = await h.client.post(CHAT, json=chat("a" * size))
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert "at least" in error["message"]
            assert encoding.encoded == 0
            assert (await h.client.post(CHAT, json=chat("hi"))).status_code == 200
            assert encoding.encoded == 1

    run(body)


def test_large_bodies_count_under_admission() -> None:
    async def body() -> None:
        no_queue = ("--max-num-seqs", "1", "--max-queued-requests", "0")
        async with serve(*no_queue, script=Script(hold=True)) as h:
            held = asyncio.ensure_future(h.client.post(CHAT, json=chat("hi")))
            await h.coordinator.wait_admitted()
            large = await h.client.post(CHAT, json=chat("word " * 20_000))  # over 64 KiB
            assert large.status_code == 429
            assert large.headers["retry-after"]
            assert len(h.coordinator.submitted) == 1
            held.cancel()

    run(body)


def test_preparation_runs_on_bounded_worker_threads() -> None:
    async def body() -> None:
        gate = PreparationGate(workers=1)
        lock, release = threading.Lock(), threading.Event()
        active = peak = 0
        loop_thread = threading.get_ident()
        threads: set[int] = set()
        loop, working = asyncio.get_running_loop(), asyncio.Event()

        def work() -> int:
            nonlocal active, peak
            with lock:
                active += 1
                peak = max(peak, active)
                threads.add(threading.get_ident())
            loop.call_soon_threadsafe(working.set)
            release.wait(10)
            with lock:
                active -= 1
            return 1

        tasks = [asyncio.ensure_future(gate.run(0, 10, work)) for _ in range(3)]
        await working.wait()  # the first preparation is on its worker thread
        assert gate.pending == 3
        with pytest.raises(OverloadedError):
            await gate.run(7, 10, work)  # 7 in flight + 3 being prepared fill 10
        release.set()
        assert await asyncio.gather(*tasks) == [1, 1, 1]
        assert peak == 1 and loop_thread not in threads and gate.pending == 0

    run(body)


def test_one_key_with_many_large_requests_waiting_is_refused_and_another_key_is_not() -> None:
    keys = ("--api-key", "key-a", "--api-key", "key-b")

    async def body() -> None:
        async with serve(*keys) as h:
            gate, release = h.state.preparation, threading.Event()
            loop, holding = asyncio.get_running_loop(), asyncio.Queue[None]()

            def hold() -> None:  # every worker held: every large request waits in its line
                loop.call_soon_threadsafe(holding.put_nowait, None)
                release.wait(10)

            # Two keys hold the workers, the spare kept for keys with nothing running included.
            holders = [
                asyncio.ensure_future(gate.run(0, 100, hold, key=key)) for key in ("x", "x", "y")
            ]
            for _ in holders:
                await holding.get()
            large = {"model": MODEL, "prompt": "word " * 14_000}  # over 64 KiB

            def tokenize(key: str) -> asyncio.Future[Any]:
                headers = {"authorization": f"Bearer {key}"}
                return asyncio.ensure_future(
                    h.client.post("/tokenize", json=large, headers=headers)
                )

            waiting = [tokenize("key-a") for _ in range(PER_KEY_PREPARATIONS)]
            while gate.pending < 3 + PER_KEY_PREPARATIONS:  # each request reaches its line
                await asyncio.sleep(0)
            refused = await tokenize("key-a")
            assert refused.status_code == 429
            assert "this API key already has 8" in refused.json()["error"]["message"]
            other = tokenize("key-b")
            while gate.pending < 4 + PER_KEY_PREPARATIONS:
                await asyncio.sleep(0)
            release.set()
            answered = await asyncio.gather(other, *waiting)
            assert [response.status_code for response in answered] == [200] * 9
            await asyncio.gather(*holders)

    run(body)
