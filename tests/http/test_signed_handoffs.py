"""A decode server takes only the handoffs its prefill server signed: a forged, altered, expired
or moved `kv_transfer_params` is a 403 in each protocol's shape, and nothing is submitted (no
KV is read, no block reserved)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.handoff.signing import HandoffSigner
from deepinfer_server.model.kv_block import blocks_for
from tests.handoffs import sample_handoff
from tests.http.harness import run, serve
from tests.http.test_bad_input import MESSAGES, PATHS, VALID
from tests.paths import PD_SECRET, PD_SECRET_ARGS

SIGNER = HandoffSigner(PD_SECRET.read_bytes().strip(), 60.0)
STRANGER = HandoffSigner(b"a-secret-this-pair-does-not-share", 60.0)
DECODE = (*PD_SECRET_ARGS, "--disaggregation-mode", "decode")


def handoff(prompt: list[int]) -> KVTransferParams:
    """What a prefill server's engine hands off for `prompt`, unsigned."""
    return sample_handoff(
        remote_host="127.0.0.1",
        remote_dp_rank=0,
        remote_block_ids=list(range(1, blocks_for(len(prompt)) + 1)),
        remote_state_slot=1,
        prompt_length=len(prompt),
    )


def refused_handoffs(prompt: list[int]) -> dict[str, dict[str, Any]]:
    """Each way a handoff fails to verify, as the request carries it."""
    now = time.time()
    signed = SIGNER.sign(handoff(prompt), prompt, now).as_json()
    moved = [*prompt[:-1], prompt[-1] + 1]  # the same length: only the MAC tells
    return {
        "altered": {**signed, "remote_kv_address": (1 << 20) + 4096},
        "unsigned": handoff(prompt).as_json(),
        "expired": SIGNER.sign(handoff(prompt), prompt, now - 3600).as_json(),
        "another secret": STRANGER.sign(handoff(prompt), prompt, now).as_json(),
        "another prompt": SIGNER.sign(handoff(moved), moved, now).as_json(),
    }


async def prompts() -> dict[str, list[int]]:
    """Each path's prompt as this server encodes VALID's request."""
    async with serve() as h:
        for path in PATHS:
            assert (await h.client.post(path, json=VALID[path])).status_code == 200
        return {
            path: submitted[1]
            for path, submitted in zip(PATHS, h.coordinator.submitted, strict=True)
        }


def test_an_unverifiable_handoff_is_a_403_in_each_shape_and_nothing_is_submitted() -> None:
    async def body() -> None:
        encoded = await prompts()
        async with serve(*DECODE) as h:
            for path in PATHS:
                for case, params in refused_handoffs(encoded[path]).items():
                    request = {**VALID[path], "kv_transfer_params": params}
                    response = await h.client.post(path, json=request)
                    assert response.status_code == 403, (path, case, response.text)
                    error = response.json()["error"]
                    assert error["type"] == "permission_error", (path, case)
                    if path != MESSAGES:  # Anthropic's envelope has neither code nor param
                        assert error["code"] == "kv_transfer_params_unverified"
                        assert error["param"] == "kv_transfer_params"
            assert not h.coordinator.submitted  # nothing admitted: no read, no reservation

    run(body, timeout=120)


def test_a_signed_handoff_of_the_prompt_is_taken_with_its_release_proof() -> None:
    async def body() -> None:
        encoded = await prompts()
        async with serve(*DECODE) as h:
            for path in PATHS:
                signed = SIGNER.sign(handoff(encoded[path]), encoded[path], time.time())
                # Through JSON, as a gateway copies the prefill answer's object.
                wire = msgspec.json.decode(msgspec.json.encode(signed.as_json()))
                request = {**VALID[path], "kv_transfer_params": wire}
                response = await h.client.post(path, json=request)
                assert response.status_code == 200, (path, response.text)
                request_id = h.coordinator.submitted[-1][0]
                taken = h.coordinator.kv_transfer_params[request_id]
                assert taken is not None and taken.transfer_id == "t1"
                assert SIGNER.release_verified("t1", taken.release_proof)

    run(body, timeout=120)
