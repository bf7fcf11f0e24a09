"""The server's prefix cache on DeepInfer 0.1.0's own engine (the CPU twin).

The twin's worker keeps, per KV position and state slot, the token a forward wrote, and checks
before every forward that each scheduled sequence sees exactly its own token prefix and a state
at the right position (tests/deepinfer_twin/site/deepinfer_twin/kv.py); the trace runner
(tests/deepinfer_twin/prefix_traces.py) also checks every block's and slot's reference count
after every iteration and that all return to their baseline. The property tests play random
agent traces (hypothesis, inside one twin process per configuration) against DeepInfer's real
C++ scheduler: hits, misses, aborts at every stage, preemption and eviction in a tiny pool, zero
overhead scheduling on and off, MTP drafts, two CP workers, two DP ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deepinfer_server.engines.deepinfer.prefix_forks import FORK_BRANCH
from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin import engine_env, prefix_traces
from tests.deepinfer_twin.runner import run_in_twin, run_in_twin_ranks
from tests.paths import REPO

pytestmark = pytest.mark.deepinfer_twin

CACHE = {"prefix_cache": {"min_tokens": 64}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin-prefix") / "DeepSeek-V4.1-Flash")


RANK_BUILD = """
from deepinfer_server.engines.backend import EngineSpec
from deepinfer_server.engines.deepinfer.backend import DeepInferOptions
from deepinfer_server.engines.deepinfer.engine import build

spec = EngineSpec(
    rank=0, model=CHECKPOINT, served_model_name="flash", data_parallel_size=1,
    context_parallel_size=1, expert_parallel_size=1, max_model_len=4096, max_num_seqs=8,
    max_num_batched_tokens=None, engine_options=DeepInferOptions(),
    enable_prefix_caching={enabled}, prefix_cache_retention_share=0.5,
)
built = build(spec, None)
ENGINE = built.core._engine
cache = getattr(ENGINE, "prefix_cache", None)
RESULT = {{
    "class": type(ENGINE).__name__,
    "stats": hasattr(ENGINE, "prefix_cache_stats"),
    "driver_stats": getattr(ENGINE, "prefix_cache_stats", lambda: None)(),
    "retention": built.core._abilities.retention,
    "pin_budget": None if cache is None else cache.retention.key_budget_blocks,
    "blocks": int(ENGINE.cache_config.num_gpu_blocks),
}}
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_a_rank_builds_the_cache_when_its_spec_enables_it(checkpoint: Path, enabled: bool) -> None:
    result = run_in_twin(checkpoint, RANK_BUILD.format(enabled=enabled), engine={"build": False})
    blocks = result.pop("blocks")
    if enabled:
        # --prefix-cache-retention-share reaches the cache: half the pool per partition.
        assert result == {
            "class": "PrefixCachingLLMEngine",
            "stats": True,
            "driver_stats": [0, 0, 0],
            "retention": True,
            "pin_budget": blocks // 2,
        }
    else:
        assert result == {
            "class": "LLMEngine",
            "stats": False,
            "driver_stats": None,
            "retention": False,
            "pin_budget": None,
        }


TWO_TURNS = """
import sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner, ledger_problems

returned = {{}}
add_request = ENGINE.add_request
def capture(*args, **kwargs):
    seq = add_request(*args, **kwargs)
    returned[args[1]] = seq
    return seq
ENGINE.add_request = capture

traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=400)
words = TOKENIZER.encode("list the files in the repository", add_special_tokens=False).ids
turn1 = [traces.bos, *traces.system, traces.user, *words, traces.assistant, {ending}]
add("short", "unrelated", max_tokens=64)  # alongside; below min_tokens: never cached
DRIVER.add(AddRequest("turn1", pack_token_ids(turn1), SamplingOptions(max_tokens=64)))
first = run()
after_turn1 = ENGINE.prefix_cache_stats()
more = TOKENIZER.encode("now open the first one", add_special_tokens=False).ids
turn2 = [*turn1{cut}, *first["turn1"]["tokens"], traces.eos, traces.user, *more,
         traces.assistant, traces.end_think]
DRIVER.add(AddRequest("turn2", pack_token_ids(turn2), SamplingOptions(max_tokens=64)))
cached = returned["turn2"].num_cached_tokens
second = run()
RESULT = {{
    "turn1_prompt": len(turn1),
    "turn2_prompt": len(turn2),
    "cached": cached,
    "stats": [after_turn1, ENGINE.prefix_cache_stats()],
    "answer": text_of(second["turn2"]["tokens"]),
    "finish": second["turn2"]["finish"],
    "violations": ENGINE._run_workers("twin_kv_report"),
    "ledger": ledger_problems(ENGINE),
    "baseline": traces.baseline_problems(),
}}
"""


