"""A decode engine with two prefill peers, one of them hung: the real transfer library between
them, its reads from the hung peer held back until the test lets them go."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from deepinfer_server.disaggregation.transfer.agent import LIBRARY_TRANSFER_TIMEOUT, TransferAgent
from deepinfer_server.disaggregation.transfer.lanes import PULL_THREADS_PER_PEER
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.ipc.messages import Finish, RequestDelta
from deepinfer_server.model.kv_block import blocks_for
from tests.lanes import require_disaggregation
from tests.unit.engines.test_simulated_disaggregation import (
    PROMPT,
    add,
    handoff_of,
    make,
    role_settings,
    wait_released,
)

require_disaggregation()
pytestmark = pytest.mark.disaggregation

#: Long enough for the healthy peer's pull on a loaded machine, short for the test's length.
TRANSFER_TIMEOUT = 3.0

Engine = tuple[LLMEngine, LLMEngineDriver]
Deltas = dict[str, list[RequestDelta]]


class HeldReads:
    """Reads from `peer` wait until `go` is set, then run as the library would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.peer = ""
        self.go = threading.Event()
        real = TransferAgent.read

        def read(agent: TransferAgent, session: str, pieces: Sequence[tuple[int, int, int]]) -> int:
            if session == self.peer:
                assert self.go.wait(60), "the test never let the hung peer's reads go"
            return real(agent, session, pieces)

        monkeypatch.setattr(TransferAgent, "read", read)


@pytest.fixture
def held_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldReads]:
    reads = HeldReads(monkeypatch)
    yield reads
    reads.go.set()


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine, Engine]]:
    """The hung peer, the healthy peer and the decode engine."""
    # Room (state slots, the running cap) for more pulls than a peer has threads.
    seqs = 2 * PULL_THREADS_PER_PEER
    made = [make("prefill", max_num_seqs=seqs), make("prefill", max_num_seqs=seqs)]
    role = role_settings(transfer_timeout=TRANSFER_TIMEOUT)
    made.append(make("decode", max_num_seqs=seqs, role=role))
    yield made[0], made[1], made[2]
    for _, driver in made:
        driver.close()


def iterate_until(
    driver: LLMEngineDriver,
    done: Callable[[Deltas], bool],
    seconds: float,
    seen: Deltas | None = None,
) -> Deltas:
    """Iterate (bounded in time) until `done` holds of the deltas seen (`seen`'s included)."""
    deltas: Deltas = {} if seen is None else seen
    deadline = time.monotonic() + seconds
    while not done(deltas):
        assert time.monotonic() < deadline, f"never happened; seen: {sorted(deltas)}"
        for delta in driver.iterate()[1]:
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def finished(*request_ids: str) -> Callable[[Deltas], bool]:
    return lambda deltas: all(
        deltas.get(rid) and deltas[rid][-1].finish is not None for rid in request_ids
    )


def test_a_hung_prefill_peer_fails_only_its_own_requests_and_its_blocks_come_back(
    engines: tuple[Engine, Engine, Engine], held_reads: HeldReads
) -> None:
    hung, well, (decode_engine, decode_driver) = engines
    stuck = [handoff_of(hung, f"p{index}") for index in range(PULL_THREADS_PER_PEER + 1)]
    held_reads.peer = f"{stuck[0].remote_host}:{stuck[0].remote_port}"
    free = decode_engine.scheduler.get_num_free_gpu_blocks()
    hung_ids = [f"h{index}" for index in range(len(stuck))]
    for request_id, params in zip(hung_ids, stuck, strict=True):
        add(decode_driver, request_id, PROMPT, params)
    add(decode_driver, "w", PROMPT, handoff_of(well, "p"))

    deltas = iterate_until(decode_driver, finished("w"), TRANSFER_TIMEOUT)
    assert deltas["w"][-1].finish is Finish.LENGTH  # pulled and decoded past the hung peer

    # A hung request may have timed out while the healthy one was still pulling: keep its end.
    deltas = iterate_until(decode_driver, finished(*hung_ids), 4 * TRANSFER_TIMEOUT, deltas)
    details = {rid: (deltas[rid][-1].finish, deltas[rid][-1].detail) for rid in hung_ids}
    for request_id in hung_ids[:PULL_THREADS_PER_PEER]:
        assert details[request_id] == (Finish.KV_TRANSFER_FAILED, "timeout")
    assert details[hung_ids[-1]][1] in {"timeout", "peer_unhealthy"}  # queued behind them
    # Only the started pulls' blocks stay reserved, until their reads return. A pull failed
    # while still queued frees its blocks when the engine takes its result: at its next step.
    reserved = PULL_THREADS_PER_PEER * blocks_for(len(PROMPT) + 1)
    decode_driver.iterate()
    assert decode_engine.scheduler.get_num_free_gpu_blocks() == free - reserved

    add(decode_driver, "again", PROMPT, stuck[0])
    deltas = iterate_until(decode_driver, finished("again"), TRANSFER_TIMEOUT)
    assert deltas["again"][-1].detail == "peer_unhealthy"  # at once, not after the timeout

    held_reads.go.set()
    deadline = time.monotonic() + 10
    while decode_engine.scheduler.get_num_free_gpu_blocks() != free:
        assert time.monotonic() < deadline, "the quarantined blocks never came back"
        decode_driver.iterate()
    wait_released(*hung)
    assert decode_engine.get_num_unfinished_requests() == 0
    failures = decode_engine.kv_transfer_stats().failures  # type: ignore[union-attr]
    assert failures["timeout"] >= PULL_THREADS_PER_PEER and failures["peer_unhealthy"] >= 1


def test_the_transfer_library_never_gives_up_on_a_read_by_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A read the library timed out would return while its socket still writes into the blocks.
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    TransferAgent("127.0.0.1")
    assert os.environ["MC_TRANSFER_TIMEOUT"] == LIBRARY_TRANSFER_TIMEOUT
    assert int(LIBRARY_TRANSFER_TIMEOUT) > 10 * 365 * 86400
