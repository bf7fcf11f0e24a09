"""Fair admission: one API key's flood cannot keep another key's request from starting;
priority orders a key's queued requests; weights, per-key limits and several API processes."""

from __future__ import annotations

import asyncio
import select
from pathlib import Path

import pytest

from deepinfer_server.cli import parse_config
from deepinfer_server.config.tenants import Tenant
from deepinfer_server.coordinator.admission import (
    Admission,
    SharedAdmission,
    Ticket,
    shared_state,
)
from deepinfer_server.coordinator.admission_limits import most_admitted
from deepinfer_server.coordinator.channels import RankChannels, bind_rank_listener
from deepinfer_server.coordinator.coordinator import Coordinator
from deepinfer_server.errors import OverloadedError
from deepinfer_server.ipc.messages import (
    AbortReason,
    Finish,
    GeneratedTokens,
    RequestDelta,
    SamplingOptions,
    StepOutputs,
)
from deepinfer_server.metrics import ServerMetrics
from tests.paths import PD_SECRET_ARGS

HEAVY, LIGHT = 0, 1
TWO = (Tenant("heavy"), Tenant("light"))


def _admit(admission: Admission, tenant: int, count: int = 1, priority: int = 0) -> list[Ticket]:
    tickets = [admission.admit(tenant, priority) for _ in range(count)]
    admission.ready()
    return tickets


def _running(tickets: list[Ticket]) -> int:
    return sum(ticket.rank is not None and not ticket.released for ticket in tickets)


def test_a_flooding_key_leaves_a_slot_for_another_keys_request() -> None:
    admission = Admission(1, 100, max_num_seqs=4, tenants=TWO, running_share=0.75)
    heavy = _admit(admission, HEAVY, 20)
    assert _running(heavy) == 3  # 3 of the 4 slots: floor(4 * 0.75)
    [light] = _admit(admission, LIGHT)
    assert light.rank == 0  # started at once, with 17 of the heavy key's requests queued


def test_without_a_reserve_a_freed_slot_goes_to_the_key_running_fewest() -> None:
    admission = Admission(1, 100, max_num_seqs=4, tenants=TWO, running_share=1.0)
    heavy = _admit(admission, HEAVY, 20)
    assert _running(heavy) == 4  # alone, one key may use every slot
    [light] = _admit(admission, LIGHT)
    assert light.rank is None
    admission.release(heavy[0])
    admission.ready()
    assert light.rank == 0  # before the 16 heavy requests queued ahead of it
    assert _running(heavy) == 3


def test_one_key_alone_uses_every_slot() -> None:
    admission = Admission(2, 100, max_num_seqs=4, tenants=(Tenant("only"),), running_share=0.5)
    assert _running(_admit(admission, 0, 10)) == 8


def test_lower_priority_starts_first_within_a_key_then_arrival() -> None:
    admission = Admission(1, 100, max_num_seqs=1)
    [first] = _admit(admission, 0)
    later = [_admit(admission, 0, priority=p)[0] for p in (5, -3, 0, -3)]
    order = []
    running = first
    for _ in later:
        admission.release(running)
        [running] = admission.ready()
        order.append(later.index(running))
    assert order == [1, 3, 2, 0]  # -3 (earlier), -3, 0, 5


def test_weights_share_the_slots_between_flooding_keys() -> None:
    tenants = (Tenant("big", weight=2.0), Tenant("small"))
    admission = Admission(1, 100, max_num_seqs=6, tenants=tenants, running_share=1.0)
    big = [admission.admit(0) for _ in range(10)]
    small = [admission.admit(1) for _ in range(10)]
    admission.ready()
    assert (_running(big), _running(small)) == (4, 2)


def test_a_keys_own_limits_apply() -> None:
    tenants = (Tenant("capped", max_running=1, max_queued=2), Tenant("other"))
    admission = Admission(1, 100, max_num_seqs=4, tenants=tenants)
    capped = [_admit(admission, 0)[0] for _ in range(3)]
    assert _running(capped) == 1
    with pytest.raises(OverloadedError, match="this API key has 2 requests waiting"):
        admission.admit(0)
    assert _running(_admit(admission, 1, 3)) == 3  # the other key is not refused


def test_a_flooding_key_fills_only_its_share_of_the_queue_and_alone_gets_the_429() -> None:
    # 4 running slots and a queue of 8: the heavy key holds 3 running and 4 waiting at most.
    admission = Admission(1, 12, max_num_seqs=4, tenants=TWO, running_share=0.75, queued_share=0.5)
    heavy = [_admit(admission, HEAVY)[0] for _ in range(7)]
    assert _running(heavy) == 3
    with pytest.raises(OverloadedError) as refused:
        admission.admit(HEAVY)
    message = str(refused.value)
    assert "this API key has 4 requests waiting" in message
    assert "--key-queued-share 0.5 of --max-queued-requests 8" in message
    # The rest of the server's capacity is the light key's: one starts, four wait.
    light = [_admit(admission, LIGHT)[0] for _ in range(5)]
    assert _running(light) == 1
    assert admission.total == 12
    # A heavy request that leaves the queue makes room for exactly one more of the heavy key's.
    admission.release(heavy[-1])
    admission.admit(HEAVY)
    with pytest.raises(OverloadedError, match="--key-queued-share"):
        admission.admit(HEAVY)