@pytest.mark.parametrize(
    ("ending", "cut", "reused"),
    [("traces.end_think", "", 0), ("traces.think", "[:-1], traces.end_think", 1)],
    ids=["tool-loop", "thinking-turn"],
)
def test_a_second_turn_reuses_the_first_turns_prompt(
    checkpoint: Path, ending: str, cut: str, reused: int
) -> None:
    # In thinking mode the earlier prompt ends with <think>, and the next turn renders
    # </think> in its place: one token is recomputed (a rollback within the state's rings).
    result = run_in_twin(
        checkpoint,
        TWO_TURNS.format(repo=str(REPO), ending=ending, cut=cut),
        engine=CACHE,
        env={"DEEPINFER_TWIN_CHECK_KV": "0"},
    )
    prompt = result["turn1_prompt"]
    assert prompt > 400
    assert result["cached"] == prompt - reused
    assert result["cached"] >= 0.9 * prompt
    (queries1, hits1, entries1), (queries2, hits2, entries2) = result["stats"]
    assert hits1 == 0 and entries1 == 1  # turn 1 (the short request is not cached)
    assert queries2 - queries1 == result["turn2_prompt"] and hits2 == result["cached"]
    assert entries2 == 2  # turn 2 joins it
    assert result["answer"] == "now open the first one"
    assert result["finish"] == "STOP"
    assert result["violations"] == [] and result["ledger"] == []
    assert result["baseline"] == []


SALTS = """
import sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner, capture_added, ledger_problems

returned = capture_added(ENGINE)
traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=400)
words = traces.words
def turn(*parts):
    return [traces.bos, *traces.system, *parts, traces.assistant, traces.end_think]
def send(name, tokens, salt, max_tokens=16):
    DRIVER.add(AddRequest(name, pack_token_ids(tokens), SamplingOptions(max_tokens=max_tokens),
                          cache_salt=salt))
    return int(returned[name].num_cached_tokens)

cached = {{}}
turn1 = turn(traces.user, *words("list the files in the repository"))
cached["a1"] = send("a1", turn1, b"a")
answer = run()["a1"]["tokens"]
turn2 = [*turn1, *answer, traces.eos, traces.user, *words("now open the first one"),
         traces.assistant, traces.end_think]
for name, salt in [("b2", b"b"), ("none2", None), ("a2", b"a")]:
    cached[name] = send(name, turn2, salt)
    run()
# Aborted while waiting: DeepInfer ignores it, never finalizes it; its salt must go.
send("waiting", [*turn2, *words("and the second")], b"w")
DRIVER.abort(["waiting"])
run()
# Aborted while running: finalized and kept, under its own salt only.
turn3 = turn(traces.user, *words("explain the build"))
send("running", turn3, b"r", max_tokens=64)
iterate(4)
DRIVER.abort(["running"])
run()
turn4 = [*turn3, traces.eos, traces.user, *words("go on"), traces.assistant, traces.end_think]
for name, salt in [("none4", None), ("r4", b"r")]:
    cached[name] = send(name, turn4, salt)
    run()
RESULT = {{
    "turn1": len(turn1),
    "turn3": len(turn3),
    "cached": cached,
    "salts_left": len(ENGINE.prefix_cache.asks),
    "violations": ENGINE._run_workers("twin_kv_report"),
    "ledger": ledger_problems(ENGINE),
    "baseline": traces.baseline_problems(),
}}
"""


