"""The layout handshake: two KV layouts compared field by field, a prefill rank's published
layout, and a decode server's pairing with its prefill peers (refused before any pull)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from deepinfer_server.disaggregation.handoff.params import (
    KVTransferParams,
    parse_kv_transfer_params,
)
from deepinfer_server.disaggregation.handoff.peers import (
    LAYOUT_MISMATCH_CODE,
    PrefillPeers,
    refuse_unpaired,
)
from deepinfer_server.disaggregation.layout import (
    KVLayout,
    checkpoint_identity,
    layout_mismatch,
    parse_layout,
)
from deepinfer_server.disaggregation.transfer.bootstrap import BootstrapServer
from deepinfer_server.errors import ApiError
from tests.unit.engines.test_disaggregation_seam import HANDOFF

LAYOUT = KVLayout(
    engine="deepinfer",
    deepinfer_version="0.1.0",
    checkpoint="0123456789abcdef",
    block_size=128,
    block_bytes=65536,
    state_bytes=4096,
    dtype="torch.bfloat16",
    backtracking_tokens=1,
    speculative_tokens=0,
)
SPECULATING = msgspec.structs.replace(
    LAYOUT, speculative_tokens=1, backtracking_tokens=2, state_bytes=4608
)
#: A loaded CI machine may take more than the production probe's second to answer.
PROBE = 30.0


def test_equal_layouts_pair_and_each_differing_field_is_named_with_both_values() -> None:
    assert layout_mismatch(LAYOUT, msgspec.structs.replace(LAYOUT)) is None
    assert layout_mismatch(LAYOUT, SPECULATING) == (
        "state_bytes (prefill 4096, decode 4608); backtracking_tokens (prefill 1, decode 2); "
        "speculative_tokens (prefill 0, decode 1)"
    )
    other_blocks = msgspec.structs.replace(LAYOUT, block_size=64)
    assert layout_mismatch(other_blocks, LAYOUT) == "block_size (prefill 64, decode 128)"
    simulated = msgspec.structs.replace(LAYOUT, engine="simulated", deepinfer_version=None)
    assert layout_mismatch(simulated, LAYOUT) == (
        "engine (prefill 'simulated', decode 'deepinfer'); "
        "deepinfer_version (prefill None, decode '0.1.0')"
    )


def test_a_published_layout_reads_back_and_anything_else_is_none() -> None:
    assert parse_layout(LAYOUT.as_json()) == LAYOUT
    assert parse_layout(None) is None
    assert parse_layout({"engine": "deepinfer"}) is None  # row sizes missing


def test_a_checkpoint_is_known_by_its_config_wherever_it_is_mounted(tmp_path: Path) -> None:
    here, there, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for path, config in ((here, b'{"x": 1}'), (there, b'{"x": 1}'), (other, b'{"x": 2}')):
        path.mkdir()
        (path / "config.json").write_bytes(config)
    assert checkpoint_identity(str(here)) == checkpoint_identity(str(there)) is not None
    assert checkpoint_identity(str(here)) != checkpoint_identity(str(other))
    assert checkpoint_identity(None) is None
    assert checkpoint_identity(str(tmp_path / "missing")) is None


def handoff_from(server: BootstrapServer, engine_id: str = "feed") -> KVTransferParams:
    return parse_kv_transfer_params(
        {
            **HANDOFF,
            "remote_host": "127.0.0.1",
            "remote_bootstrap_port": server.port,
            "remote_engine_id": engine_id,
        }
    )


def _no_release(transfer_id: str, proof: object) -> bool:
    """The pairing sends no release: none verifies."""
    return False


@pytest.fixture
def prefill_rank() -> object:
    server = BootstrapServer("127.0.0.1", 0, "feed", _no_release)
    yield server
    server.close()


def test_a_decode_server_refuses_a_prefill_rank_of_another_layout_and_health_names_it(
    prefill_rank: BootstrapServer,
) -> None:
    prefill_rank.publish(LAYOUT)
    params = handoff_from(prefill_rank)
    peers = PrefillPeers(lambda: SPECULATING)
    peers.seen(params, 0.0)
    refusal = asyncio.run(peers.refusal(params, PROBE))
    assert refusal is not None and "speculative_tokens (prefill 0, decode 1)" in refusal
    peer = f"127.0.0.1:{prefill_rank.port}"
    assert peers.refused(1.0) == {peer: refusal}
    assert peers.all_refused(1.0)
    with pytest.raises(ApiError) as refused:
        asyncio.run(refuse_unpaired(peers, params))  # answered from the pairing kept
    assert refused.value.status_code == 503 and refused.value.code == LAYOUT_MISMATCH_CODE
    assert refused.value.param == "kv_transfer_params"
    assert peer in refused.value.message and refusal in refused.value.message


def test_a_matching_prefill_rank_pairs_and_a_restarted_one_is_asked_again(
    prefill_rank: BootstrapServer,
) -> None:
    prefill_rank.publish(LAYOUT)
    peers = PrefillPeers(lambda: LAYOUT)
    params = handoff_from(prefill_rank)
    peers.seen(params, 0.0)
    assert asyncio.run(peers.refusal(params, PROBE)) is None
    assert peers.refused(0.0) == {} and not peers.all_refused(0.0)
    # A handoff of another engine ID on the same port (the rank restarted, here with another
    # layout): asked again, refused; the engine already paired is not asked again.
    prefill_rank.publish(SPECULATING)
    assert asyncio.run(peers.refusal(params, PROBE)) is None
    restarted = handoff_from(prefill_rank, "beef")
    assert asyncio.run(peers.refusal(restarted, PROBE)) is not None


def test_health_probes_renew_the_pairings_and_a_rank_without_layout_is_refused(
    prefill_rank: BootstrapServer,
) -> None:
    peers = PrefillPeers(lambda: LAYOUT)
    params = handoff_from(prefill_rank)
    peers.seen(params, 0.0)
    assert asyncio.run(peers.unreachable(1.0, PROBE)) == []
    assert peers.refused(1.0) == {
        f"127.0.0.1:{prefill_rank.port}": "layout (the prefill server publishes no KV layout: "
        "an older or other server)"
    }
    prefill_rank.publish(LAYOUT)
    assert asyncio.run(peers.unreachable(2.0, PROBE)) == []
    assert peers.refused(2.0) == {}


def test_nothing_is_compared_before_the_decode_ranks_reported_their_layout(
    prefill_rank: BootstrapServer,
) -> None:
    prefill_rank.publish(SPECULATING)
    params = handoff_from(prefill_rank)
    assert asyncio.run(PrefillPeers().refusal(params, PROBE)) is None


def test_an_unreachable_prefill_rank_is_left_to_its_pull() -> None:
    server = BootstrapServer("127.0.0.1", 0, "feed", _no_release)
    params = handoff_from(server)
    server.close()
    assert asyncio.run(PrefillPeers(lambda: LAYOUT).refusal(params, PROBE)) is None


class _Agent:
    """Stands in for the transfer agent: registers nothing."""

    def register(self, address: int, length: int) -> None:
        del address, length

    def unregister(self, address: int) -> None:
        del address


def test_a_deepinfer_ranks_row_digest_covers_its_rows_in_order_and_the_state_row() -> None:
    torch = pytest.importorskip("torch")
    from deepinfer_server.engines.deepinfer.cache_memory import DIGEST_WINDOW, CacheMemory

    generator = torch.Generator().manual_seed(7)

    class Cache:
        gpu_blocks = torch.randint(0, 256, (4, 4096), dtype=torch.uint8, generator=generator)
        gpu_states = torch.randn(3, 300, generator=generator).to(torch.bfloat16)

    memory = CacheMemory(Cache(), _Agent())  # type: ignore[arg-type]
    digest = memory.digest([1, 2], 1)
    assert digest == memory.digest([1, 2], 1)
    assert digest != memory.digest([2, 1], 1)  # the wrong order
    assert digest != memory.digest([1, 2], 2)  # another state row
    Cache.gpu_blocks[2, DIGEST_WINDOW + 1] ^= 0xFF  # outside the sampled windows: not seen
    assert memory.digest([1, 2], 1) == digest
    Cache.gpu_blocks[2, 4096 // 2] ^= 0xFF  # the middle window
    assert memory.digest([1, 2], 1) != digest


def test_a_rank_asked_before_it_published_its_layout_is_asked_again(
    prefill_rank: BootstrapServer,
) -> None:
    peers = PrefillPeers(lambda: LAYOUT)
    params = handoff_from(prefill_rank)
    peers.seen(params, 0.0)
    assert asyncio.run(peers.refusal(params, PROBE)) is not None  # no layout yet: refused
    prefill_rank.publish(LAYOUT)  # the same engine, a moment later
    assert asyncio.run(peers.refusal(params, PROBE)) is None
    assert peers.refused(1.0) == {}
