"""Property: whatever happens to requests between simulated PROMPT and COMPLETION engines (aborts
before, during and after the pull, a prefill engine closed mid-trace, a decode pool too small
for every prompt, hold and transfer timeouts), every KV block, state slot, held transfer and
request record on both sides goes back to its baseline, and each request ends exactly once.

Two PROMPT engines (ranks 0 and 1, each on a bootstrap port it bound itself) and two COMPLETION
engines (one with a pool that fits a single prompt) are built once and reused by every example,
with the real transfer library between them on loopback: a leak in one example shows up in the
next one's baseline as well. The roles' clock is a fake one the trace advances, so hold and transfer
timeouts happen without waiting for them; pulls run in real threads of their own.
"""

from __future__ import annotations

import itertools
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer import connector
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated import disaggregation
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.ipc.messages import Finish, RequestDelta
from tests.lanes import require_disaggregation

from .test_simulated_disaggregation import add, make, role_settings

require_disaggregation()
pytestmark = pytest.mark.disaggregation

HOLD_TIMEOUT = 20.0
TRANSFER_TIMEOUT = 8.0
#: Real seconds the drain at the end of a trace may take (pulls and releases run in threads).
DRAIN_SECONDS = 20.0


def prompt_of(words: int) -> list[int]:
    """BOS <｜User｜> "Hello" x words <｜Assistant｜> </think>."""
    return [0, 128803, *([19923] * words), 128804, 128822]


