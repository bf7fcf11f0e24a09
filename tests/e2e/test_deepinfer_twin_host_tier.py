"""The prefix cache's host-memory tier on DeepInfer 0.1.0's own engine (the CPU twin).

An evicted entry's KV block rows and state row are copied to host memory and copied back into
new blocks when a prompt that starts with it arrives (`engines/deepinfer/prefix_host.py`). The
twin's worker checks before every forward that each sequence sees exactly its own token prefix
and a state at the right position, so rows restored wrong fail the forward; the tests also
compare the restored rows with the evicted ones byte for byte, check that nothing leaks (blocks,
state slots, host bytes) when a restore races an abort (while its fork waits, or while it waits
in the tier's queue for room) or its host entry is dropped while it waits, that an answer after
a restore equals a cold prefill's, that a host entry is found only under its cache salt, and
that a restore slower than computing is not taken.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin.runner import run_in_twin
from tests.paths import REPO

pytestmark = pytest.mark.deepinfer_twin

HOST = {"min_tokens": 64, "host_tier_bytes": 10**9}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin-host") / "DeepSeek-V4.1-Flash")


SCENARIOS = """
import sys
sys.path.insert(0, {repo!r})
import dataclasses
import numpy as np
from deepinfer_server.model.kv_block import blocks_for
from tests.deepinfer_twin.prefix_traces import TraceRunner, capture_added, ledger_problems

CACHE = ENGINE.prefix_cache
HOST = CACHE.host
ROWS = ENGINE.driver_worker.cache_engine
returned = capture_added(ENGINE)
traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=400)
words = traces.words
def turn(text):
    return [traces.bos, *traces.system, traces.user, *words(text), traces.assistant,
            traces.end_think]
def send(name, tokens, salt=None, max_tokens=16):
    DRIVER.add(AddRequest(name, pack_token_ids(tokens), SamplingOptions(max_tokens=max_tokens),
                          cache_salt=salt))
    return int(returned[name].num_cached_tokens)
def next_turn(tokens, answer, text):
    return [*tokens, *answer, traces.eos, traces.user, *words(text), traces.assistant,
            traces.end_think]
def rows_of(blocks, slot):
    return (ROWS.gpu_blocks[blocks].clone().numpy().tobytes(),
            ROWS.gpu_states[slot].clone().numpy().tobytes())
def evict_all():
    for entry in list(CACHE.index):
        CACHE.evict(entry)
def host_hits():
    return HOST.stats().hit_tokens

checks = {{}}
# (1) provenance: the evicted rows, the host copy and the restored rows are the same bytes.
turn1 = turn("list the files in the repository")
send("t1", turn1)
answer1 = run()["t1"]["tokens"]
(entry,) = list(CACHE.index)
table = CACHE.host.placement.table_of(entry.value)
evicted = rows_of(table[: blocks_for(entry.length)], int(entry.value.state_id))
evict_all()
(host_entry,) = list(HOST.tier.entries())
rows = host_entry.value.rows
checks["host_copy_equal"] = (rows.blocks.numpy().tobytes(), rows.state.numpy().tobytes()) == evicted
turn2 = next_turn(turn1, answer1, "now open the first one")
checks["t2_cached"] = send("t2", turn2)
fork = returned["t2"]
restored_table = CACHE.host.placement.table_of(fork)
restored = rows_of(restored_table[: blocks_for(len(turn1))], int(fork.state_id))
checks["restored_equal"] = restored == evicted
checks["host_hits_t2"] = host_hits()
checks["host_left_t2"] = HOST.tier.used_bytes
warm = run()["t2"]
checks["t2_finish"] = warm["finish"]

# (3) a greedy answer after a restore equals a cold prefill's.
evict_all()
turn3 = next_turn(turn2, warm["tokens"], "and the second one")
checks["t3_cached"] = send("t3", turn3)
restored_answer = run()["t3"]["tokens"]
CACHE.clear()
checks["cold_cached"] = send("t3-cold", turn3)
cold_answer = run()["t3-cold"]["tokens"]
checks["same_answer"] = restored_answer == cold_answer and len(cold_answer) > 0

# (2) a restore aborted while its fork waits leaks nothing.
CACHE.clear()
send("b1", turn("explain the build"))
answer_b = run()["b1"]["tokens"]
evict_all()
before = host_hits()
checks["b2_cached"] = send("b2", next_turn(turn("explain the build"), answer_b, "go on"))
DRIVER.abort(["b2"])
run()
checks["abort_hits"] = host_hits() - before
checks["abort_host_bytes"] = HOST.tier.used_bytes
checks["abort_ledger"] = ledger_problems(ENGINE)

# (2) a restore that waits for room in the tier's queue: aborted there, or its host entry
# dropped while it waits (it then computes in full); blocks are held elsewhere meanwhile.
from deepinfer_server.engines.deepinfer.cache_memory import allocate
def hold_blocks():
    return allocate(ENGINE.block_manager, int(ENGINE.scheduler.get_num_free_gpu_blocks()) - 2)
