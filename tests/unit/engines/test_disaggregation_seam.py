"""The engine-agnostic seam of prefill/decode disaggregation: the handoff's validation, the
freeing rules of held KV, the bootstrap port, and a read between two real transfer engines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_call, bootstrap_ping
from deepinfer_server.disaggregation.handoff.params import (
    KVTransferParams,
    parse_kv_transfer_params,
)
from deepinfer_server.disaggregation.handoff.requests import request_kv_transfer
from deepinfer_server.disaggregation.handoff.signing import HandoffSigner
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.disaggregation.transfer.held import HeldKV
from deepinfer_server.errors import BadRequestError, HandoffUnverifiedError
from tests.handoffs import sample_handoff
from tests.lanes import require_disaggregation

HANDOFF: dict[str, Any] = sample_handoff().as_json()


SIGNER = HandoffSigner(b"seam-test-pair-secret", 60.0)
PROMPT = [7] * 200


def signed() -> dict[str, Any]:
    """The handoff signed now (it expires: signed at import, it had expired by the time a
    worker ran a test module queued minutes later)."""
    return SIGNER.sign(parse_kv_transfer_params(dict(HANDOFF)), PROMPT, time.time()).as_json()


def test_a_prefill_answers_handoff_parses_back() -> None:
    params = parse_kv_transfer_params(dict(HANDOFF), prompt_length=200)
    assert params.as_json() == HANDOFF
    assert HANDOFF["do_remote_prefill"] is True


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"remote_port": 0}, "remote_port"),
        ({"remote_block_ids": [4]}, "2 blocks"),
        ({"remote_host": 7}, "remote_host"),
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        ({"block_size": 64}, "block_size"),
        ({"prompt_length": 201}, "201-token prompt"),
    ],
)
def test_a_malformed_handoff_is_refused_with_its_reason(change: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_kv_transfer_params({**HANDOFF, **change}, prompt_length=200)


def test_each_role_accepts_only_its_own_kind_of_kv_transfer_params() -> None:
    handoff = {"kv_transfer_params": signed()}
    decoded = request_kv_transfer(handoff, DisaggregationRole.DECODE, 1, PROMPT, SIGNER)
    assert decoded is not None
    assert decoded.release_proof == SIGNER.release_proof(decoded.transfer_id)
    assert (
        request_kv_transfer(
            {"kv_transfer_params": {"do_remote_decode": True}},
            DisaggregationRole.PREFILL,
            1,
            [7] * 9,
            SIGNER,
        )
        is None
    )
    assert request_kv_transfer({}, DisaggregationRole.PREFILL, 1, [7] * 9, SIGNER) is None
    assert request_kv_transfer({}, DisaggregationRole.NULL, 2, [7] * 9, None) is None
    refused = [
        (handoff, DisaggregationRole.NULL, 1, 200),  # a NORMAL server takes no handoff
        (handoff, DisaggregationRole.PREFILL, 1, 200),  # a decode request sent to a prefill server
        ({}, DisaggregationRole.DECODE, 1, 200),  # a COMPLETION engine cannot prefill
        (handoff, DisaggregationRole.DECODE, 2, 200),  # one handoff, one choice
        (handoff, DisaggregationRole.DECODE, 1, 150),  # not this prompt
        ({"kv_transfer_params": "x"}, DisaggregationRole.DECODE, 1, 200),
    ]
    for body, mode, choices, length in refused:
        with pytest.raises(BadRequestError) as caught:
            request_kv_transfer(body, mode, choices, [7] * length, SIGNER)
        assert caught.value.param == "kv_transfer_params"


def test_a_decode_server_refuses_a_handoff_it_cannot_verify_with_a_403() -> None:
    forged = {"kv_transfer_params": {**signed(), "remote_kv_address": 1 << 22}}
    unsigned = {"kv_transfer_params": dict(HANDOFF)}
    other_prompt = [*PROMPT[:-1], 8]  # same length: only the signature tells them apart
    cases = [
        (forged, PROMPT, SIGNER, "does not verify"),
        (unsigned, PROMPT, SIGNER, "no signature"),
        ({"kv_transfer_params": signed()}, other_prompt, SIGNER, "another prompt"),
        ({"kv_transfer_params": signed()}, PROMPT, None, "--disaggregation-secret-file"),
    ]
    for body, prompt, signer, says in cases:
        with pytest.raises(HandoffUnverifiedError, match=says) as caught:
            request_kv_transfer(body, DisaggregationRole.DECODE, 1, prompt, signer)
        assert (caught.value.status_code, caught.value.param) == (403, "kv_transfer_params")


def test_held_kv_is_freed_when_released_or_when_its_time_is_up() -> None:
    freed: list[str] = []
    held = HeldKV(timeout=30.0)
    held.hold("a", lambda: freed.append("a"), now=100.0)
    held.hold("b", lambda: freed.append("b"), now=100.0)
    held.hold("c", lambda: freed.append("c"), now=110.0)
    held.collect(["a", "a", "unknown"], now=101.0)  # a repeat or an unknown ID is harmless
    assert freed == ["a"] and len(held) == 2
    held.collect([], now=129.9)
    assert freed == ["a"]
    held.collect([], now=130.0)  # b's deadline
    assert freed == ["a", "b"] and "c" in held
    held.free_all()
    assert freed == ["a", "b", "c"] and len(held) == 0
    assert held.freed == {"released": 1, "expired": 1}


def test_the_bootstrap_port_queues_releases_and_answers_pings() -> None:
    from deepinfer_server.disaggregation.transfer.bootstrap import BootstrapServer

    server = BootstrapServer("127.0.0.1", 0, "feed", SIGNER.release_verified)
    try:
        proof = SIGNER.release_proof("t9")
        release = {"op": "release", "transfer_id": "t9", "proof": proof}
        assert bootstrap_call("127.0.0.1", server.port, release, 5) == {"ok": True}
        forged = {"op": "release", "transfer_id": "t8", "proof": proof}
        assert bootstrap_call("127.0.0.1", server.port, forged, 5)["ok"] is False
        assert bootstrap_call("127.0.0.1", server.port, {"op": "nonsense"}, 5) == {"ok": False}
        assert server.take_released() == ["t9"]
        assert server.take_released() == []
        assert server.refused_releases == 1
        assert asyncio.run(bootstrap_ping("127.0.0.1", server.port, 5.0))
    finally:
        server.close()
    assert not asyncio.run(bootstrap_ping("127.0.0.1", server.port, 5.0))


@pytest.mark.disaggregation
def test_two_transfer_engines_move_registered_memory_over_loopback_tcp() -> None:
    require_disaggregation()
    from deepinfer_server.disaggregation.transfer.agent import TransferAgent, TransferError

    source, sink = TransferAgent("127.0.0.1"), TransferAgent("127.0.0.1")
    data = np.arange(4096, dtype=np.int32)
    into = np.zeros(4096, dtype=np.int32)
    source.register(data.ctypes.data, data.nbytes)
    sink.register(into.ctypes.data, into.nbytes)
    try:
        pieces = [
            (into.ctypes.data, data.ctypes.data + 4096, 2048),
            (into.ctypes.data + 8192, data.ctypes.data, 1024),
        ]
        assert sink.read(source.session, pieces) == 3072
        assert np.array_equal(into[:512], data[1024:1536])
        assert np.array_equal(into[2048:2304], data[:256])
        assert not into[512:2048].any()
        with pytest.raises(TransferError) as failed:
            sink.read("127.0.0.1:1", [(into.ctypes.data, data.ctypes.data, 16)])
        assert failed.value.reason == "transfer_error"
    finally:
        source.unregister(data.ctypes.data)
        sink.unregister(into.ctypes.data)


def test_a_decode_server_is_unhealthy_only_when_no_known_prefill_peer_answers() -> None:
    from deepinfer_server.disaggregation.handoff.peers import (
        PEER_GONE_SECONDS,
        PEER_MEMORY_SECONDS,
        PrefillPeers,
    )
    from deepinfer_server.disaggregation.transfer.bootstrap import BootstrapServer

    def peer(port: int) -> KVTransferParams:
        # The handoff names the holding rank's own port (HANDOFF's rank is 1: no port + rank).
        return parse_kv_transfer_params(
            {**HANDOFF, "remote_host": "127.0.0.1", "remote_bootstrap_port": port}
        )

    peers = PrefillPeers()
    assert asyncio.run(peers.unreachable(0.0)) == []  # no peer known yet
    live = BootstrapServer("127.0.0.1", 0, "feed", SIGNER.release_verified)
    gone = BootstrapServer("127.0.0.1", 0, "dead", SIGNER.release_verified)
    gone.close()
    try:
        peers.seen(peer(gone.port), 0.0)
        assert asyncio.run(peers.unreachable(1.0)) == [f"127.0.0.1:{gone.port}"]
        peers.seen(peer(live.port), 1.0)
        # A loaded CI machine may take more than the production probe's second to answer.
        assert asyncio.run(peers.unreachable(2.0, probe_seconds=30.0)) == []  # one answers
        # A peer no handoff named for a while is forgotten (it may have been replaced).
        alone = PrefillPeers()
        alone.seen(peer(gone.port), 0.0)
        assert asyncio.run(alone.unreachable(PEER_MEMORY_SECONDS + 1)) == []
        # So is one still named but silent for a while (restarted on another port, say): a
        # gateway that took the decode server out would never name the new one.
        restarted = PrefillPeers()
        restarted.seen(peer(gone.port), 0.0)
        assert asyncio.run(restarted.unreachable(1.0)) == [f"127.0.0.1:{gone.port}"]
        restarted.seen(peer(gone.port), PEER_GONE_SECONDS)
        assert asyncio.run(restarted.unreachable(PEER_GONE_SECONDS)) == [f"127.0.0.1:{gone.port}"]
        assert asyncio.run(restarted.unreachable(PEER_GONE_SECONDS + 1)) == []
    finally:
        live.close()
