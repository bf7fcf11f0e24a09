"""Coordinator.submit frees what it took on every exit: a failure between
admission and the request's end must not keep an admission slot for ever.

A property test drives a real Coordinator (real admission, real RankChannels whose ranks have
not connected, so every message waits in memory) through sequences of submits, each with a
failure injected at one step of starting the request or none, and of the ways a request ends.
After every operation the admission slots per rank equal the requests in flight per rank; at
the end, once every request is closed, slots, handles and the load gauges are all zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_server.cli import parse_config
from deepinfer_server.config.tenants import Tenant
from deepinfer_server.coordinator import coordinator as coordinator_module
from deepinfer_server.coordinator.admission import Admission, Ticket
from deepinfer_server.coordinator.channels import RankChannels, bind_rank_listener
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.prefix_routing import RankHint
from deepinfer_server.errors import ApiError, OverloadedError, RequestTimeoutError
from deepinfer_server.ipc.messages import AbortReason, Finish, GeneratedTokens, SamplingOptions
from deepinfer_server.metrics import ServerMetrics

#: Where a submit can fail: taking the slot, making the handle, encoding the request (a token
#: ID beyond int32, as a client could send), handing it to the rank's link, and logging it.
FAULTS = ("admit", "handle", "encode", "send", "log")
DP = 2
CAPACITY = 4
#: Two keys: requests alternate between them.
TENANTS = (Tenant("a"), Tenant("b"))


class InjectedFault(Exception):
    """The failure a test injects."""


class _Faults:
    """Which step of the next submit fails (None: none)."""

    def __init__(self) -> None:
        self.at: str | None = None

    def check(self, step: str) -> None:
        if self.at == step:
            raise InjectedFault(step)


class _FaultyAdmission(Admission):
    def __init__(self, faults: _Faults, max_num_seqs: int | None) -> None:
        super().__init__(DP, CAPACITY, max_num_seqs=max_num_seqs, tenants=TENANTS)
        self._faults = faults

    def admit(self, tenant: int = 0, priority: int = 0, hint: RankHint | None = None) -> Ticket:
        self._faults.check("admit")
        return super().admit(tenant, priority, hint)


class _FaultyChannels(RankChannels):
    def __init__(self, path: str, faults: _Faults) -> None:
        super().__init__(bind_rank_listener(path), DP)
        self._faults = faults

    def send_framed_add(self, rank: int, framed: bytes) -> None:
        self._faults.check("send")
        super().send_framed_add(rank, framed)


class _FaultyLogger(logging.LoggerAdapter[logging.Logger]):
    def __init__(self, faults: _Faults) -> None:
        super().__init__(logging.getLogger("test"))
        self._faults = faults

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self._faults.check("log")


@pytest.fixture(scope="module")
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sock")


@pytest.fixture(scope="module")
def faults() -> Iterator[_Faults]:
    """The injected faults, wired into the coordinator module's handle and logger."""
    faults = _Faults()
    real_handle, real_logger = coordinator_module.RequestHandle, coordinator_module.logger

    def handle(*args: Any, **kwargs: Any) -> RequestHandle:
        faults.check("handle")
        return real_handle(*args, **kwargs)

    coordinator_module.RequestHandle = handle  # type: ignore[misc,assignment]
    coordinator_module.logger = _FaultyLogger(faults)  # type: ignore[assignment]
    try:
        yield faults
    finally:
        coordinator_module.RequestHandle = real_handle  # type: ignore[misc]
        coordinator_module.logger = real_logger


def _gauges(metrics: ServerMetrics) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith(("num_requests_running", "num_requests_waiting")):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _check_slots_match_handles(coordinator: Coordinator, admission: Admission) -> None:
    per_rank = [0] * DP
    for load in coordinator.rank_loads():
        per_rank[load.rank] = load.running + load.waiting
    in_flight = [0] * DP
    for handle in coordinator._handles.values():
        if handle.rank is not None:
            in_flight[handle.rank] += 1
    assert admission.in_flight == in_flight, (admission.in_flight, in_flight)
    assert all(count >= 0 for count in admission.in_flight)
    assert admission.total == coordinator.num_in_flight
    running = sum(running for _, running, _ in admission.tenant_counts())
    assert running == sum(in_flight)
    assert sum(per_rank) <= coordinator.num_in_flight