def release(blocks):
    ENGINE.block_manager.unpin_blocks(np.asarray(blocks, dtype=np.int32))
send("b3", turn("explain the build"))
turn_b2 = next_turn(turn("explain the build"), run()["b3"]["tokens"], "go on")
evict_all()
held = hold_blocks()
send("q1", turn_b2)
checks["queued"] = [len(HOST.pending), HOST.tier.used_bytes > 0]
DRIVER.abort(["q1"])
checks["queued_after_abort"] = len(HOST.pending)
release(held)
run()
checks["queue_abort_ledger"] = ledger_problems(ENGINE)
held = hold_blocks()
checks["q2_cached"] = send("q2", turn_b2)
HOST.tier.clear()
release(held)
checks["q2_finish"] = run()["q2"]["finish"]
checks["q2_host_hits"] = host_hits() - before
checks["queue_drop_ledger"] = ledger_problems(ENGINE)

# (4) a host entry is found only under its cache salt.
CACHE.clear()
send("s1", turn1, b"a")
salted_answer = run()["s1"]["tokens"]
evict_all()
salted2 = next_turn(turn1, salted_answer, "now open the first one")
checks["salt_b"] = send("s2b", salted2, b"b")
run()
checks["salt_none"] = send("s2n", salted2)
run()
checks["salt_a"] = send("s2a", salted2, b"a")
run()

# (5) a restore slower than computing is not taken: the copy of one block and a state row
# takes as long as computing 100 tokens.
CACHE.clear()
rate = HOST.tier.settings.prefill_tokens_per_s
one_block = HOST.tier.settings.copy_bytes(1)
HOST.tier.settings = dataclasses.replace(HOST.tier.settings, bandwidth=one_block * rate / 100)
short = [traces.bos, traces.user, *words("alpha bravo charlie delta echo " * 14)[:70],
         traces.assistant, traces.end_think]
send("short1", short)
short_answer = run()["short1"]["tokens"]
evict_all()
checks["short_prompt"] = len(short)
checks["short_cached"] = send("short2", next_turn(short, short_answer, "go on"))
run()
checks["short_host_kept"] = len(list(HOST.tier.entries()))
send("long1", turn1)
long_answer = run()["long1"]["tokens"]
evict_all()
checks["long_cached"] = send("long2", next_turn(turn1, long_answer, "go on"))
run()

# (7) a restore whose copy fails takes a full prefill and gives back what it reserved; a
# queued prompt aborted leaves no ask behind.
CACHE.clear()
send("f1", turn1)
f_answer = run()["f1"]["tokens"]
evict_all()
(f_host,) = list(HOST.tier.entries())
real_restore = HOST.copier.restore
def failing_restore(*args, **kwargs):
    raise RuntimeError("the copy failed")
HOST.copier.restore = failing_restore
checks["f2_cached"] = send("f2", next_turn(turn1, f_answer, "go on"))
HOST.copier.restore = real_restore
checks["f2_finish"] = run()["f2"]["finish"]
checks["f_host_forks"] = f_host.live_forks
checks["f_ledger"] = ledger_problems(ENGINE)
held = hold_blocks()
send("q3", turn("a salted question about the build"), b"q")
q3_id = returned["q3"].seq_id
checks["q3_queued"] = len(HOST.pending)
DRIVER.abort(["q3"])
release(held)
run()
checks["q3_ask_dropped"] = CACHE.asks.get(q3_id) is None

# (6) retention: a pin follows its entry into the tier, where an unpinned entry's copy does not
# push it out.
CACHE.clear()
checks["pins_shared"] = HOST.tier.pins is CACHE.retention
pinned_turn = turn("keep the conventions of the project in mind")
DRIVER.add(AddRequest("p1", pack_token_ids(pinned_turn),
                      SamplingOptions(max_tokens=16, retention_seconds=300)))
run()
evict_all()
(pinned_host,) = list(HOST.tier.entries())
checks["pinned_in_tier"] = CACHE.retention.pinned(pinned_host)
# Room for that one copy only.
HOST.tier.settings = dataclasses.replace(HOST.tier.settings, budget_bytes=HOST.tier.used_bytes)
send("u1", turn("an unrelated question about the weather"))
run()
evict_all()
checks["pinned_kept"] = [entry is pinned_host for entry in HOST.tier.entries()]

