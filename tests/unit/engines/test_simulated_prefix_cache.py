"""The simulated engine's prefix cache: DeepInfer's fork semantics on the simulated blocks and
state slots (what a turn reuses, what an entry and a fork hold, eviction under demand, aborts,
preemption, the requests it does not serve) and the prefill cost of what a prompt computes."""

from __future__ import annotations

import time
from typing import Any, cast

import numpy as np
import pytest

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.engines.simulated.state_slots import StateSlots
from deepinfer_server.model.kv_block import blocks_for
from tests.unit.engines.test_simulated_engine import _tokenizer, make_engine, run_to_end

SYSTEM = " ".join(f"Rule {n}: answer briefly and run the tests." for n in range(120))


def _ids(text: str) -> np.ndarray:
    return np.asarray(_tokenizer().encode(text, add_special_tokens=False).ids, dtype=np.int32)


def _turn(*users: str, thinking: bool = False) -> np.ndarray:
    """A prompt: the system text, then user turns answered "ok", then the assistant's turn."""
    text = f"<｜begin▁of▁sentence｜>{SYSTEM}"
    for number, user in enumerate(users):
        text += f"<｜User｜>{user}<｜Assistant｜>"
        if number < len(users) - 1:
            text += "</think>ok<｜end▁of▁sentence｜>"
    text += "<think>" if thinking else "</think>"
    return _ids(text)


def _cached(engine: LLMEngine, request_id: str, prompt: np.ndarray, **params: Any) -> int:
    sequence = engine.add_request("0", request_id, {"max_tokens": 4, **params}, prompt)
    assert sequence is not None
    list(run_to_end(engine))
    return int(sequence.num_cached_tokens)


def _baseline(engine: LLMEngine) -> tuple[int, int]:
    """Free KV blocks and state slots."""
    return engine.scheduler.get_num_free_gpu_blocks(), engine._cache.slots.free_count


def _clear(engine: LLMEngine) -> None:
    for entry in list(engine._cache.index):
        engine._cache.evict(entry)


def test_a_next_turn_reuses_the_last_prompt_and_the_counters_move() -> None:
    engine = make_engine(enable_prefix_caching=True)
    empty = _baseline(engine)
    first = _turn("Hello.")
    assert len(first) >= 256
    assert _cached(engine, "one", first) == 0
    assert engine.prefix_cache_stats() == (len(first), 0, 1)  # one entry, nothing reused
    second = _turn("Hello.", "Run the tests.")
    assert _cached(engine, "two", second) == len(first)
    assert engine.prefix_cache_stats() == (len(first) + len(second), len(first), 2)
    _clear(engine)
    assert _baseline(engine) == empty  # entries and forks held nothing more


def test_a_thinking_turn_reuses_all_but_the_dropped_think() -> None:
    engine = make_engine(enable_prefix_caching=True)
    first = _turn("Hello.", thinking=True)
    _cached(engine, "one", first)
    # The next turn renders the earlier one's <think> as </think>ok<｜end▁of▁sentence｜>.
    second = _turn("Hello.", "Run the tests.", thinking=True)
    assert second[len(first) - 1] != first[-1]
    assert _cached(engine, "two", second) == len(first) - 1


def test_the_driver_reports_what_the_engine_reused() -> None:
    engine = make_engine(enable_prefix_caching=True)
    _cached(engine, "one", _turn("Hello."))
    driver = LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine, prefix_caching=True))
    from deepinfer_server.ipc.codec import pack_token_ids
    from deepinfer_server.ipc.messages import AddRequest, SamplingOptions

    second = _turn("Hello.", "Run the tests.")
    driver.add(AddRequest("two", pack_token_ids(second.tolist()), SamplingOptions(max_tokens=4)))
    _, deltas = driver.iterate()
    assert deltas[0].cached_tokens == len(_turn("Hello."))
    assert driver.prefix_cache_stats() is not None