def test_a_cache_salt_partitions_what_deepinfers_requests_reuse(checkpoint: Path) -> None:
    # Tenant A's conversation is reused by A's next turn only: another salt and no salt get
    # nothing. An aborted running request is kept under its own salt, never as an unsalted
    # entry; a waiting one that DeepInfer ends without finalizing leaves no salt behind.
    result = run_in_twin(
        checkpoint,
        SALTS.format(repo=str(REPO)),
        engine=CACHE,
        env={"DEEPINFER_TWIN_CHECK_KV": "0"},
    )
    assert result["cached"] == {
        "a1": 0,
        "b2": 0,
        "none2": 0,
        "a2": result["turn1"],
        "none4": 0,
        "r4": result["turn3"],
    }
    assert result["salts_left"] == 0
    assert result["violations"] == [] and result["ledger"] == []
    assert result["baseline"] == []


FALLBACKS = """
import sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner

traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=300)
words = TOKENIZER.encode("count to three", add_special_tokens=False).ids
turn1 = [traces.bos, *traces.system, traces.user, *words, traces.assistant, traces.end_think]
DRIVER.add(AddRequest("turn1", pack_token_ids(turn1), SamplingOptions(max_tokens=16)))
run()
turn2 = [*turn1, *words, traces.eos, traces.user, *words, traces.assistant, traces.end_think]
hits, entries = ENGINE.prefix_cache.hit_tokens, len(ENGINE.prefix_cache.index)
outcomes = {{}}
for name, options in {{
    "prompt_logprobs": SamplingOptions(max_tokens=4, prompt_logprobs=True),
    "grammar": SamplingOptions(max_tokens=4, structured=StructuredOutput(
        schema_type="regex", schema="[a-z]{{1,3}}")),
}}.items():
    logprobs, tokens = [], []
    rejected = DRIVER.add(AddRequest(name, pack_token_ids(turn2), options))
    finish = None
    for _ in range(2000):
        unfinished, deltas = DRIVER.iterate()
        for delta in deltas:
            logprobs += delta.tokens.prompt_logprobs or []
            tokens += delta.tokens.token_ids
            finish = delta.finish.name if delta.finish else finish
        if finish:
            break
    outcomes[name] = {{"rejected": rejected is not None, "finish": finish,
                       "prompt_logprobs": len(logprobs), "text": text_of(tokens)}}
run()
RESULT = {{
    "turn2": len(turn2),
    "outcomes": outcomes,
    "reused": ENGINE.prefix_cache.hit_tokens - hits,
    "entries_kept": len(ENGINE.prefix_cache.index) >= entries,
    "violations": ENGINE._run_workers("twin_kv_report"),
    "baseline": traces.baseline_problems(),
}}
"""


def test_requests_the_fork_path_cannot_serve_take_a_full_prefill(checkpoint: Path) -> None:
    # Prompt logprobs: fork_seq refuses them. A grammar: its matcher is built after
    # add_request returns (the fork would run unconstrained). Both prefill in full, and the
    # entry they would have forked from stays.
    result = run_in_twin(
        checkpoint,
        FALLBACKS.format(repo=str(REPO)),
        engine=CACHE,
        env={"DEEPINFER_TWIN_CHECK_KV": "0", "DEEPINFER_SO_BUILDER_CPUS": "0"},
    )
    outcomes = result["outcomes"]
    assert outcomes["prompt_logprobs"] == {
        "rejected": False,
        "finish": "STOP",
        "prompt_logprobs": result["turn2"] - 1,
        "text": "count to three",
    }
    grammar = outcomes["grammar"]
    assert (grammar["rejected"], grammar["finish"]) == (False, "STOP")
    assert re.fullmatch("[a-z]{1,3}", grammar["text"]), grammar["text"]
    assert result["reused"] == 0 and result["entries_kept"]
    assert result["violations"] == [] and result["baseline"] == []


