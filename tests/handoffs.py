"""A sample prefill handoff (`KVTransferParams`), for the tests of the decode side's checks."""

from __future__ import annotations

from typing import Any

from deepinfer_server.disaggregation.handoff.params import KVTransferParams


def sample_handoff(**fields: Any) -> KVTransferParams:
    """A well-formed, unsigned handoff of a 200-token prompt held by DP rank 1 of a prefill
    server at 10.0.0.7; `fields` replace its values."""
    values: dict[str, Any] = {
        "remote_host": "10.0.0.7",
        "remote_port": 15000,
        "remote_bootstrap_port": 8998,
        "remote_dp_rank": 1,
        "remote_engine_id": "0123abcd",
        "transfer_id": "t1",
        "remote_block_ids": [4, 9],
        "remote_kv_address": 1 << 20,
        "remote_state_address": 1 << 21,
        "remote_state_slot": 2,
        "first_token_id": 42,
        "prompt_length": 200,
    }
    return KVTransferParams(**{**values, **fields})