def test_a_cache_salt_partitions_what_a_turn_reuses() -> None:
    engine = make_engine(enable_prefix_caching=True)
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    sequence = engine.add_request("0", "a-1", {"max_tokens": 4}, first, cache_salt=b"a")
    assert sequence is not None
    list(run_to_end(engine))
    assert _cached(engine, "none-2", second) == 0
    sequence = engine.add_request("0", "b-2", {"max_tokens": 4}, second, cache_salt=b"b")
    assert sequence is not None and sequence.num_cached_tokens == 0
    list(run_to_end(engine))
    sequence = engine.add_request("0", "a-2", {"max_tokens": 4}, second, cache_salt=b"a")
    assert sequence is not None and sequence.num_cached_tokens == len(first)
    list(run_to_end(engine))


def test_the_driver_gives_the_salt_only_to_an_engine_with_a_prefix_cache() -> None:
    from deepinfer_server.ipc.codec import pack_token_ids
    from deepinfer_server.ipc.messages import AddRequest, SamplingOptions

    salted: list[bytes | None] = []

    class Recording:
        """The engine, noting the salt each add_request gets (DeepInfer's own has none)."""

        def __init__(self, engine: LLMEngine) -> None:
            self._engine = engine

        def __getattr__(self, name: str) -> Any:
            return getattr(self._engine, name)

        def add_request(self, *args: Any, **kwargs: Any) -> Any:
            salted.append(kwargs.get("cache_salt"))
            return self._engine.add_request(*args, **kwargs)

    prompt = pack_token_ids(_turn("Hello.").tolist())
    for cache in (True, False):
        engine = Recording(make_engine(enable_prefix_caching=cache))
        abilities = SimulatedAbilities(engine._engine, prefix_caching=cache)
        driver = LLMEngineDriver(cast(LLMEngine, engine), RequestOutput, abilities)
        driver.add(AddRequest("r", prompt, SamplingOptions(max_tokens=4), cache_salt=b"s"))
    assert salted == [b"s", None]


def test_a_fork_shares_its_parents_whole_blocks_and_computes_only_the_rest() -> None:
    engine = make_engine(enable_prefix_caching=True, max_model_len=4096, prefill_attempt_interval=1)
    first = _turn("Hello.")
    _cached(engine, "one", first)
    entry_blocks = blocks_for(len(first) + 4)  # the prompt and its answer
    free = engine.scheduler.get_num_free_gpu_blocks()
    second = _turn("Hello.", "Run the tests.")
    engine.add_request("0", "two", {"max_tokens": 50, "ignore_eos": True}, second)
    engine.has_unfinished_requests()
    engine.step()  # the prefill
    assert engine._prompts.computed_tokens == len(second) - len(first)
    kept = len(first) // 128
    own = blocks_for(len(second) + 1) - kept
    assert engine.scheduler.get_num_free_gpu_blocks() == free - own
    assert engine._kv.table("two")[:kept] == engine._kv.table("prefix-cache:1")[:kept]
    assert len(engine._kv.table("prefix-cache:1")) == entry_blocks
    list(run_to_end(engine))


def test_short_prompts_and_requests_the_cache_cannot_serve_are_prefilled_whole() -> None:
    engine = make_engine(enable_prefix_caching=True)
    short = _ids("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>")
    _cached(engine, "short", short)
    assert len(engine._cache.index) == 0  # below 256 tokens: not kept
    first = _turn("Hello.")
    _cached(engine, "one", first)
    second = _turn("Hello.", "Run the tests.")
    assert _cached(engine, "logprobs", second, prompt_logprobs=True) == 0
    images = {"image_sizes": [(32, 32)], "image_bytes": [b"x"]}
    sequence = engine.add_request("0", "image", {"max_tokens": 4}, second, images)
    assert sequence is not None and sequence.num_cached_tokens == 0
    list(run_to_end(engine))