ABORTED_FORKS = """
import sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner, ledger_problems

traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=300)
cache = ENGINE.prefix_cache
def conversation(text):
    words = TOKENIZER.encode(text, add_special_tokens=False).ids
    return [traces.bos, *traces.system, traces.user, *words, traces.assistant, traces.end_think]
def start(request_id, prompt, **options):
    options.setdefault("max_tokens", 8)
    request = AddRequest(request_id, pack_token_ids(prompt), SamplingOptions(**options))
    assert DRIVER.add(request) is None
problems = []
def steps(count):
    for _ in range(count):
        DRIVER.iterate()
        problems.extend(ledger_problems(ENGINE))

turn1 = conversation("count to three")
start("turn1", turn1)
run()
turn2 = [*turn1, *turn1[-4:], traces.eos, traces.user, *turn1[-9:-4], traces.assistant,
         traces.end_think]
# 1. Aborted before its prefill: the fork holds pins on the parent's blocks and slot.
hits = cache.hit_tokens
start("waiting", turn2)
reused_waiting = cache.hit_tokens - hits
DRIVER.abort(["waiting"])
steps(3)
# 2. Its prefill allocated and cloned, then stopped: both sequences slots are taken. That
# decode step also carries the snapshot of a sequence that has just been prefilled: two clone
# calls in one step.
start("long1", conversation("first long request"), max_tokens=400, ignore_eos=True)
steps(2)
start("long2", conversation("second long request"), max_tokens=400, ignore_eos=True)
steps(1)
hits, snapshots = cache.hit_tokens, len(cache.snapshots.taken)
start("blocked", turn2)
reused_blocked = cache.hit_tokens - hits
steps(1)
assert reused_blocked, "the entry was evicted"
(fork,) = cache.forks.waiting.values()
blocked = {{"branch": fork.branch_id, "status": fork.status.name,
            "snapshots": [snapshots, len(cache.snapshots.taken)]}}
DRIVER.abort(["blocked"])
steps(2)
DRIVER.abort(["long1", "long2"])
run()
RESULT = {{
    "reused": [reused_waiting, reused_blocked],
    "blocked": blocked,
    "problems": problems,
    "violations": ENGINE._run_workers("twin_kv_report"),
    "baseline": traces.baseline_problems(),
}}
"""


def test_a_fork_aborted_before_its_prefill_frees_what_it_holds(checkpoint: Path) -> None:
    # DeepInfer never frees a sequence aborted while waiting (it had nothing yet); a fork does
    # hold something: the parent's pins, or its own blocks and slot once its prefill allocated.
    result = run_in_twin(
        checkpoint,
        ABORTED_FORKS.format(repo=str(REPO)),
        engine={**CACHE, "max_num_seqs": 2},
        # Slots for two running sequences, their snapshots and the cached turn (as the
        # server's docs recommend with the cache: the default 1.2 leaves two).
        env={"DEEPINFER_TWIN_CHECK_KV": "0", "DEEPINFER_NUM_STATE_SLOTS_RATIO": "3"},
    )
    assert all(reused > 0 for reused in result["reused"])
    # The forked prefill ran (the branch lost its "_") and stopped at max_num_seqs, in the
    # step that also snapshotted the second long request.
    assert result["blocked"] == {
        "branch": FORK_BRANCH[1:],
        "status": "WAITING",
        "snapshots": [1, 2],
    }
    assert result["problems"] == [] and result["violations"] == []
    assert result["baseline"] == []


OVERSIZED_FORK = """
import sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner, ledger_problems

traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=60)
cache = ENGINE.prefix_cache
words = traces.words
def start(request_id, prompt, **options):
    request = AddRequest(request_id, pack_token_ids(prompt), SamplingOptions(**options))
    assert DRIVER.add(request) is None
first = [traces.bos, *traces.system, traces.user, *words("count", 40), traces.assistant,
         traces.end_think]
start("first", first, max_tokens={answer}, ignore_eos=True)
run()
# The first prompt again, with more after it instead of the first's answer (an edited
# retry): the first's prompt is its prefix, the first's answer is not part of it.
sibling = [*first, *words("other words", {extra}), traces.user, traces.assistant,
           traces.end_think]
hits = cache.hit_tokens
start("sibling", sibling, max_tokens=8)
done = run(max_iterations=300)
RESULT = {{
    "blocks": int(ENGINE.cache_config.num_gpu_blocks),
    "first": len(first), "sibling": len(sibling),
    "reused": cache.hit_tokens - hits,
    "too_large": cache.forks_too_large,
    "finish": done.get("sibling", {{}}).get("finish"),
    "problems": ledger_problems(ENGINE),
    "violations": ENGINE._run_workers("twin_kv_report"),
    "baseline": traces.baseline_problems(),
}}
"""


