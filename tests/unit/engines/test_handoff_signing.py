"""Signed handoffs: a prefill server's MAC over `kv_transfer_params`, bound to the prompt and
expiring, and the proof a release carries."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from deepinfer_server.disaggregation.handoff.params import (
    KVTransferParams,
    parse_kv_transfer_params,
)
from deepinfer_server.disaggregation.handoff.signing import (
    CLOCK_SKEW_SECONDS,
    HandoffRefused,
    HandoffSigner,
)
from tests.handoffs import sample_handoff

SECRET = b"a-pair-secret-of-32-bytes-length"
SIGNER = HandoffSigner(SECRET, 60.0)
PROMPT = list(range(300))
NOW = 1_800_000_000.0

PARAMS = sample_handoff(remote_block_ids=[4, 9, 11], prompt_length=300)

#: Each wire field, and a value other than the signed one.
TAMPERED: dict[str, Any] = {
    "remote_host": "10.0.0.8",
    "remote_port": 15001,
    "remote_bootstrap_port": 8999,
    "remote_dp_rank": 0,
    "remote_engine_id": "0123abce",
    "transfer_id": "t2",
    "remote_block_ids": [4, 9, 12],
    "remote_kv_address": (1 << 20) + 4096,
    "remote_state_address": (1 << 21) + 64,
    "remote_state_slot": 3,
    "first_token_id": 43,
    "prompt_length": 301,
    "block_size": 64,
    "do_remote_decode": True,
    "kv_digest": "ab" * 32,
    "expires_at": int(NOW) + 3600,
}


def signed_wire() -> dict[str, Any]:
    """The handoff as a prefill answer carries it."""
    return SIGNER.sign(PARAMS, PROMPT, NOW).as_json()


def received(wire: dict[str, Any]) -> KVTransferParams:
    """The handoff as a decode server decodes it (no length check: tampering is the MAC's)."""
    return msgspec.convert(wire, KVTransferParams)


def test_a_signed_handoff_verifies_after_its_trip_through_json() -> None:
    wire = msgspec.json.decode(msgspec.json.encode(signed_wire()))
    params = parse_kv_transfer_params(wire, prompt_length=300)
    SIGNER.verify(params, PROMPT, NOW + 59)
    assert params.expires_at is not None and params.expires_at >= NOW + 60
    assert "release_proof" not in wire


def test_every_field_is_covered_by_the_signature() -> None:
    assert set(TAMPERED) == set(PARAMS.__struct_fields__) - {
        "signature",
        "release_proof",
        "do_remote_prefill",
    }
    for field, value in TAMPERED.items():
        with pytest.raises(HandoffRefused, match="does not verify"):
            SIGNER.verify(received({**signed_wire(), field: value}), PROMPT, NOW)


def test_do_remote_prefill_is_covered_too() -> None:
    with pytest.raises(HandoffRefused, match="does not verify"):
        SIGNER.verify(received({**signed_wire(), "do_remote_prefill": False}), PROMPT, NOW)


def test_a_handoff_is_bound_to_its_prompt() -> None:
    params = received(signed_wire())
    for other in ([*PROMPT[:-1], 0], PROMPT[:-1], [*PROMPT, 1]):
        with pytest.raises(HandoffRefused, match="another prompt"):
            SIGNER.verify(params, other, NOW)


def test_a_handoff_expires_after_the_hold_timeout_and_the_clock_skew() -> None:
    params = received(signed_wire())
    assert params.expires_at is not None
    SIGNER.verify(params, PROMPT, params.expires_at + CLOCK_SKEW_SECONDS)
    with pytest.raises(HandoffRefused, match="expired"):
        SIGNER.verify(params, PROMPT, params.expires_at + CLOCK_SKEW_SECONDS + 1)


def test_another_secret_neither_verifies_nor_signs_for_this_pair() -> None:
    stranger = HandoffSigner(b"another-pair-secret-of-32-bytes!", 60.0)
    with pytest.raises(HandoffRefused, match="another secret"):
        stranger.verify(received(signed_wire()), PROMPT, NOW)
    with pytest.raises(HandoffRefused, match="does not verify"):
        SIGNER.verify(stranger.sign(PARAMS, PROMPT, NOW), PROMPT, NOW)


@pytest.mark.parametrize(
    "wire",
    [
        {k: v for k, v in signed_wire().items() if k != "signature"},
        {k: v for k, v in signed_wire().items() if k != "expires_at"},
        {**signed_wire(), "signature": "0" * 64},
        {**signed_wire(), "signature": signed_wire()["signature"].upper()},
    ],
)
def test_a_missing_or_made_up_signature_is_refused(wire: dict[str, Any]) -> None:
    with pytest.raises(HandoffRefused):
        SIGNER.verify(received(wire), PROMPT, NOW)


def test_a_release_proof_is_the_pairs_and_the_transfers_own() -> None:
    armed = SIGNER.armed(received(signed_wire()))
    assert SIGNER.release_verified("t1", armed.release_proof)
    assert not SIGNER.release_verified("t2", armed.release_proof)
    assert not SIGNER.release_verified("t1", None)
    assert not SIGNER.release_verified("t1", 7)
    assert not HandoffSigner(b"another-pair-secret-of-32-bytes!", 60.0).release_verified(
        "t1", armed.release_proof
    )


def test_a_release_proof_from_the_wire_is_dropped() -> None:
    wire = {**signed_wire(), "release_proof": SIGNER.release_proof("t1")}
    assert parse_kv_transfer_params(wire, prompt_length=300).release_proof is None


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        HandoffSigner(b"short", 60.0)