def test_an_identical_retry_is_not_forked() -> None:
    engine = make_engine(enable_prefix_caching=True)
    first = _turn("Hello.")
    _cached(engine, "one", first)
    # The fork point may be at most the prompt's length - 2 (DeepInfer's forked-prompt path).
    assert _cached(engine, "again", first) == 0


def test_an_aborted_waiting_fork_and_a_preempted_one_give_back_what_they_held() -> None:
    engine = make_engine(enable_prefix_caching=True)
    empty = _baseline(engine)
    _cached(engine, "one", _turn("Hello."))
    # No step runs between the fork's add and its abort: it is aborted while it waits.
    fork = engine.add_request("0", "waits", {"max_tokens": 4}, _turn("Hello.", "Run the tests."))
    assert fork is not None and fork.num_cached_tokens > 0
    assert engine.abort_request("waits") == (1, len(_turn("Hello.", "Run the tests.")))
    list(run_to_end(engine))
    _clear(engine)
    assert _baseline(engine) == empty


def test_a_preempted_fork_is_recomputed_in_full_and_still_reports_what_it_reused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 14 allocatable blocks: the entry's 11 (10 of them kept by both forks), then each fork's
    # own; the forks outgrow the pool at 13 blocks each.
    first = _turn("Hello.")
    engine = make_engine(
        enable_prefix_caching=True,
        kv_blocks=blocks_for(len(first) + 4) + 4,
        prefill_attempt_interval=1,
    )
    empty = _baseline(engine)
    _cached(engine, "one", first)
    sequences = [
        engine.add_request(
            "0", name, {"max_tokens": 300, "ignore_eos": True}, _turn("Hello.", name)
        )
        for name in ("a", "b")
    ]
    with caplog.at_level("INFO"):
        outputs = [o for batch in run_to_end(engine) for o in batch]
    assert "preempted" in caplog.text
    assert all(s is not None and s.num_cached_tokens == len(first) for s in sequences)
    lengths = {name: sum(1 for rid, _, _ in outputs if rid == name) for name in ("a", "b")}
    assert lengths == {"a": 300, "b": 300}  # the recomputed one lost nothing, repeated nothing
    _clear(engine)
    assert _baseline(engine) == empty


def test_entries_give_way_to_waiting_prompts_least_recently_used_first() -> None:
    # Room for about two conversations' entries: new conversations still always start.
    first = _turn("Hello.")
    engine = make_engine(enable_prefix_caching=True, kv_blocks=3 * blocks_for(len(first) + 5))
    for number in range(6):
        assert _cached(engine, f"c{number}", _turn(f"Conversation {number}.")) == 0
    assert 1 <= len(engine._cache.index) < 6
    kept = {entry.value.owner for entry in engine._cache.index}
    assert "prefix-cache:6" in kept and "prefix-cache:1" not in kept


def test_a_prompt_step_lasts_what_it_computes_over_the_prefill_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = make_engine(
        enable_prefix_caching=True, prefill_tokens_per_s=1_000.0, prefill_attempt_interval=1
    )
    _cached(engine, "one", _turn("Hello."))
    second = _turn("Hello.", "Run the tests.")
    engine.add_request("0", "two", {"max_tokens": 1}, second)
    deadlines: list[float] = []
    monkeypatch.setattr(engine._clock, "sleep_until", deadlines.append)  # no wait
    engine.has_unfinished_requests()
    before = time.monotonic()
    engine.step()  # the fork's prompt step: only its new tokens cost
    after = time.monotonic()
    computed = len(second) - len(_turn("Hello."))
    assert engine._prompts.computed_tokens == computed
    # The step ends its computed tokens over the rate after it started (between the reads).
    (deadline,) = deadlines
    assert before + computed / 1_000.0 <= deadline <= after + computed / 1_000.0