@pytest.mark.parametrize(
    ("answer", "extra", "forked"), [(700, 500, False), (100, 500, True)], ids=["long", "short"]
)
def test_a_fork_whose_pins_leave_its_prefill_no_room_prefills_in_full(
    checkpoint: Path, answer: int, extra: int, forked: bool
) -> None:
    # 12 KV blocks of 128 tokens (11 allocatable). A fork pins its parent's whole table
    # (DeepInfer's bindings give no block IDs to pin less): a 147-token prompt with a 700-token
    # answer holds 7 blocks, and the 650-token sibling needs 5 more beside the one it keeps;
    # DeepInfer would never schedule that fork's prefill (nor the prompts queued behind it).
    # A full prefill needs 6 once the entry gives way. After a 100-token answer the fork fits
    # and is taken.
    result = run_in_twin(
        checkpoint,
        OVERSIZED_FORK.format(repo=str(REPO), answer=answer, extra=extra),
        engine={**CACHE, "max_num_seqs": 2, "max_model_len": 1024},
        env={"DEEPINFER_TWIN_KV_BLOCKS": "12", "DEEPINFER_NUM_STATE_SLOTS_RATIO": "3"},
    )
    assert (result["blocks"], result["first"], result["sibling"]) == (12, 147, 650), result
    assert result["finish"] in ("STOP", "LENGTH"), result  # None: never scheduled
    if forked:
        assert result["reused"] > 0 and result["too_large"] == 0, result
    else:
        assert result["reused"] == 0 and result["too_large"] == 1, result
    assert result["problems"] == [] and result["violations"] == [], result
    assert result["baseline"] == [], result


RETENTION = """
import sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner, ledger_problems

traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=60)
cache = ENGINE.prefix_cache
words = traces.words
def conversation(text):
    return [traces.bos, *traces.system, traces.user, *words(text, 120), traces.assistant,
            traces.end_think]
def send(name, prompt, retention=0, salt=b"a", max_tokens=4):
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True,
                              retention_seconds=retention)
    assert DRIVER.add(AddRequest(name, pack_token_ids(prompt), options, cache_salt=salt)) is None
    written = None
    for _ in range(2000):
        unfinished, deltas = DRIVER.iterate()
        for delta in deltas:
            if delta.request_id == name and written is None:
                written = delta.written_tokens or 0
        if not unfinished and not deltas and DRIVER.num_live == 0:
            return written
    raise AssertionError(f"{{name}} never ended")
def kept(prompt):
    return [entry for entry in cache.index if entry.tokens.tolist() == prompt]

prompts = {{name: conversation(name) for name in ("pinned", "over", "plain", "other")}}
written, pins = {{}}, {{}}
written["short"] = send("short", [traces.bos, traces.user, *words("hi", 8), traces.assistant])
for name, retention, salt in [
    ("pinned", 300, b"a"),
    # Key a's budget (a quarter of the pool) holds one of these prompts, not two: kept and
    # reported written all the same, unpinned.
    ("over", 300, b"a"),
    ("plain", 0, b"a"),
    ("other", 300, b"b"),  # another key's own budget
]:
    written[name] = send(name, prompts[name], retention=retention, salt=salt)
    pins[name] = [cache.retention.pinned(entry) for entry in kept(prompts[name])]
kept_before = [len(cache.index), cache.evictions]
order = [entry.tokens.tolist() for entry in cache.index.eviction_order()]
lru_first = [name for name, prompt in prompts.items() if order and order[0] == prompt]
# A long prompt the pool has room for once the two unpinned entries are evicted.
evictions = cache.evictions
send("pressure", conversation("pressure")[:140] + words("more words", 360), salt=None)
survivors = {{name: len(kept(prompt)) for name, prompt in prompts.items()}}
evicted = cache.evictions - evictions
# One the pool has room for only once every entry is gone, pinned ones too: their pins go
# with them (no other tier holds them), so key a's budget is free again.
send("flood", conversation("flood")[:140] + words("many more words", 760), salt=None)
RESULT = {{
    "blocks": int(ENGINE.cache_config.num_gpu_blocks),
    "prompt": len(prompts["pinned"]),
    "written": written,
    "pins": pins,
    "budget": cache.retention.key_budget_blocks,
    "lru_first": lru_first,
    "evicted": evicted,
    "kept_before": kept_before,
    "survivors": survivors,
    "after_flood": [len(kept(prompts["pinned"])), cache.retention.pinned_blocks(b"a"),
                    cache.retention.pinned_blocks(b"b")],
    "problems": ledger_problems(ENGINE),
    "violations": ENGINE._run_workers("twin_kv_report"),
    "baseline": traces.baseline_problems(),
}}
"""


