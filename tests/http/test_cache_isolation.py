"""Prefix-cache isolation, in process: requests of different API keys (`--prefix-cache-scope
key`, the default) or with different `cache_salt`s never share cached prompt prefixes, on the
real simulated engine with its prefix cache and the official clients of every API; `global`
shares across keys; a bad `cache_salt` is a 400 naming it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from tests.http.engine_harness import EngineHarness, SimulatedEngine, serve_engine
from tests.http.harness import MODEL, Harness, run, serve
from tests.http.test_stored_responses import run_stored

KEY_1, KEY_2 = "key-one-1", "key-two-2"
KEYS = ("--api-key", KEY_1, "--api-key", KEY_2)
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatedEngine]:
    built = SimulatedEngine.start(enable_prefix_caching=True)
    yield built
    built.close()


def _system(topic: str) -> str:
    """A system prompt of some 1,500 tokens, its own per test (the engine is shared)."""
    return " ".join(
        f"{topic} rule {n}: keep answers short and check the tests." for n in range(120)
    )


def _http(harness: EngineHarness) -> httpx2.AsyncClient:
    """The official SDKs' HTTP client over the same app."""
    transport = httpx2.ASGITransport(app=harness.client._transport.app)  # type: ignore[attr-defined]
    return httpx2.AsyncClient(transport=transport, base_url="http://test")


def _openai(harness: EngineHarness, key: str = KEY_1) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=key, http_client=_http(harness), max_retries=0
    )


def _anthropic(harness: EngineHarness, key: str = KEY_1) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url="http://test", api_key=key, http_client=_http(harness), max_retries=0
    )


def _salted(salt: str | None) -> dict[str, Any]:
    return {**NO_THINKING, **({"cache_salt": salt} if salt is not None else {})}


async def _chat(harness: EngineHarness, key: str, messages: list[Any], salt: str | None) -> Any:
    async with _openai(harness, key) as client:
        return await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, extra_body=_salted(salt)
        )


#: One API's two turns: (harness, key, salt, the topic, second turn?) -> (cached, prompt).
Turn = Callable[[EngineHarness, str, str | None, str, bool], Awaitable[tuple[int, int]]]


async def chat_turn(
    harness: EngineHarness, key: str, salt: str | None, topic: str, second: bool
) -> tuple[int, int]:
    messages: list[Any] = [
        {"role": "system", "content": _system(topic)},
        {"role": "user", "content": "List the files."},
    ]
    if second:
        messages += [
            {"role": "assistant", "content": "README.md and src."},
            {"role": "user", "content": "Open the first one."},
        ]
    reply = await _chat(harness, key, messages, salt)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens


async def completions_turn(
    harness: EngineHarness, key: str, salt: str | None, topic: str, second: bool
) -> tuple[int, int]:
    prompt = f"{_system(topic)}\n\nQuestion: list the files.\n\n"
    if second:
        prompt += "Answer: README.md and src.\n\nQuestion: open the first one.\n\n"
    async with _openai(harness, key) as client:
        reply = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, extra_body=_salted(salt)
        )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens


async def responses_turn(
    harness: EngineHarness, key: str, salt: str | None, topic: str, second: bool
) -> tuple[int, int]:
    items: list[Any] = [{"role": "user", "content": "List the files."}]
    if second:
        items += [
            {"role": "assistant", "content": "README.md and src."},
            {"role": "user", "content": "Open the first one."},
        ]
    async with _openai(harness, key) as client:
        reply = await client.responses.create(
            model=MODEL,
            instructions=_system(topic),
            input=items,
            max_output_tokens=8,
            store=False,
            extra_body=_salted(salt),
        )
    usage = reply.usage
    assert usage is not None
    return usage.input_tokens_details.cached_tokens, usage.input_tokens


async def messages_turn(
    harness: EngineHarness, key: str, salt: str | None, topic: str, second: bool
) -> tuple[int, int]:
    messages: list[Any] = [{"role": "user", "content": "List the files."}]
    if second:
        messages += [
            {"role": "assistant", "content": "README.md and src."},
            {"role": "user", "content": "Open the first one."},
        ]
    async with _anthropic(harness, key) as client:
        reply = await client.messages.create(
            model=MODEL,
            system=_system(topic),
            messages=messages,
            max_tokens=8,
            extra_body={"cache_salt": salt} if salt is not None else None,
        )
    cached = reply.usage.cache_read_input_tokens or 0
    return cached, reply.usage.input_tokens + cached


TURNS: dict[str, Turn] = {
    "chat": chat_turn,
    "completions": completions_turn,
    "responses": responses_turn,
    "messages": messages_turn,
}


