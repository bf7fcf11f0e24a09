"""Prefix caching end to end on the simulated engine: a second turn that extends the first
reuses at least 90% of the first turn's prompt (under another cache_salt, nothing), the
official clients read it from usage, /metrics counts it once whichever API server process
answers, with two DP ranks the next turn goes to the rank that holds the first, and on a small
pool a turn evicted by another conversation is restored from the host tier, as is a system
prompt marked `cache_control` (its first call reports the tokens it created)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai

from tests.conftest import MODEL
from tests.metrics_scrape import scrape, value
from tests.server import LiveServer, wait_until

#: A system prompt of about 2,500 tokens: twenty 128-token blocks.
SYSTEM = " ".join(f"Rule {n}: keep the answer short and check the tests." for n in range(220))
QUERIES = "deepinfer:prefix_cache_queries_total"
HITS = "deepinfer:prefix_cache_hits_total"
SEQUENCES = "deepinfer:prefix_cache_sequences"


def _counters(base_url: str) -> tuple[float, float, float]:
    samples = scrape(base_url)
    sequences = sum(value(samples, SEQUENCES, dp_rank=rank) for rank in ("0", "1"))
    return value(samples, QUERIES), value(samples, HITS), sequences


def _turns() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    second = [
        *first,
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Now run the tests, please."},
    ]
    return first, second


def test_a_second_turn_reuses_the_first_turns_prompt_and_the_counters_move() -> None:
    with LiveServer("--dp", "2", "--api-server-count", "2", "--sim-itl-ms", "2") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        for thinking in ("enabled", "disabled"):
            first, second = _turns()
            extra = {"thinking": {"type": thinking}}
            one = client.chat.completions.create(model=MODEL, messages=first, extra_body=extra)
            assert one.usage is not None and one.usage.prompt_tokens_details is not None
            assert one.usage.prompt_tokens_details.cached_tokens == 0  # nothing before it
            queries, hits, sequences = _counters(server.base_url)
            assert sequences >= 1  # the first turn's prompt is kept
            two = client.chat.completions.create(model=MODEL, messages=second, extra_body=extra)
            assert two.usage is not None and two.usage.prompt_tokens_details is not None
            cached = two.usage.prompt_tokens_details.cached_tokens
            # Thinking mode drops the first prompt's closing <think>: one token less is reused.
            assert cached >= 0.9 * one.usage.prompt_tokens, (thinking, cached)
            assert cached >= one.usage.prompt_tokens - 1
            after = _counters(server.base_url)
            assert after[0] - queries == two.usage.prompt_tokens
            assert after[1] - hits == cached
            # Every API server process reports the ranks' counters alike (never summed twice).
            assert _counters(server.base_url)[:2] == after[:2]


def test_anthropic_clients_read_the_cached_tokens_of_a_resent_conversation() -> None:
    with LiveServer("--sim-itl-ms", "2") as server:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
        system: Any = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        first: Any = [{"role": "user", "content": "Hello there."}]
        one = client.messages.create(model=MODEL, max_tokens=64, system=system, messages=first)
        assert one.usage.cache_read_input_tokens == 0
        # The breakpoint writes the whole prompt: it counts as created, none of it as input.
        prompt = one.usage.cache_creation_input_tokens or 0
        assert prompt > 0 and one.usage.input_tokens == 0
        second: Any = [
            *first,
            {"role": "assistant", "content": one.content},
            {"role": "user", "content": "Now run the tests, please."},
        ]
        # Another cache_salt (an extension field) reaches the rank and shares nothing.
        salted = client.messages.create(
            model=MODEL,
            max_tokens=8,
            system=system,
            messages=second,
            extra_body={"cache_salt": "another tenant"},
        )
        assert salted.usage.cache_read_input_tokens == 0
        with client.messages.stream(
            model=MODEL, max_tokens=64, system=system, messages=second
        ) as stream:
            events = list(stream)
        start = next(event for event in events if event.type == "message_start")
        cached = start.message.usage.cache_read_input_tokens or 0
        assert cached >= 0.9 * prompt
        created = start.message.usage.cache_creation_input_tokens or 0
        assert start.message.usage.input_tokens + created + cached > prompt  # and the new turn


def test_the_next_turn_goes_to_the_rank_that_holds_the_first() -> None:
    with LiveServer("--dp", "2", "--sim-itl-ms", "2") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        first, second = _turns()
        extra = {"thinking": {"type": "disabled"}}
        busy = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "busy"}],
            "max_tokens": 5000,
            "ignore_eos": True,
            "stream": True,
            "thinking": {"type": "disabled"},
        }
        # A long request holds rank 0, so the first turn goes to rank 1 (the least loaded).
        with httpx.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json=busy, timeout=30
        ) as held:
            lines = held.iter_lines()  # kept: a discarded iterator would close the stream
            next(lines)
            assert httpx.get(f"{server.base_url}/get_load", timeout=30).json() == {"load": 1}
            client.chat.completions.create(model=MODEL, messages=first, extra_body=extra)
        # Closing the stream aborted it: both ranks are idle, rank 0 would be the least loaded.
        wait_until(
            lambda: httpx.get(f"{server.base_url}/get_load", timeout=30).json() == {"load": 0},
            20,
            "the aborted request no longer counts",
        )
        two = client.chat.completions.create(model=MODEL, messages=second, extra_body=extra)
        assert two.usage is not None and two.usage.prompt_tokens_details is not None
        assert two.usage.prompt_tokens_details.cached_tokens > 0  # it reached rank 1
        samples = scrape(server.base_url)
        assert value(samples, SEQUENCES, dp_rank="1") >= 1


def test_a_turn_evicted_from_the_pool_is_restored_from_the_host_tier() -> None:
    # 40 blocks: one conversation's entry (21) and another's prompt (22) pass the 90%
    # watermark together, so the second conversation's first turn evicts the first's entry.
    with LiveServer("--sim-kv-blocks", "40", "--sim-itl-ms", "2") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        extra = {"thinking": {"type": "disabled"}}
        first, second = _turns()
        other = [{"role": "system", "content": SYSTEM.replace("Rule", "Law")}, first[1]]
        one = client.chat.completions.create(model=MODEL, messages=first, extra_body=extra)
        client.chat.completions.create(model=MODEL, messages=other, extra_body=extra)
        samples = scrape(server.base_url)
        assert value(samples, "deepinfer:prefix_cache_host_sequences", dp_rank="0") == 1
        two = client.chat.completions.create(model=MODEL, messages=second, extra_body=extra)
        assert one.usage is not None and two.usage is not None
        assert two.usage.prompt_tokens_details is not None
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert cached == one.usage.prompt_tokens
        samples = scrape(server.base_url)
        tier = "deepinfer:prefix_cache_hit_tokens_total"
        assert value(samples, tier, tier="host") == cached
        assert value(samples, tier, tier="gpu") == 0
        assert value(samples, "deepinfer:prefix_cache_host_restore_bytes_total") > 0
        # On the same server: a retained system prompt outlives other sessions' traffic.
        _a_retained_prefix_is_read_after_other_sessions(server)


def _a_retained_prefix_is_read_after_other_sessions(server: LiveServer) -> None:
    """A Messages system prompt marked `cache_control` is written on its first call (created
    tokens in usage) and read back on a later turn, after two other sessions' prompts (each
    larger than the pool's room beside it) took its place in the pool."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    marker = {"type": "ephemeral", "ttl": "1h"}
    text = SYSTEM.replace("Rule", "Term")
    system: Any = [{"type": "text", "text": text, "cache_control": marker}]
    first: Any = [{"role": "user", "content": "Hello there."}]
    one = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=first)
    assert one.usage.cache_read_input_tokens == 0
    created = one.usage.cache_creation_input_tokens or 0
    assert created > 0
    for word in ("Canon", "Maxim"):  # systems no earlier request sent
        other = SYSTEM.replace("Rule", word)
        client.messages.create(model=MODEL, max_tokens=8, system=other, messages=first)
    second: Any = [
        *first,
        {"role": "assistant", "content": one.content},
        {"role": "user", "content": "Now run the tests, please."},
    ]
    host_hits = "deepinfer:prefix_cache_hit_tokens_total"
    before = value(scrape(server.base_url), host_hits, tier="host")
    two = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=second)
    read = two.usage.cache_read_input_tokens or 0
    assert read >= 0.9 * created
    # Read from the host tier: the other sessions had taken its place in the pool.
    assert value(scrape(server.base_url), host_hits, tier="host") - before == read
    prompt = two.usage.input_tokens + (two.usage.cache_creation_input_tokens or 0) + read
    assert prompt > created  # the new turn's tokens on top of what was read