def test_one_key_alone_may_fill_the_whole_queue() -> None:
    admission = Admission(1, 12, max_num_seqs=4, tenants=(Tenant("only"),), queued_share=0.5)
    assert _running([_admit(admission, 0)[0] for _ in range(12)]) == 4
    with pytest.raises(OverloadedError, match="the server is at capacity"):
        admission.admit(0)


def test_a_keys_max_queued_overrides_the_share_and_names_itself() -> None:
    tenants = (Tenant("wide", max_queued=6), Tenant("other"))
    admission = Admission(
        1, 20, max_num_seqs=2, tenants=tenants, running_share=0.5, queued_share=0.25
    )
    wide = [_admit(admission, 0)[0] for _ in range(7)]  # 1 running (half of 2), 6 waiting
    assert _running(wide) == 1
    with pytest.raises(OverloadedError, match="6 requests waiting, its max_queued in --api-key"):
        admission.admit(0)
    other = [_admit(admission, 1)[0] for _ in range(5)]  # 1 running, floor(18 * 0.25) waiting
    assert _running(other) == 1
    with pytest.raises(OverloadedError, match="4 requests waiting, its share"):
        admission.admit(1)


def test_the_queue_share_comes_from_the_configuration(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("heavy key-h\nlight key-l\n")
    args = ["--engine", "simulated", "--api-key-file", str(keys)]
    flags = ["--max-num-seqs", "2", "--max-queued-requests", "8", "--key-queued-share", "0.25"]
    admission = Admission.for_config(parse_config([*args, *flags]))
    heavy = [_admit(admission, HEAVY)[0] for _ in range(3)]  # 1 running, 2 waiting
    assert _running(heavy) == 1
    with pytest.raises(OverloadedError, match=r"--key-queued-share 0\.25 of --max-queued-req"):
        admission.admit(HEAVY)
    decode = parse_config([*args, *flags, *PD_SECRET_ARGS, "--disaggregation-mode", "decode"])
    assert decode.admission_queued_share == 1.0  # a decode server queues nothing


def test_the_most_one_request_of_a_key_may_have_admitted(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("plain key-p\ncapped key-c max_running=1 max_queued=2\n")
    flags = ["--max-num-seqs", "4", "--max-queued-requests", "8", "--api-key-file", str(keys)]
    config = parse_config(["--engine", "simulated", *flags])
    assert (most_admitted(config, 0), most_admitted(config, 1)) == (3 + 4, 1 + 2)
    alone = parse_config(["--engine", "simulated", "--max-num-seqs", "4"])
    assert most_admitted(alone, 0) == alone.admission_capacity == 4 + 512


def test_admitted_requests_are_counted_by_priority_until_the_engine_ends_them() -> None:
    admission = Admission(1, 10, max_num_seqs=1)
    low = [_admit(admission, 0, priority=9)[0] for _ in range(3)]
    [other] = _admit(admission, 0)
    assert (admission.admitted_at(9), admission.admitted_at(0)) == (3, 1)
    assert low[0].rank == 0
    admission.finished(low[0])
    admission.release(low[0])  # its stream closes after the engine ended it: counted once
    admission.release(low[1])  # left the queue
    assert (admission.admitted_at(9), admission.admitted_at(0)) == (1, 1)
    admission.release(other)
    assert admission.admitted_at(0) == 0


def test_max_queued_0_admits_only_what_starts_at_once() -> None:
    tenants = (Tenant("never-queued", max_queued=0),)
    admission = Admission(1, 100, max_num_seqs=2, tenants=tenants)
    assert _running([_admit(admission, 0)[0] for _ in range(2)]) == 2
    with pytest.raises(OverloadedError):
        admission.admit(0)


def test_a_freed_slot_wakes_the_process_whose_request_is_due() -> None:
    state = shared_state(1, 2, processes=2)
    here, there = (
        SharedAdmission(1, 100, state, process, max_num_seqs=2, tenants=TWO, running_share=1.0)
        for process in (0, 1)
    )
    heavy = _admit(there, HEAVY, 5)
    assert _running(heavy) == 2
    [light] = _admit(here, LIGHT)
    assert light.rank is None
    reader = state.wake_readers[0]
    assert select.select([reader], [], [], 0)[0] == []
    there.release(heavy[0])
    assert there.ready() == []  # the light key is due, and its request waits in process 0
    assert select.select([reader], [], [], 5)[0] == [reader]
    assert here.ready() == [light]
    assert here.tenant_counts() == [("heavy", 1, 3), ("light", 1, 0)]


def test_a_keys_queue_share_counts_its_requests_in_every_process() -> None:
    state = shared_state(1, 2, processes=2)
    here, there = (
        SharedAdmission(
            1, 8, state, process, max_num_seqs=2, tenants=TWO, running_share=0.5, queued_share=0.5
        )
        for process in (0, 1)
    )
    # 1 running; the queue of 6 allows the heavy key 3 waiting, wherever they wait.
    heavy = [_admit(process, HEAVY)[0] for process in (here, there, here, there)]
    assert _running(heavy) == 1
    with pytest.raises(OverloadedError, match="this API key has 3 requests waiting"):
        here.admit(HEAVY)
    with pytest.raises(OverloadedError, match="this API key has 3 requests waiting"):
        there.admit(HEAVY)
    assert _running([_admit(there, LIGHT)[0]]) == 1


def test_a_heavy_keys_streams_cannot_keep_a_light_keys_request_from_starting(
    tmp_path: Path,
) -> None:
    """Through the real Coordinator: requests are sent to a rank only when their turn comes,
    and the per-tenant gauges and admission counters say which key."""
    keys = tmp_path / "keys"
    keys.write_text("heavy key-h\nlight key-l\n")
    config = parse_config(
        ["--engine", "simulated", "--max-num-seqs", "4", "--api-key-file", str(keys)]
    )

    async def body() -> None:
        channels = RankChannels(bind_rank_listener(str(tmp_path / "r.sock")), 1)
        metrics = ServerMetrics("m")
        coordinator = Coordinator(config, channels, metrics)
        try:
            heavy = [
                coordinator.submit(f"h{i}", [1, 2], SamplingOptions(4), None, tenant=HEAVY)
                for i in range(12)
            ]
            assert sum(h.rank is not None for h in heavy) == 3
            light = coordinator.submit("l", [1, 2], SamplingOptions(4), None, tenant=LIGHT)
            assert light.rank == 0
            text = metrics.exposition().decode()
            assert 'deepinfer:tenant_requests_queued{model_name="m",tenant="heavy"} 9.0' in text
            assert 'deepinfer:tenant_requests_running{model_name="m",tenant="light"} 1.0' in text
            admitted = 'admissions_total{model_name="m",result="admitted",tenant="light"} 1.0'
            assert admitted in text
            assert "key-h" not in text and "key-l" not in text
            # A queued request that leaves frees its place without reaching the rank.
            heavy[-1].close(AbortReason.DISCONNECT)
            heavy[0].close(AbortReason.STOP)
            assert heavy[3].rank == 0  # the next heavy one, in arrival order
            for handle in [*heavy, light]:
                handle.close(AbortReason.DISCONNECT)
            assert coordinator.admitted == 0
        finally:
            channels.close()

    asyncio.run(body())


def test_a_request_the_engine_ended_frees_its_running_slot_before_its_stream_closes(
    tmp_path: Path,
) -> None:
    config = parse_config(["--engine", "simulated", "--max-num-seqs", "1"])

    async def body() -> None:
        channels = RankChannels(bind_rank_listener(str(tmp_path / "r.sock")), 1)
        coordinator = Coordinator(config, channels, ServerMetrics("m"))
        try:
            first = coordinator.submit("a", [1, 2], SamplingOptions(4), None)
            second = coordinator.submit("b", [1, 2], SamplingOptions(4), None)
            assert (first.rank, second.rank) == (0, None)
            done = RequestDelta("a", GeneratedTokens([5]), Finish.STOP, cached_tokens=0)
            coordinator._on_messages([StepOutputs(0, [done], 0.01)])
            assert first.ended and coordinator.num_in_flight == 2  # its stream is still open
            assert second.rank == 0
            assert coordinator.admitted == 1
            first.close(AbortReason.STOP)
            second.close(AbortReason.DISCONNECT)
            assert coordinator.admitted == 0
        finally:
            channels.close()

    asyncio.run(body())


def test_a_decode_servers_requests_reach_their_rank_at_once(tmp_path: Path) -> None:
    """On a decode server each request carries KV its prefill server holds only for a while
    (and releases only when the engine has the request), so none waits in the server's queue:
    past --max-num-seqs and past a key's share they still go to the rank, whose engine waits
    for KV room in order within the transfer timeout."""
    keys = tmp_path / "keys"
    keys.write_text("heavy key-h\nlight key-l\n")
    config = parse_config(
        [
            "--engine",
            "simulated",
            "--max-num-seqs",
            "2",
            "--api-key-file",
            str(keys),
            *PD_SECRET_ARGS,
            "--disaggregation-mode",
            "decode",
        ]
    )

    async def body() -> None:
        channels = RankChannels(bind_rank_listener(str(tmp_path / "r.sock")), 1)
        coordinator = Coordinator(config, channels, ServerMetrics("m"))
        try:
            heavy = [
                coordinator.submit(f"h{i}", [1, 2], SamplingOptions(4), None, tenant=HEAVY)
                for i in range(6)
            ]
            assert all(handle.rank == 0 for handle in heavy)
            for handle in heavy:
                handle.close(AbortReason.DISCONNECT)
            assert coordinator.admitted == 0
        finally:
            channels.close()

    asyncio.run(body())