#: How a live request ends: the client leaves, the engine finishes it, it fails (engine error
#: or timeout), or it gets its first token and then the client leaves.
ENDINGS = ("close", "finish", "fail", "token_then_close", "keep")

operations = st.lists(
    st.tuples(st.sampled_from((None, *FAULTS)), st.sampled_from(ENDINGS)),
    min_size=1,
    max_size=12,
)


async def _drive(
    ops: list[tuple[str | None, str]],
    faults: _Faults,
    socket_path: str,
    max_num_seqs: int | None,
) -> None:
    admission = _FaultyAdmission(faults, max_num_seqs)
    channels = _FaultyChannels(socket_path, faults)
    metrics = ServerMetrics("m")
    config = parse_config(["--engine", "simulated", "--data-parallel-size", str(DP)])
    coordinator = Coordinator(config, channels, metrics, admission=admission)
    kept: list[RequestHandle] = []
    try:
        for number, (fault, ending) in enumerate(ops):
            faults.at = fault
            prompt = [2**31] if fault == "encode" else [1, 2, 3]
            try:
                handle = coordinator.submit(
                    f"r{number}", prompt, SamplingOptions(4), None, tenant=number % 2
                )
            except (InjectedFault, OverflowError, OverloadedError):
                faults.at = None
                assert fault is not None or admission.total >= CAPACITY
                _check_slots_match_handles(coordinator, admission)
                continue
            # A queued request is sent later: a fault in sending it stays armed while this
            # request ends, which may start it or another queued one.
            queued = handle.rank is None and fault in ("send", "log")
            assert fault is None or queued, f"submit did not fail at {fault}"
            try:
                _end(handle, ending, kept)
            finally:
                faults.at = None
            _check_slots_match_handles(coordinator, admission)
        for handle in kept:
            handle.close(AbortReason.DISCONNECT)
        assert admission.total == 0
        assert coordinator.num_in_flight == 0
        assert await coordinator.wait_idle(1.0)
        assert all(value == 0 for value in _gauges(metrics).values()), _gauges(metrics)
    finally:
        channels.close()


def _end(handle: RequestHandle, ending: str, kept: list[RequestHandle]) -> None:
    if ending == "close":
        handle.close(AbortReason.DISCONNECT)
    elif ending == "finish":
        handle.deliver(GeneratedTokens([5]), Finish.STOP, 0.0, 0.0)
        handle.close(AbortReason.STOP)
    elif ending == "fail":
        error: ApiError = RequestTimeoutError("timed out")
        handle.fail(error)
        handle.close(AbortReason.TIMEOUT)
    elif ending == "token_then_close":
        handle.deliver(GeneratedTokens([5]), None, 0.0, 0.0)
        kept.append(handle)
    else:
        kept.append(handle)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations, max_num_seqs=st.sampled_from([None, 1]))
def test_submit_frees_what_it_took_on_every_exit(
    ops: list[tuple[str | None, str]], max_num_seqs: int | None, faults: _Faults, socket_dir: Path
) -> None:
    """With one running slot per rank, requests also wait in the server's queue and start as
    others end: the same accounting holds whether a request ends queued or started."""
    asyncio.run(_drive(ops, faults, str(socket_dir / "ranks.sock"), max_num_seqs))


@pytest.mark.parametrize("token_id", [2**31, 2**32, -(2**31) - 1])
def test_a_token_id_beyond_int32_frees_its_slot(token_id: int, socket_dir: Path) -> None:
    """The issue's reproduction: the ID cannot be encoded; the request must leave nothing."""

    async def body() -> None:
        admission = Admission(1, 16)
        channels = RankChannels(bind_rank_listener(str(socket_dir / "one.sock")), 1)
        config = parse_config(["--engine", "simulated"])
        coordinator = Coordinator(config, channels, ServerMetrics("m"), admission=admission)
        try:
            for number in range(20):
                with pytest.raises(OverflowError):
                    coordinator.submit(f"r{number}", [token_id], SamplingOptions(1), None)
            assert admission.total == 0
            assert coordinator.num_in_flight == 0
            handle = coordinator.submit("ok", [1], SamplingOptions(1), None)
            handle.close(AbortReason.STOP)
        finally:
            channels.close()

    asyncio.run(body())