def test_a_retained_prompt_is_written_pinned_within_its_budget_and_evicted_last(
    checkpoint: Path,
) -> None:
    # 12 KV blocks (11 allocatable): a partition may pin 3, one 227-token prompt's 2 blocks.
    # Four conversations are kept (2 blocks each); a 500-token prompt then needs 5 blocks
    # under the 90% watermark: both unpinned entries go and the pinned ones stay, though the
    # pinned conversation is the least recently used. A 900-token prompt then needs the whole
    # pool: the pinned entries go too, and their pins with them.
    result = run_in_twin(
        checkpoint,
        RETENTION.format(repo=str(REPO)),
        engine={**CACHE, "max_num_seqs": 2, "max_model_len": 1024},
        env={"DEEPINFER_TWIN_KV_BLOCKS": "12", "DEEPINFER_NUM_STATE_SLOTS_RATIO": "4"},
    )
    prompt = result["prompt"]
    assert (result["blocks"], result["budget"]) == (12, 3), result
    assert result["written"] == {
        "pinned": prompt,
        "over": prompt,
        "plain": 0,
        "other": prompt,
        "short": 0,  # below min_tokens: never kept, so nothing is reported written
    }, result
    assert result["pins"] == {
        "pinned": [True],
        "over": [False],
        "plain": [False],
        "other": [True],
    }, result
    assert result["kept_before"] == [4, 0], result  # four entries, nothing evicted yet
    assert result["lru_first"] == ["pinned"], result
    assert result["evicted"] == 2, result
    assert result["survivors"] == {"pinned": 1, "over": 0, "plain": 0, "other": 1}, result
    assert result["after_flood"] == [0, 0, 0], result
    assert result["problems"] == [] and result["violations"] == [], result
    assert result["baseline"] == [], result


PROPERTY = """
import sys
sys.path.insert(0, {repo!r})
from hypothesis import HealthCheck, Phase, example, given, settings
from tests.deepinfer_twin.prefix_traces import (
    EXPLICIT_TRACES, HOST_TRACES, TraceRunner, action_strategy,
)

runner = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words={system_words})
totals = {{"examples": 0, "requests": 0, "hits": 0, "reused_tokens": 0, "evictions": 0,
           "preempted": 0, "aborted": 0, "concurrent_forks": 0}}

# One engine serves every example: shrinking would start from whatever a failure left, so the
# first failing trace is reported as it was generated.
@settings(max_examples={examples}, deadline=None, database=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(actions=action_strategy(conversations={conversations}))
def trace(actions):
    report = runner.run(actions, seed=len(actions))
    problems = runner.baseline_problems()
    assert not problems, problems
    totals["examples"] += 1
    for key, value in vars(report).items():
        totals[key] = max(totals[key], value) if key == "concurrent_forks" else totals[key] + value

for explicit in {explicit}:
    trace = example(actions=explicit)(trace)
trace()
HOST = ENGINE.prefix_cache.host
RESULT = {{**totals, "violations": ENGINE._run_workers("twin_kv_report"),
           "host_hits": 0 if HOST is None else HOST.stats().hit_tokens,
           "offloaded": 0 if HOST is None else HOST.stats().offload_bytes}}
"""


@dataclass(frozen=True)
class Lane:
    """One engine configuration the property test plays traces against."""

    engine: dict[str, Any]
    env: dict[str, str]
    examples: int
    conversations: int = 3
    system_words: int = 100
    #: The traces every run plays first (names in `prefix_traces`).
    explicit: tuple[str, ...] = ("EXPLICIT_TRACES",)


