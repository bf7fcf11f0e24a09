"""The KV transport (`--disaggregation-transport`): its choice from the request, the RDMA
devices, the Mooncake build's NVLink transports (a fake probe) and where the KV lives; the
environment that makes Mooncake install it; the installed non-CUDA wheel's refusal of nvlink;
and the pairing rule (one transport per pair, the same node over NVLink)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from importlib import metadata

import msgspec
import pytest

from deepinfer_server.disaggregation.handoff.peers import PrefillPeers
from deepinfer_server.disaggregation.layout import (
    COMPARED_FIELDS,
    layout_mismatch,
    node_identity,
    parse_layout,
)
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.disaggregation.transfer.bootstrap import BootstrapServer
from deepinfer_server.disaggregation.transfer.transports import (
    Capabilities,
    TransportUnavailable,
    choose_transport,
    probe_capabilities,
    transport_environment,
)
from tests.lanes import require_disaggregation
from tests.unit.engines.test_kv_layout import LAYOUT, PROBE, handoff_from

NONE = Capabilities()
INTRA = Capabilities(intra_nvlink=True)
MNNVL = Capabilities(mnnvl=True)


@pytest.mark.parametrize(
    ("ib_device", "capabilities", "device_memory", "transport", "environment"),
    [
        ("mlx5_0", INTRA, True, "rdma", {"MC_FORCE_HCA": "1"}),
        (None, INTRA, True, "nvlink", {"MC_INTRANODE_NVLINK": "1"}),
        (None, MNNVL, True, "nvlink", {"MC_FORCE_MNNVL": "1", "MC_USE_NVLINK_IPC": "1"}),
        (None, INTRA, False, "tcp", {"MC_FORCE_TCP": "1"}),
        (None, NONE, True, "tcp", {"MC_FORCE_TCP": "1"}),
    ],
)
def test_auto_takes_rdma_with_devices_else_nvlink_when_built_for_gpu_memory_else_tcp(
    ib_device: str | None,
    capabilities: Capabilities,
    device_memory: bool,
    transport: str,
    environment: dict[str, str],
) -> None:
    plan = choose_transport("auto", ib_device, capabilities, device_memory)
    assert (plan.transport, dict(plan.environment)) == (transport, environment)
    assert plan.reason.startswith("auto: ")


def test_an_asked_transport_is_taken_when_it_can_run() -> None:
    assert choose_transport("tcp", "mlx5_0", INTRA, True).transport == "tcp"
    assert choose_transport("rdma", "mlx5_0", INTRA, True).transport == "rdma"
    nvlink = choose_transport("nvlink", "mlx5_0", INTRA, True)
    assert (nvlink.transport, nvlink.protocol) == ("nvlink", "nvlink_intra")
    assert choose_transport("nvlink", None, MNNVL, True).protocol == "nvlink"


def test_an_asked_transport_that_cannot_run_is_refused_saying_why() -> None:
    with pytest.raises(TransportUnavailable, match="has no NVLink transport"):
        choose_transport("nvlink", None, NONE, True)
    with pytest.raises(TransportUnavailable, match="KV in host memory"):
        choose_transport("nvlink", None, INTRA, False)
    with pytest.raises(TransportUnavailable, match="needs --disaggregation-ib-device"):
        choose_transport("rdma", None, INTRA, True)


@pytest.fixture
def operator_forces_tcp() -> Iterator[None]:
    """An operator's own MC_FORCE_TCP, which would make Mooncake ignore every other choice."""
    before = os.environ.get("MC_FORCE_TCP")
    os.environ["MC_FORCE_TCP"] = "yes"
    yield
    if before is None:
        os.environ.pop("MC_FORCE_TCP", None)
    else:
        os.environ["MC_FORCE_TCP"] = before


@pytest.mark.usefixtures("operator_forces_tcp")
def test_the_choice_is_the_only_mooncake_choice_in_force_while_the_engine_starts() -> None:
    plan = choose_transport("nvlink", None, INTRA, True)
    with transport_environment(plan):
        assert os.environ.get("MC_INTRANODE_NVLINK") == "1"
        assert "MC_FORCE_TCP" not in os.environ
    assert os.environ["MC_FORCE_TCP"] == "yes"
    assert "MC_INTRANODE_NVLINK" not in os.environ


NVLINK = msgspec.structs.replace(LAYOUT, transport="nvlink", node="node-a")


def test_a_pair_must_run_one_transport_and_over_nvlink_share_a_node() -> None:
    assert "node" not in COMPARED_FIELDS
    assert layout_mismatch(NVLINK, msgspec.structs.replace(NVLINK)) is None
    tcp_here = msgspec.structs.replace(LAYOUT, transport="tcp", node="node-a")
    tcp_there = msgspec.structs.replace(tcp_here, node="node-b")
    assert layout_mismatch(tcp_here, tcp_there) is None  # TCP and RDMA cross nodes
    assert layout_mismatch(tcp_here, NVLINK) == "transport (prefill 'tcp', decode 'nvlink')"
    elsewhere = layout_mismatch(msgspec.structs.replace(NVLINK, node="node-b"), NVLINK)
    assert elsewhere is not None
    assert elsewhere.startswith("node (prefill 'node-b', decode 'node-a': NVLink reaches only")
    assert "--disaggregation-transport rdma or tcp" in elsewhere


def test_the_node_identity_is_stable_and_travels_with_the_published_layout() -> None:
    assert node_identity() == node_identity() != ""
    assert parse_layout(NVLINK.as_json()) == NVLINK


@pytest.fixture
def prefill_rank() -> Iterator[BootstrapServer]:
    server = BootstrapServer("127.0.0.1", 0, "feed", lambda transfer_id, proof: False)
    yield server
    server.close()


def test_a_decode_server_refuses_a_prefill_rank_over_nvlink_on_another_node(
    prefill_rank: BootstrapServer,
) -> None:
    prefill_rank.publish(msgspec.structs.replace(NVLINK, node="node-b"))
    params = handoff_from(prefill_rank)
    refusal = asyncio.run(PrefillPeers(lambda: NVLINK).refusal(params, PROBE))
    assert refusal is not None and "NVLink reaches only a prefill server on this node" in refusal


def test_the_non_cuda_wheel_has_no_nvlink_and_refuses_it_before_its_engine_starts() -> None:
    require_disaggregation()
    import mooncake.engine

    try:
        metadata.version("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        pytest.skip("a CUDA build of Mooncake is installed: its NVLink is for a GPU machine")

    assert probe_capabilities(mooncake.engine) == NONE
    with pytest.raises(TransportUnavailable, match="has no NVLink transport"):
        TransferAgent("127.0.0.1", None, "nvlink", device_memory=True)


def test_an_agent_runs_what_its_probe_allows_and_stamps_it_on_its_layout() -> None:
    require_disaggregation()
    # The build claims NVLink, but the KV is in host memory: auto keeps to TCP.
    agent = TransferAgent("127.0.0.1", probe=lambda module: INTRA)
    assert agent.transport == "tcp"
    described = agent.describe(LAYOUT)
    assert (described.transport, described.node) == ("tcp", node_identity())
    with pytest.raises(TransportUnavailable, match="KV in host memory"):
        TransferAgent("127.0.0.1", None, "nvlink", probe=lambda module: INTRA)


def test_rdma_on_devices_this_machine_lacks_fails_at_start_instead_of_falling_back() -> None:
    require_disaggregation()
    with pytest.raises(RuntimeError, match=r"did not start on 127\.0\.0\.1 over rdma"):
        TransferAgent("127.0.0.1", "deepinfer_no_such_rnic0", "rdma")