class FakeClock:
    """The roles' `time.monotonic`, advanced by the trace."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class Side:
    """One engine, its driver, and the baseline it must return to."""

    engine: LLMEngine
    driver: LLMEngineDriver
    free_blocks: int = 0
    free_slots: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        self.free_blocks, self.free_slots = self.room()

    def room(self) -> tuple[int, int]:
        # The state pool has no public read-out on the engine; the KV pool's is DeepInfer's.
        slots = self.engine._cache.slots.free_count
        return self.engine.scheduler.get_num_free_gpu_blocks(), slots


@dataclass
class Request:
    """What the trace did with one request, and every end each side reported for it."""

    request_id: str
    prompt: list[int]
    prefill: int
    max_tokens: int
    handoff: KVTransferParams | None = None
    decode: int | None = None
    prefill_ends: list[RequestDelta] = field(default_factory=list)
    decode_ends: list[RequestDelta] = field(default_factory=list)
    prefill_aborted: bool = False
    decode_aborted: bool = False
    decode_tokens: int = 0


class Cluster:
    """Two PROMPT ranks of one server and two COMPLETION engines."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        fake_time = types.SimpleNamespace(monotonic=self.clock.monotonic)
        # The roles' own timing, and their connectors' (holds and their expiry).
        self._patches = [
            mock.patch.object(module, "time", fake_time) for module in (disaggregation, connector)
        ]
        for patch in self._patches:
            patch.start()
        self._ids = itertools.count()
        self.prefills = [self._prefill(rank) for rank in range(2)]
        self.decodes = [
            self._decode(max_num_seqs=4, kv_blocks=None),
            # Room for one three-block prompt at a time: requests wait for KV room.
            self._decode(max_num_seqs=2, kv_blocks=5),
        ]
        self.requests: dict[str, Request] = {}

    def _prefill(self, rank: int) -> Side:
        engine, driver = make(
            "prefill",
            engine_rank=rank,
            # Port 0: each rank binds a port of its own and names it in its handoffs.
            role=role_settings(bootstrap_port=0, rank=rank, hold_timeout=HOLD_TIMEOUT),
            max_num_seqs=3,
        )
        return Side(engine, driver)

    def _decode(self, max_num_seqs: int, kv_blocks: int | None) -> Side:
        engine, driver = make(
            "decode",
            max_num_seqs=max_num_seqs,
            kv_blocks=kv_blocks,
            role=role_settings(transfer_timeout=TRANSFER_TIMEOUT),
        )
        return Side(engine, driver)

    def close(self) -> None:
        for side in [*self.prefills, *self.decodes]:
            if not side.closed:
                side.driver.close()
        for patch in self._patches:
            patch.stop()

    # Trace actions

    def new(self, prefill: int, words: int, max_tokens: int) -> None:
        side = self.prefills[prefill]
        if side.closed:
            return
        request = Request(f"r{next(self._ids)}", prompt_of(words), prefill, max_tokens)
        self.requests[request.request_id] = request
        add(side.driver, request.request_id, request.prompt, max_tokens=1)

    def step_prefill(self, prefill: int) -> None:
        side = self.prefills[prefill]
        for _ in range(2):  # the prompt step's token leaves with the next iteration
            if not side.closed:
                self._record(side, side.driver.iterate()[1], decode=False)

    def step_decode(self, decode: int) -> None:
        self._record(self.decodes[decode], self.decodes[decode].driver.iterate()[1], decode=True)

    def settle_decode(self, decode: int) -> None:
        """Step a decode engine until none of its pulls is in flight (the pulled requests
        start decoding; the others still wait for KV room)."""
        side = self.decodes[decode]
        role = side.engine._decode
        assert role is not None
        deadline = time.monotonic() + DRAIN_SECONDS
        while any(p.pulling for p in role._pending.values()):
            assert time.monotonic() < deadline, "a pull never returned"
            self._record(side, side.driver.iterate()[1], decode=True)
        self.step_decode(decode)

    def hand_off(self, index: int, decode: int) -> None:
        """The router sends a prefilled request to a decode engine."""
        request = self._pick(index, lambda r: r.handoff is not None and r.decode is None)
        if request is None:  # the router waits for a prefill to answer
            for prefill in range(len(self.prefills)):
                self.step_prefill(prefill)
            request = self._pick(index, lambda r: r.handoff is not None and r.decode is None)
        if request is None:
            return
        request.decode = decode
        add(
            self.decodes[decode].driver,
            request.request_id,
            request.prompt,
            request.handoff,
            max_tokens=request.max_tokens,
        )

    def abort_prefill(self, index: int) -> None:
        request = self._pick(index, lambda r: not r.prefill_ends and not r.prefill_aborted)
        if request is not None and not self.prefills[request.prefill].closed:
            request.prefill_aborted = True
            self.prefills[request.prefill].driver.abort([request.request_id])

    def abort_decode(self, index: int) -> None:
        request = self._pick(
            index, lambda r: r.decode is not None and not r.decode_ends and not r.decode_aborted
        )
        if request is not None:
            assert request.decode is not None
            request.decode_aborted = True
            self.decodes[request.decode].driver.abort([request.request_id])

    def close_prefill(self, prefill: int) -> None:
        """The prefill server dies: its bootstrap port and registered memory go away."""
        side = self.prefills[prefill]
        if not side.closed:
            side.driver.close()
            side.closed = True

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    # The end of a trace

    def drain(self) -> None:
        """Step every engine until idle, then let every hold time out or be released."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while True:
            busy = progress = False
            for side in self.prefills:
                if not side.closed:
                    unfinished, outputs = side.driver.iterate()
                    self._record(side, outputs, decode=False)
                    busy |= unfinished
                    progress |= bool(outputs)
            for side in self.decodes:
                unfinished, outputs = side.driver.iterate()
                self._record(side, outputs, decode=True)
                busy |= unfinished
                progress |= bool(outputs)
            held = sum(s.engine.held_kv() for s in self.prefills if not s.closed)
            if not busy and not progress and not held:
                return
            if not progress:
                # Holds nobody will pull pin state slots prompts wait for: time goes on.
                self.clock.now += 1.0
            assert time.monotonic() < deadline, f"the engines never went idle: {self.describe()}"

    def describe(self) -> str:
        """Each engine's requests, for a failure's message."""
        lines = []
        for name, side in [
            *(("prefill", s) for s in self.prefills),
            *(("decode", s) for s in self.decodes),
        ]:
            if side.closed:
                continue
            table = side.engine._table
            pending = getattr(side.engine._decode, "_pending", {})
            lines.append(
                f"{name}: waiting {[s.request_id for s in table.waiting]} running "
                f"{[(s.request_id, len(s.output)) for s in table.running]} pending "
                f"{[(k, p.pulling, p.abandoned) for k, p in pending.items()]} "
                f"held {side.engine.held_kv()} room {side.room()} "
                f"of {(side.free_blocks, side.free_slots)}"
            )
        return "; ".join(lines)

    def check_baseline(self) -> None:
        for side in [*self.prefills, *self.decodes]:
            if side.closed:
                continue  # its process is gone, and its memory with it
            assert side.room() == (side.free_blocks, side.free_slots)
            assert side.engine.get_num_unfinished_requests() == 0
            assert side.driver.num_live == 0
            assert not side.engine._kv._tables  # no owner keeps a block table
        for side in self.prefills:
            if side.closed:
                continue
            assert side.engine.held_kv() == 0
            assert side.engine._prefill is not None
            assert not side.engine._prefill.handoffs  # each one was reported
        for side in self.decodes:
            assert side.engine._decode is not None
            assert not side.engine._decode.busy  # no pull, not even abandoned

    def check_ends(self) -> None:
        for request in self.requests.values():
            killed = self.prefills[request.prefill].closed
            assert len(request.prefill_ends) <= 1, request
            if not request.prefill_aborted and not killed:
                assert len(request.prefill_ends) == 1, request
            if request.prefill_ends:
                end = request.prefill_ends[0]
                assert end.finish is Finish.LENGTH
                assert (end.kv_transfer_params is not None) is True
            assert len(request.decode_ends) <= 1, request
            if request.decode is not None and not request.decode_aborted:
                assert len(request.decode_ends) == 1, request
                end = request.decode_ends[0]
                if end.finish is Finish.KV_TRANSFER_FAILED:
                    assert end.detail, request
                    assert request.decode_tokens == 0
                elif end.finish is Finish.OUT_OF_RESOURCES:
                    # The small pool ran out of blocks mid-decode: a COMPLETION engine stops
                    # a preempted sequence (it cannot prefill it again).
                    assert request.decode_tokens < request.max_tokens, request
                else:
                    # A NORMAL engine answers a short prompt with fewer than max_tokens too.
                    said = (end.finish, end.detail, request.decode_tokens, request.max_tokens)
                    assert end.finish is Finish.LENGTH, said
                    assert 1 <= request.decode_tokens <= request.max_tokens, said

    def reopen_closed(self) -> None:
        """A new prefill server in place of a closed one, for the next example."""
        for rank, side in enumerate(self.prefills):
            if side.closed:
                self.prefills[rank] = self._prefill(rank)

    def _record(self, side: Side, deltas: list[RequestDelta], *, decode: bool) -> None:
        for delta in deltas:
            request = self.requests[delta.request_id]
            if decode:
                request.decode_tokens += len(delta.tokens.token_ids)
            if delta.finish is None:
                continue
            if decode:
                request.decode_ends.append(delta)
            else:
                request.prefill_ends.append(delta)
                request.handoff = delta.kv_transfer_params

    def _pick(self, index: int, wanted: object) -> Request | None:
        candidates = [r for r in self.requests.values() if wanted(r)]  # type: ignore[operator]
        return candidates[index % len(candidates)] if candidates else None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    built = Cluster()
    yield built
    built.close()


NEW = st.tuples(st.just("new"), st.integers(0, 1), st.integers(1, 300), st.integers(1, 4))
STEP_PREFILL = st.tuples(st.just("step_prefill"), st.integers(0, 1))
HAND_OFF = st.tuples(st.just("hand_off"), st.integers(0, 7), st.integers(0, 1))
#: Each kind once, the ones that move requests forward more often.
ACTIONS = st.one_of(
    NEW,
    NEW,
    STEP_PREFILL,
    STEP_PREFILL,
    HAND_OFF,
    HAND_OFF,
    st.tuples(st.just("step_decode"), st.integers(0, 1)),
    st.tuples(st.just("settle_decode"), st.integers(0, 1)),
    st.tuples(st.just("abort_prefill"), st.integers(0, 7)),
    st.tuples(st.just("abort_decode"), st.integers(0, 7)),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 5.0, 9.0, 25.0])),
)
#: Where in the trace a prefill engine closes (each close costs a new engine: not every trace).
CLOSE = st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(0, 1)))


@settings(
    max_examples=15,
    deadline=None,
    # Examples share the engines: after a failure the next ones start dirty, so shrinking
    # would chase the first failure's leftovers.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(trace=st.lists(ACTIONS, min_size=10, max_size=40), close=CLOSE)
def test_every_trace_returns_both_sides_to_their_baseline(
    cluster: Cluster, trace: list[tuple[object, ...]], close: tuple[int, int] | None
) -> None:
    cluster.requests = {}
    if close is not None:
        trace.insert(close[0], ("close_prefill", close[1]))
    try:
        for name, *arguments in trace:
            getattr(cluster, str(name))(*arguments)
        cluster.drain()
        cluster.check_baseline()
        cluster.check_ends()
        for request in cluster.requests.values():
            for end in request.decode_ends:
                event(f"decode end: {end.finish} {end.detail or ''}".strip())
            if request.decode_aborted:
                event("decode abort, " + ("decoding" if request.decode_tokens else "not decoding"))
    finally:
        cluster.reopen_closed()


#: Where a request's client goes away: never, before its prefill step, after the handoff but
#: before the decode engine steps, while its pull runs, or once it decodes.
ABORTS = [None, "prefill", "before_pull", "during_pull", "decoding"]
PLAN = st.tuples(
    st.integers(0, 1),  # prefill rank
    st.integers(1, 300),  # prompt words
    st.integers(1, 40),  # max tokens
    st.integers(0, 1),  # decode engine
    st.sampled_from(ABORTS),
)


@settings(
    max_examples=15,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plans=st.lists(PLAN, min_size=1, max_size=8),
    close=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 1))),
    late=st.sampled_from([0.0, 5.0, 9.0, 25.0]),
)
def test_every_request_plan_returns_both_sides_to_their_baseline(
    cluster: Cluster,
    plans: list[tuple[int, int, int, int, str | None]],
    close: tuple[int, int] | None,
    late: float,
) -> None:
    """Each request goes through prefill, handoff, pull and decode, its client leaving at the
    phase its plan says; a prefill engine may close between phases and the clock may jump
    past the transfer or hold timeout while pulls are in flight."""
    cluster.requests = {}

    def phase(number: int) -> None:
        if close is not None and close[0] == number:
            cluster.close_prefill(close[1])

    def abort(where: str, decode: bool) -> None:
        for request, plan in zip(cluster.requests.values(), plans, strict=True):
            if plan[4] != where:
                continue
            if decode and request.decode is not None and not request.decode_ends:
                request.decode_aborted = True
                cluster.decodes[request.decode].driver.abort([request.request_id])
            elif not decode and not request.prefill_ends:
                request.prefill_aborted = True
                cluster.prefills[request.prefill].driver.abort([request.request_id])

    try:
        for prefill, words, max_tokens, _, _ in plans:
            cluster.new(prefill, words, max_tokens)
        if len(cluster.requests) < len(plans):
            return  # a plan on a closed engine: nothing to follow
        abort("prefill", decode=False)
        phase(0)
        for _ in range(2):
            for rank in range(2):
                cluster.step_prefill(rank)
        phase(1)
        for request, plan in zip(cluster.requests.values(), plans, strict=True):
            if request.handoff is not None:
                request.decode = plan[3]
                add(
                    cluster.decodes[plan[3]].driver,
                    request.request_id,
                    request.prompt,
                    request.handoff,
                    max_tokens=request.max_tokens,
                )
        abort("before_pull", decode=True)
        phase(2)
        for decode in range(2):
            cluster.step_decode(decode)
        abort("during_pull", decode=True)
        cluster.advance(late)
        phase(3)
        for decode in range(2):
            cluster.settle_decode(decode)
        abort("decoding", decode=True)
        phase(4)
        cluster.drain()
        cluster.check_baseline()
        cluster.check_ends()
        for request, plan in zip(cluster.requests.values(), plans, strict=True):
            for end in request.decode_ends:
                event(f"plan {plan[4]}: {end.finish} {end.detail or ''}".strip())
            if request.decode_aborted:
                event(
                    f"plan {plan[4]}: aborted " + ("decoding" if request.decode_tokens else "early")
                )
    finally:
        cluster.reopen_closed()