LANES = {
    "zos": Lane({"max_num_seqs": 4}, {"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"}, 20),
    # Three state slots for three sequences: every snapshot evicts.
    "no-zos": Lane({"max_num_seqs": 3}, {"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "0"}, 15),
    # 12 KV blocks (11 usable) for five conversations of up to 1024 tokens: decode steps
    # preempt (recompute) and every prefill evicts.
    "tiny-pool": Lane(
        {"max_num_seqs": 4, "max_model_len": 1024},
        {"DEEPINFER_TWIN_KV_BLOCKS": "12", "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"},
        20,
        conversations=5,
        system_words=300,
    ),
    # A small pool with the host tier: evicted entries go to host memory, and come back.
    "host-tier": Lane(
        {
            "max_num_seqs": 4,
            "max_model_len": 1024,
            "prefix_cache": {"min_tokens": 64, "host_tier_bytes": 10**9},
        },
        {"DEEPINFER_TWIN_KV_BLOCKS": "12", "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"},
        12,
        conversations=5,
        system_words=300,
        explicit=("EXPLICIT_TRACES", "HOST_TRACES"),
    ),
    "two-cp-workers": Lane({"max_num_seqs": 4, "context_parallel_size": 2}, {}, 6),
    # Two MTP drafts per step, never accepted by the twin: every decode step rolls the state
    # back two tokens (within DEEPINFER_MAX_BACKTRACKING_TOKENS = 3), forks or not.
    "mtp": Lane(
        {"max_num_seqs": 4},
        {"DEEPINFER_USE_NEXTN_DECODE": "2", "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "0"},
        10,
    ),
}


@pytest.mark.parametrize("name", sorted(LANES))
def test_random_agent_traces_keep_every_prefix_exact(checkpoint: Path, name: str) -> None:
    lane = LANES[name]
    body = PROPERTY.format(
        repo=str(REPO),
        examples=lane.examples,
        system_words=lane.system_words,
        conversations=lane.conversations,
        explicit="(" + "".join(f"*{name}, " for name in lane.explicit) + ")",
    )
    result = run_in_twin(
        checkpoint,
        body,
        engine={**CACHE, **lane.engine},
        env={"DEEPINFER_TWIN_CHECK_KV": "0", **lane.env},
        timeout=900,
    )
    assert result["violations"] == []
    explicit = sum(len(getattr(prefix_traces, name)) for name in lane.explicit)
    assert result["examples"] == lane.examples + explicit
    # The traces did exercise the cache: hits, aborts, and in the tiny pool evictions and
    # preemption.
    assert result["hits"] > 0 and result["reused_tokens"] > 0 and result["aborted"] > 0
    assert result["concurrent_forks"] >= 2
    if name == "tiny-pool":
        assert result["evictions"] > 0 and result["preempted"] > 0
    if name == "host-tier":
        assert result["evictions"] > 0 and result["offloaded"] > 0 and result["host_hits"] > 0


DP_TRACE = """
import random, sys
sys.path.insert(0, {repo!r})
from tests.deepinfer_twin.prefix_traces import TraceRunner, random_actions

runner = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=100)
rng = random.Random(1000 + ENGINE.dp_rank)
reports = [
    vars(runner.run(random_actions(rng, 12), seed=trace, iterations=150)) for trace in range(3)
]
RESULT = {{
    "reports": reports,
    "baseline": runner.baseline_problems(),
    "violations": ENGINE._run_workers("twin_kv_report"),
}}
"""


def test_two_dp_ranks_cache_independently_in_lockstep(checkpoint: Path) -> None:
    # Every iteration is collective (the work vote, the prefill votes): a fork, an eviction or
    # a snapshot on one rank must never change how many steps either rank takes.
    results = run_in_twin_ranks(
        checkpoint,
        DP_TRACE.format(repo=str(REPO)),
        ranks=2,
        engine={**CACHE, "max_num_seqs": 4},
        env={"DEEPINFER_TWIN_CHECK_KV": "0", "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1"},
        timeout=600,
    )
    for result in results:
        assert result["violations"] == [] and result["baseline"] == []
    hits = [sum(report["hits"] for report in result["reports"]) for result in results]
    assert all(count > 0 for count in hits), hits


def test_the_gpu_check_script_runs_on_the_twin(checkpoint: Path) -> None:
    # On a GPU it compares DeepInfer's kernels' answers; on the twin (whose answers do not
    # depend on the KV cache) it proves the script itself: cached turns found, equal answers.
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "check_prefix_cache_gpu.py"),
            "--model",
            str(checkpoint),
            "--prompt-words",
            "300",
            "--max-model-len",
            "4096",
            "--max-tokens",
            "16",
            "--cases",
            "thinking,chain",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **engine_env("0"), "DEEPINFER_USE_MULTIMODAL_POOL": "0"},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if " conversation " in line]
    assert len(lines) == 4 and all(": ok, 16 tokens equal" in line for line in lines), lines
    assert "PASS" in completed.stdout
