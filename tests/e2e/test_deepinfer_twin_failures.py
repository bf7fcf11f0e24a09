"""What DeepInfer 0.1.0's own engine (the CPU twin) does to one request while others go on.

Each test runs one DP rank of DeepInfer's LLMEngine wrapped in the server's `LLMEngineDriver`
(`run_in_twin`): DeepInfer's C++ scheduler preempts under KV pressure, and its multimodal
processor aborts a request whose image it cannot process, inside `step()`. The driver must turn
each into that request's finish (the client's error, `coordinator/outcomes.py`) and leave the
other requests and the engine's blocks as they should be.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_server.coordinator.outcomes import error_for_finish
from deepinfer_server.ipc.messages import Finish
from tests.checkpoint import IMAGE_PLACEHOLDER, write_checkpoint
from tests.deepinfer_twin.runner import run_in_twin

pytestmark = pytest.mark.deepinfer_twin


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("twin") / "DeepSeek-V4.1-Flash")


COLLECT = """
def collect(seen, iterations):
    # Each request's tokens, hidden tokens, finish, and the deltas that came after its finish.
    for _ in range(iterations):
        unfinished, deltas = DRIVER.iterate()
        for delta in deltas:
            entry = seen.setdefault(
                delta.request_id, {"tokens": [], "hidden": 0, "finish": None, "after": 0}
            )
            if entry["finish"] is not None:
                entry["after"] += 1
            entry["tokens"].extend(delta.tokens.token_ids)
            entry["hidden"] += delta.tokens.hidden_tokens
            if delta.finish is not None:
                entry["finish"] = delta.finish.name
        if not unfinished and not deltas and DRIVER.num_live == 0:
            break
    return seen

def state():
    return {
        "preempted": int(ENGINE.scheduler.get_num_preempted_seqs()),
        "unfinished": ENGINE.get_num_unfinished_requests(),
        "live": DRIVER.num_live,
        "free_blocks": ENGINE.scheduler.get_num_free_gpu_blocks(),
    }
"""

PREEMPTION = (
    COLLECT
    + """
# Two requests of 900 tokens need 16 blocks of 128 tokens; 11 are allocatable. DeepInfer
# preempts the running sequence with the most output: the one given a head start.
structured = StructuredOutput(schema_type="regex", schema="a{1,3000}")
grammar = {}
assert add("so", "aaaa", max_tokens=900, ignore_eos=True, structured=structured) is None
collect(grammar, 300)
assert add("plain", "bbbb", max_tokens=900, ignore_eos=True) is None
collect(grammar, 5000)
after_grammar = state()
plain = {}
assert add("first", "cccc", max_tokens=900, ignore_eos=True) is None
collect(plain, 300)
assert add("second", "cccc", max_tokens=900, ignore_eos=True) is None
collect(plain, 5000)
RESULT = {
    "grammar": grammar, "after_grammar": after_grammar,
    "so_text": text_of(grammar["so"]["tokens"]),
    "plain": plain, "after_plain": state(),
    "total_blocks": ENGINE.cache_config.num_gpu_blocks,
    "violations": ENGINE._run_workers("twin_kv_report"),
}
"""
)


def test_preemption_ends_a_structured_request_and_recomputes_a_plain_one(
    checkpoint: Path,
) -> None:
    # scheduler.hpp `_preempt`: a sequence whose grammar has started (so_status != 0, set at
    # the end of every structured request's prefill) cannot be recomputed and ends
    # FINISHED_PREEMPTED ("insufficient_system_resource") even with
    # stop_preempted_request=False; any other goes back to the waiting queue and is prefilled
    # again with its output so far. Zero-overhead scheduling: the victim is in flight.
    result = run_in_twin(
        checkpoint,
        PREEMPTION,
        env={
            "DEEPINFER_TWIN_KV_BLOCKS": "12",
            "DEEPINFER_SO_BUILDER_CPUS": "0",
            "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "1",
        },
        engine={"max_num_seqs": 2, "max_model_len": 1024},
        timeout=300,
    )
    usable = result["total_blocks"] - 1  # block 0 is never allocatable
    assert usable == 11
    structured, neighbour = result["grammar"]["so"], result["grammar"]["plain"]
    # The structured request ends, as the server's resource error (a 503), after what it had
    # generated under its grammar; the repeated last token of DeepInfer's finishing output is
    # not output, and nothing follows the finish.
    assert structured["finish"] == "OUT_OF_RESOURCES", structured["finish"]
    error = error_for_finish(Finish.OUT_OF_RESOURCES)
    assert (error.status_code, error.code) == (503, "insufficient_system_resource")
    assert 0 < len(structured["tokens"]) + structured["hidden"] < 900
    assert set(result["so_text"]) == {"a"}
    assert structured["after"] == 0
    # It was the only preemption: its neighbour ran to its limit.
    assert neighbour["finish"] == "LENGTH"
    assert len(neighbour["tokens"]) + neighbour["hidden"] == 900
    after = result["after_grammar"]
    assert after["preempted"] == 1
    assert (after["unfinished"], after["live"], after["free_blocks"]) == (0, 0, usable)
    # The plain request preempted the same way is recomputed: it completes with exactly the
    # tokens of the same request that was never preempted (none lost, none repeated).
    first, second = result["plain"]["first"], result["plain"]["second"]
    assert result["after_plain"]["preempted"] > after["preempted"]
    assert first["finish"] == second["finish"] == "LENGTH"
    assert len(first["tokens"]) + first["hidden"] == 900
    assert (first["tokens"], first["hidden"]) == (second["tokens"], second["hidden"])
    end = result["after_plain"]
    assert (end["unfinished"], end["live"], end["free_blocks"]) == (0, 0, usable)
    assert result["violations"] == []


MULTIMODAL = (
    COLLECT
    + """
