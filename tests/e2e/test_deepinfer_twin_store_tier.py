"""The shared store tier on DeepInfer 0.1.0's own engine (the CPU twin) and a real
`mooncake_master`: a conversation's first turn is computed by one engine, which writes the
kept entry's KV block rows and state row to the store (`engines/deepinfer/prefix_store.py`);
a second engine, in a process of its own, restores the next turn from there at the first
turn's end, through its host tier. The twin's worker checks before every forward that each
sequence sees exactly its own token prefix and a state at the right position, so rows read
wrong fail the forward; the restored answer equals a cold prefill's, and another cache salt
finds nothing in the store.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin.runner import run_in_twin, start_in_twin
from tests.lanes import require_disaggregation
from tests.mooncake_master import MooncakeMaster
from tests.paths import REPO
from tests.server import wait_until

require_disaggregation()
pytestmark = [pytest.mark.deepinfer_twin, pytest.mark.disaggregation]

HOST = {"min_tokens": 64, "host_tier_bytes": 10**9}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin-store") / "DeepSeek-V4.1-Flash")


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with tempfile.TemporaryDirectory() as folder:
        started = MooncakeMaster(Path(folder) / "master.log")
        try:
            yield started
        finally:
            started.close()


PRELUDE = """
import sys
sys.path.insert(0, {repo!r})
from deepinfer_server.engines.deepinfer.prefix_store import StoreOptions, store_path
from tests.deepinfer_twin.prefix_traces import TraceRunner, ledger_problems

CACHE = ENGINE.prefix_cache
HOST = CACHE.host
# As a rank with --kv-offload-store builds it (prefix_cache_settings); a loaded CI machine
# must not turn a lookup into a miss: the wait is long here.
OPTIONS = StoreOptions({master!r}, "127.0.0.1", "twin-checkpoint", lookup_timeout=20.0)
HOST.store = store_path(ENGINE, HOST.copier, HOST.tier, OPTIONS)
STORE = HOST.store.store
import logging
WARNINGS = []
class Kept(logging.Handler):
    def emit(self, record):
        WARNINGS.append(record.getMessage())
logging.getLogger("deepinfer_server.prefix_cache.store_tier").addHandler(Kept())
returned = {{}}
add_request = ENGINE.add_request
def capture(*args, **kwargs):
    seq = add_request(*args, **kwargs)
    returned[args[1]] = seq
    return seq
ENGINE.add_request = capture

traces = TraceRunner(ENGINE, DRIVER, TOKENIZER, system_words=400)
def words(text):
    return TOKENIZER.encode(text, add_special_tokens=False).ids
def turn(text):
    return [traces.bos, *traces.system, traces.user, *words(text), traces.assistant,
            traces.end_think]
def send(name, tokens, salt=None, max_tokens=16):
    DRIVER.add(AddRequest(name, pack_token_ids(tokens), SamplingOptions(max_tokens=max_tokens),
                          cache_salt=salt))
    return int(returned[name].num_cached_tokens)
def finish():
    return {{
        "violations": ENGINE._run_workers("twin_kv_report"),
        "ledger": ledger_problems(ENGINE),
        "baseline": traces.baseline_problems(),
        "errors": [STORE.errors, WARNINGS],
        "stats": {{name: getattr(HOST.stats(), name) for name in HOST.stats().__struct_fields__}},
    }}
"""

# The writer stays up until the reader is done: Mooncake keeps an object's bytes in the
# memory its clients give the store, the writer's among them.
WRITER = """
import time
turn1 = turn("list the files in the repository")
cached = send("t1", turn1)
answer1 = run()["t1"]["tokens"]
(entry,) = list(CACHE.index)
STORE.drain()
RESULT = {{
    "turn1": turn1, "answer1": answer1, "cached": cached, "entry": entry.length,
    "pages": STORE.pages_written, "snapshots": STORE.snapshots_written, **finish(),
}}
with open({written!r} + ".part", "w") as out:
    json.dump(RESULT, out)
os.rename({written!r} + ".part", {written!r})
deadline = time.monotonic() + 600
while not os.path.exists({done!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
"""

READER = """
turn2 = [*{turn1!r}, *{answer1!r}, traces.eos, traces.user, *words("now open the first one"),
         traces.assistant, traces.end_think]
restored = send("t2", turn2)
restored_answer = run()["t2"]["tokens"]
cold = send("t2-cold", turn2, b"another partition")
cold_answer = run()["t2-cold"]["tokens"]
RESULT = {{
    "restored": restored, "cold": cold, "answers": [restored_answer, cold_answer], **finish(),
}}
"""


def _prelude(master: MooncakeMaster) -> str:
    return PRELUDE.format(repo=str(REPO), master=f"127.0.0.1:{master.port}")


def _clean(result: Any) -> None:
    assert result["violations"] == [] and result["ledger"] == [] and result["baseline"] == []
    assert result["errors"] == [0, []]


def test_a_turn_computed_by_one_engine_is_restored_by_another_from_the_store(
    checkpoint: Path, master: MooncakeMaster, tmp_path: Path
) -> None:
    handoff, done = tmp_path / "written.json", tmp_path / "done"
    writer = WRITER.format(written=str(handoff), done=str(done))
    wait = start_in_twin(checkpoint, _prelude(master) + writer, engine={"prefix_cache": HOST})
    try:
        wait_until(handoff.exists, 240, "the first engine's turn and its store writes")
        written = json.loads(handoff.read_text())
        keys = master.keys()
        reader = _prelude(master) + READER.format(**written)
        read = run_in_twin(checkpoint, reader, engine={"prefix_cache": HOST})
    finally:
        done.touch()
        assert wait(240) == written
    prompt = len(written["turn1"])
    _clean(written)
    assert written["cached"] == 0 and written["entry"] == prompt
    # Its whole blocks and its snapshot (the last block's rows and the state row).
    assert written["pages"] == prompt // 128 and written["snapshots"] == 1
    assert keys == prompt // 128 + 1

    _clean(read)
    # Restored at the first engine's entry's end, from the store through the host tier.
    assert read["restored"] == prompt
    assert read["stats"]["store_hit_tokens"] == read["stats"]["hit_tokens"] == prompt
    assert read["stats"]["store_errors"] == 0
    # Another partition finds nothing; computed cold, the greedy answer is the same.
    assert read["cold"] == 0
    restored_answer, cold_answer = read["answers"]
    assert restored_answer == cold_answer and len(cold_answer) > 0