RESULT = {{
    "turn1": len(turn1),
    "checks": checks,
    "stats": {{name: getattr(HOST.stats(), name) for name in HOST.stats().__struct_fields__}},
    "unplaced": HOST.unplaced_evictions,
    "violations": ENGINE._run_workers("twin_kv_report"),
    "ledger": ledger_problems(ENGINE),
    "baseline": traces.baseline_problems(),
    "host_after_clear": HOST.tier.used_bytes,
}}
"""


def test_the_host_tier_restores_exactly_what_it_evicted(checkpoint: Path) -> None:
    result = run_in_twin(
        checkpoint,
        SCENARIOS.format(repo=str(REPO)),
        engine={"prefix_cache": HOST},
    )
    checks = result["checks"]
    prompt = result["turn1"]
    # (1) The rows went to host memory and came back byte for byte; the twin's forward checks
    # passed on them (a violation raises in the driver).
    assert checks["host_copy_equal"] and checks["restored_equal"]
    assert checks["t2_cached"] == prompt and checks["host_hits_t2"] == prompt
    assert checks["host_left_t2"] == 0  # the restored entry left the tier
    assert checks["t2_finish"] in ("STOP", "LENGTH")
    # (3) The same answer restored as computed cold.
    assert checks["t3_cached"] > prompt and checks["cold_cached"] == 0
    assert checks["same_answer"]
    # (2) The aborted restore was counted, then freed everything; the host copy went with it.
    assert checks["b2_cached"] > 0 and checks["abort_hits"] == checks["b2_cached"]
    assert checks["abort_host_bytes"] == 0 and checks["abort_ledger"] == []
    # A queued restore aborted frees nothing it did not hold (its host entry stays); one whose
    # host entry went while it waited computes in full, correctly.
    assert checks["queued"] == [1, True] and checks["queued_after_abort"] == 0
    assert checks["queue_abort_ledger"] == [] and checks["queue_drop_ledger"] == []
    assert checks["q2_cached"] > 0 and checks["q2_finish"] in ("STOP", "LENGTH")
    assert checks["q2_host_hits"] == checks["b2_cached"]  # the aborted restore's only
    # (4) Salts partition the tier.
    assert checks["salt_b"] == 0 and checks["salt_none"] == 0
    assert checks["salt_a"] == prompt
    # (5) A short prefix is recomputed (its host entry stays), a long one restored.
    assert 64 <= checks["short_prompt"] < 100
    assert checks["short_cached"] == 0 and checks["short_host_kept"] == 1
    assert checks["long_cached"] == prompt
    # One entry DeepInfer placed was dropped, not offloaded: (7)'s full prefill, evicted for
    # the queued prompt's room.
    assert result["unplaced"] == 1
    stats = result["stats"]
    assert stats["hit_tokens"] >= 3 * prompt and stats["restore_bytes"] > 0
    assert stats["offload_bytes"] > stats["restore_bytes"]  # not every copy came back
    assert stats["offload_seconds"] > 0 and stats["restore_seconds"] > 0
    assert result["violations"] == [] and result["ledger"] == [] and result["baseline"] == []
    assert result["host_after_clear"] == 0
    # (7) The failed restore computed in full, correctly, leaking nothing; the aborted queued
    # prompt's ask went with it.
    assert checks["f2_cached"] == 0 and checks["f2_finish"] in ("STOP", "LENGTH")
    assert checks["f_host_forks"] == 0 and checks["f_ledger"] == []
    assert checks["q3_queued"] == 1 and checks["q3_ask_dropped"]
    # (6) The pin went into the tier with its entry and kept it there.
    assert checks["pins_shared"] and checks["pinned_in_tier"]
    assert checks["pinned_kept"] == [True]


RANK_BUILD = """
from deepinfer_server.engines.backend import EngineSpec
from deepinfer_server.engines.deepinfer.backend import DeepInferOptions
from deepinfer_server.engines.deepinfer.engine import build

spec = EngineSpec(
    rank=0, model=CHECKPOINT, served_model_name="flash", data_parallel_size=1,
    context_parallel_size=1, expert_parallel_size=1, max_model_len=4096, max_num_seqs=8,
    max_num_batched_tokens=None,
    engine_options=DeepInferOptions(kv_offload_host_bandwidth_gbps=10.0),
    enable_prefix_caching=True, kv_offload_host_gb={gb},
)
built = build(spec, None)
ENGINE = built.core._engine
stats = built.core._readouts.prefix_cache_stats()
RESULT = {{
    "host": None if stats.host is None
    else {{name: getattr(stats.host, name) for name in stats.host.__struct_fields__}},
    "bandwidth": None if ENGINE.prefix_cache.host is None
    else ENGINE.prefix_cache.host.tier.settings.bandwidth,
}}
"""


@pytest.mark.parametrize("gb", [0.5, 0.0])
def test_a_rank_builds_the_tier_its_spec_asks_for_and_reports_it(
    checkpoint: Path, gb: float
) -> None:
    # The driver's prefix-cache readout carries the tier's counters (what /metrics shows as
    # prefix_cache_host_* and tier="host"), as on the simulated engine; none without a tier.
    result = run_in_twin(checkpoint, RANK_BUILD.format(gb=gb), engine={"build": False})
    if gb:
        assert result["bandwidth"] == 10e9
        assert result["host"]["budget_bytes"] == 500_000_000
        assert result["host"]["hit_tokens"] == 0
    else:
        assert result == {"host": None, "bandwidth": None}