import io
from PIL import Image
from deepinfer_server.ipc.messages import Images

def png(width, height):
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()

def add_image(request_id, data):
    return DRIVER.add(AddRequest(
        request_id, pack_token_ids(prompt(PLACEHOLDER + "what is this?")),
        SamplingOptions(max_tokens=200), images=Images(sizes=[(64, 64)], data=[data]),
    ))

seen = {}
assert add("text", "still serving", max_tokens=64, ignore_eos=True) is None
collect(seen, 3)
assert add_image("broken", b"not an image") is None
assert add_image("good", png(64, 64)) is None
collect(seen, 3000)
# DeepInfer's own sign of an image its entrypoint could not fetch: image_bytes None ends the
# request "ve_error" at its prefill. The server never sends it; its finish must still end it.
Images.as_multi_modal_data = lambda self: {"image_sizes": list(self.sizes), "image_bytes": None}
assert add_image("unfetched", png(64, 64)) is None
assert add("after", "and after", max_tokens=16) is None
collect(seen, 3000)
RESULT = {
    "run": {
        request_id: {**entry, "text": text_of(entry["tokens"])}
        for request_id, entry in seen.items()
    },
    "state": state(),
    "total_blocks": ENGINE.cache_config.num_gpu_blocks,
    "workers": [child.name for child in __import__("multiprocessing").active_children()],
}
"""
)


def test_an_image_deepinfer_cannot_prepare_fails_that_request_alone(checkpoint: Path) -> None:
    # DeepInfer's multimodal worker decodes each image (PIL) in a process of its own; one that
    # fails comes back as None, and the next step() aborts that request
    # (`fetch_to_abort_requests`). The server checks images before the engine sees them, so
    # this image is sent to the driver directly.
    result = run_in_twin(checkpoint, MULTIMODAL.replace("PLACEHOLDER", repr(IMAGE_PLACEHOLDER)))
    run = result["run"]
    assert (run["broken"]["finish"], run["broken"]["tokens"]) == ("ABORTED", [])
    error = error_for_finish(Finish.ABORTED)
    assert (error.status_code, error.code) == (500, "engine_aborted")
    assert "images" in error.message
    assert (run["unfetched"]["finish"], run["unfetched"]["tokens"]) == ("ENGINE_ERROR", [])
    # The other requests, before and after, and the next image, are served as ever.
    assert run["text"]["finish"] == "LENGTH"
    assert run["text"]["text"].startswith("still serving")
    assert run["good"]["finish"] == "STOP"
    assert run["good"]["text"].startswith("[image 1: ")
    assert run["good"]["text"].endswith("what is this?")
    assert (run["after"]["finish"], run["after"]["text"]) == ("STOP", "and after")
    assert all(entry["after"] == 0 for entry in run.values())
    state = result["state"]
    usable = result["total_blocks"] - 1
    assert (state["unfinished"], state["live"], state["free_blocks"]) == (0, 0, usable)
    assert "multi-modal-worker-0" in result["workers"]