def test_without_the_cache_the_engine_has_no_counters_and_forks_nothing() -> None:
    engine = make_engine()
    assert not hasattr(engine, "prefix_cache_stats")
    _cached(engine, "one", _turn("Hello."))
    assert _cached(engine, "two", _turn("Hello.", "Run the tests.")) == 0


def test_the_state_slots_follow_deepinfers_ratio_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert StateSlots.for_running(16).free_count == 19  # int(16 * 1.2) + 1 slots, slot 0 unused
    monkeypatch.setenv("DEEPINFER_NUM_STATE_SLOTS_RATIO", "3")
    assert StateSlots.for_running(16).free_count == 48


def test_a_snapshot_evicts_an_idle_entry_rather_than_go_without() -> None:
    # 2 allocatable slots (int(2 * 1.2) + 1, slot 0 unused): one for the running sequence,
    # one for a snapshot or an entry.
    engine = make_engine(enable_prefix_caching=True, max_num_seqs=2)
    assert engine._cache.slots.free_count == 2
    _cached(engine, "one", _turn("One."))
    _cached(engine, "two", _turn("Two."))  # its snapshot takes the slot of "one"'s entry
    assert [entry.value.owner for entry in engine._cache.index] == ["prefix-cache:2"]
    assert _cached(engine, "three", _turn("Two.", "More.")) == len(_turn("Two."))


def test_a_fork_of_a_long_answer_runs_when_its_parent_is_evicted() -> None:
    """A waiting fork pins only its parent's blocks up to the fork point. Had it pinned the
    parent's whole table (the answer's blocks too), evicting the parent would free nothing,
    and a fork needing the rest of the pool would wait forever with nothing running."""
    engine = make_engine(
        enable_prefix_caching=True, kv_blocks=40, max_num_seqs=2, max_model_len=8192
    )
    free, slots = _baseline(engine)
    first = _turn("Hello.")
    _cached(engine, "long", first, max_tokens=2000, ignore_eos=True)  # an entry of ~26 blocks
    longer = np.concatenate([first, np.arange(1000, 3600, dtype=np.int32)])
    assert blocks_for(len(longer) + 1) > free - blocks_for(len(first) + 2000)  # must evict
    sequence = engine.add_request("0", "next", {"max_tokens": 4}, longer)
    assert sequence is not None and sequence.num_cached_tokens == len(first)
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        pytest.fail("the fork never ran")
    list(run_to_end(engine))
    _clear(engine)
    assert _baseline(engine) == (free, slots)


def test_entries_stay_while_every_running_slot_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting prompt cannot start while the running set is full, so it is no reason to
    evict: the cache is not emptied under load. Once a slot frees, it evicts what it needs."""
    monkeypatch.setenv("DEEPINFER_NUM_STATE_SLOTS_RATIO", "3")  # state slots to spare
    engine = make_engine(
        enable_prefix_caching=True,
        kv_blocks=40,
        max_num_seqs=1,
        max_model_len=8192,
        prefill_attempt_interval=1,
    )
    _cached(engine, "cached", _turn("Hello."))
    assert len(engine._cache.index) == 1
    engine.add_request("0", "busy", {"max_tokens": 30, "ignore_eos": True}, _turn("Busy."))
    engine.has_unfinished_requests()
    engine.step()  # "busy" runs and holds the only running slot
    assert [sequence.request_id for sequence in engine._table.running] == ["busy"]
    big = np.arange(1000, 4900, dtype=np.int32)  # a prompt past the watermark with the entry
    engine.add_request("0", "big", {"max_tokens": 4}, big)
    for _ in range(10):
        engine.has_unfinished_requests()
        engine.step()
        assert len(engine._cache.index) >= 1, "evicted while no prompt could start"
    outputs = [o for batch in run_to_end(engine) for o in batch]
    finished = {request_id: finish for request_id, _, finish in outputs if finish}
    assert finished["big"] in {"stop", "length"}  # it ran once the slot was free