@pytest.mark.parametrize("api", list(TURNS))
def test_a_cache_salt_shares_nothing_with_another_salt(engine: SimulatedEngine, api: str) -> None:
    turn = TURNS[api]

    async def body() -> None:
        async with serve_engine(engine) as harness:
            topic = f"salted-{api}"
            cached, first_prompt = await turn(harness, "unused", "tenant-a", topic, False)
            assert cached == 0
            for other in ("tenant-b", None):
                cached, _ = await turn(harness, "unused", other, topic, True)
                assert cached == 0, other
            cached, _ = await turn(harness, "unused", "tenant-a", topic, True)
            assert cached >= 0.9 * first_prompt  # the same salt still shares

    run(body, timeout=120)


def test_another_keys_probe_of_a_conversation_reads_nothing_cached(
    engine: SimulatedEngine,
) -> None:
    async def body() -> None:
        async with serve_engine(engine, *KEYS) as harness:
            cached, first_prompt = await chat_turn(harness, KEY_1, None, "keyed", False)
            assert cached == 0 and first_prompt > 1000
            cached, _ = await chat_turn(harness, KEY_2, None, "keyed", True)
            assert cached == 0
            cached, _ = await chat_turn(harness, KEY_1, None, "keyed", True)
            assert cached >= 0.9 * first_prompt  # the key's own next turn still does

    run(body, timeout=120)


def test_the_global_scope_shares_prefixes_across_keys(engine: SimulatedEngine) -> None:
    async def body() -> None:
        async with serve_engine(engine, *KEYS, "--prefix-cache-scope", "global") as harness:
            _, first_prompt = await chat_turn(harness, KEY_1, None, "global", False)
            cached, _ = await chat_turn(harness, KEY_2, None, "global", True)
            assert cached >= 0.9 * first_prompt
            # A salt still separates, whatever the scope.
            cached, _ = await chat_turn(harness, KEY_2, "mine", "global", True)
            assert cached == 0

    run(body, timeout=120)


BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "Hi"},
    "/v1/responses": {"model": MODEL, "input": "Hi", "store": False},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
    },
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("salt", ["", 5, ["a"], {"a": 1}])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400(path: str, salt: object) -> None:
    async def body() -> None:
        async with serve() as h:
            response = await h.client.post(path, json={**BODIES[path], "cache_salt": salt})
            assert response.status_code == 400
            error = response.json()["error"]
            assert "'cache_salt' must be a non-empty string" in error["message"]
            if path == "/v1/messages":
                assert error["type"] == "invalid_request_error"
            else:
                assert error["param"] == "cache_salt"
            assert h.coordinator.submitted == []

    run(body)


def test_the_partition_is_the_keys_scope_and_the_salt_never_the_key() -> None:
    async def body() -> None:
        partitions: dict[str, bytes | None] = {}
        for scope in ("key", "global"):
            async with serve(*KEYS, "--prefix-cache-scope", scope) as h:
                for name, key, salt in [
                    ("k1", KEY_1, None),
                    ("k2", KEY_2, None),
                    ("k1-s", KEY_1, "s"),
                    ("k1-s-again", KEY_1, "s"),
                    ("k2-s", KEY_2, "s"),
                ]:
                    response = await h.client.post(
                        "/v1/chat/completions",
                        json={**BODIES["/v1/chat/completions"], **_salted(salt)},
                        headers={"authorization": f"Bearer {key}"},
                    )
                    assert response.status_code == 200
                    (request_id, *_), *_ = h.coordinator.submitted[-1:]
                    partitions[f"{scope}:{name}"] = h.coordinator.cache_salts[request_id]
        async with serve() as h:  # no keys, no salt: no partition
            await h.client.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"])
            assert list(h.coordinator.cache_salts.values()) == [None]
        keyed = [partitions[f"key:{name}"] for name in ("k1", "k2", "k1-s", "k2-s")]
        assert None not in keyed and len(set(keyed)) == 4
        assert partitions["key:k1-s"] == partitions["key:k1-s-again"]
        assert partitions["global:k1"] is None and partitions["global:k2"] is None
        assert partitions["global:k1-s"] == partitions["global:k2-s"] is not None
        for value in partitions.values():
            assert value is None or all(key.encode() not in value for key in (KEY_1, KEY_2))

    run(body)


def test_a_stored_responses_turn_keeps_its_cache_salt(tmp_path: Path) -> None:
    # The store's session prepares an expanded body of its own: the salt must survive it.
    async def test(h: Harness) -> None:
        async with h.openai() as client:
            first = await client.responses.create(
                model=MODEL, input="Hello", extra_body={"cache_salt": "s"}
            )
            await client.responses.create(
                model=MODEL,
                input="Again",
                previous_response_id=first.id,
                extra_body={"cache_salt": "s"},
            )
            await client.responses.create(
                model=MODEL, input="Hello", store=False, extra_body={"cache_salt": "s"}
            )
        salts = list(h.coordinator.cache_salts.values())
        assert len(salts) == 3 and salts[0] is not None and len(set(salts)) == 1

    run_stored(tmp_path, test)
