"""The simulated engine's PROMPT and COMPLETION roles, with the real transfer library between
them (Mooncake's Transfer Engine over loopback TCP), through the engine driver."""

from __future__ import annotations

import dataclasses
import socket
import time
from functools import cache
from typing import Any

import msgspec
import pytest

from deepinfer_server.disaggregation.handoff.bootstrap import bootstrap_call
from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.handoff.signing import HandoffSigner, release_key
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.disaggregation.transfer import connector
from deepinfer_server.disaggregation.transfer.connector import PrefillConnector
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.role_settings import RoleSettings
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.kv_size import KVSize
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, Finish, RequestDelta, SamplingOptions
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.lanes import require_disaggregation

require_disaggregation()
pytestmark = pytest.mark.disaggregation

#: The pair's shared secret.
SECRET = b"simulated-pair-secret"

#: BOS <｜User｜> "Hello" x 100 <｜Assistant｜> </think>: three KV blocks of prompt.
PROMPT = [0, 128803, *([19923] * 300), 128804, 128822]


@cache
def _tokenizer_json() -> str:
    return embedded_tokenizer_json()


def _unused_port() -> int:
    """A port nothing listens on (where a closed transfer engine's session was)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def role_settings(**changes: Any) -> RoleSettings:
    """A rank's disaggregation settings on loopback, a bootstrap port the rank binds itself
    unless `changes` give one."""
    settings = RoleSettings(
        host="127.0.0.1",
        ib_device=None,
        bootstrap_port=0,
        rank=0,
        hold_timeout=60.0,
        transfer_timeout=30.0,
        release_key=release_key(SECRET),
    )
    return dataclasses.replace(settings, **changes)


def make(mode: str, **overrides: object) -> tuple[LLMEngine, LLMEngineDriver]:
    args = SimEngineArgs(
        tokenizer_json=_tokenizer_json(),
        lockstep=new_lockstep_group(1, 5.0),
        ttft_ms=0,
        itl_ms=0,
        max_model_len=4096,
        max_num_seqs=4,
        disaggregation_mode=DisaggregationRole(mode),
        role=role_settings(),
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    engine = LLMEngine.from_engine_args(args)
    return engine, LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine))


@pytest.fixture
def prefill() -> object:
    engine, driver = make("prefill")
    yield engine, driver
    driver.close()


@pytest.fixture
def decode() -> object:
    engine, driver = make("decode")
    yield engine, driver
    driver.close()


def add(
    driver: LLMEngineDriver,
    request_id: str,
    prompt: list[int],
    params: KVTransferParams | None = None,
    max_tokens: int = 40,
) -> None:
    sampling = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    message = AddRequest(request_id, pack_token_ids(prompt), sampling, kv_transfer_params=params)
    assert driver.add(message) is None


def run(driver: LLMEngineDriver, seconds: float = 10.0) -> dict[str, list[RequestDelta]]:
    """Iterate until the engine is idle (pulls run in threads of their own: bounded in time)."""
    deltas: dict[str, list[RequestDelta]] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        unfinished, outputs = driver.iterate()
        for delta in outputs:
            deltas.setdefault(delta.request_id, []).append(delta)
        if not unfinished and not outputs:
            return deltas
    raise AssertionError("the engine never went idle")


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.tokens.token_ids]


def handoff_of(prefill: tuple[LLMEngine, LLMEngineDriver], request_id: str) -> KVTransferParams:
    _, driver = prefill
    add(driver, request_id, PROMPT)
    deltas = run(driver)[request_id]
    assert deltas[-1].finish is Finish.LENGTH
    assert len(tokens(deltas)) == 1  # a PROMPT engine answers with the prompt step's token
    params = deltas[-1].kv_transfer_params
    assert params is not None
    # As a decode server's API process hands it on once verified: with its release proof.
    return HandoffSigner(SECRET, 60.0).armed(params)


def wait_released(engine: LLMEngine, driver: LLMEngineDriver) -> None:
    """The prefill engine frees a released hold at its next iteration after the notice."""
    deadline = time.monotonic() + 10
    while engine.held_kv() and time.monotonic() < deadline:
        driver.iterate()
    assert engine.held_kv() == 0


def test_a_handoff_decodes_the_normal_engines_answer_without_computing_the_prompt(
    prefill: tuple[LLMEngine, LLMEngineDriver], decode: tuple[LLMEngine, LLMEngineDriver]
) -> None:
    _, normal = make("null")
    add(normal, "n", PROMPT)
    expected = tokens(run(normal)["n"])
    normal.close()

    prefill_engine, prefill_driver = prefill
    free_before = prefill_engine.scheduler.get_num_free_gpu_blocks()
    params = handoff_of(prefill, "p")
    assert params.first_token_id == expected[0]
    assert params.prompt_length == len(PROMPT) and len(params.remote_block_ids) == 3
    assert prefill_engine.held_kv() == 1
    assert prefill_engine.scheduler.get_num_free_gpu_blocks() == free_before - 3

    decode_engine, decode_driver = decode
    free = decode_engine.scheduler.get_num_free_gpu_blocks()
    add(decode_driver, "d", PROMPT, params)
    deltas = run(decode_driver)["d"]
    assert tokens(deltas) == expected
    assert deltas[-1].finish is Finish.LENGTH
    stats = decode_engine.kv_transfer_stats()
    assert stats is not None and stats.bytes >= 3 * 128 * 8  # three blocks of (token, writer)
    assert decode_engine.prompt_tokens_computed == 0
    assert prefill_engine.prompt_tokens_computed == len(PROMPT)
    assert decode_engine.scheduler.get_num_free_gpu_blocks() == free
    wait_released(prefill_engine, prefill_driver)
    assert prefill_engine.scheduler.get_num_free_gpu_blocks() == free_before
    counters = decode_driver.counters()
    assert counters is not None and counters.kv_transfer_bytes == stats.bytes


def test_real_size_rows_move_every_byte_of_the_prompts_blocks_and_its_state_slot() -> None:
    size = KVSize(block_bytes=114048, state_bytes=2954688)  # the released Flash's
    prefill_engine, prefill_driver = make("prefill", kv_size=size)
    decode_engine, decode_driver = make("decode", kv_size=size)
    try:
        params = handoff_of((prefill_engine, prefill_driver), "p")
        add(decode_driver, "d", PROMPT, params, max_tokens=4)
        assert len(tokens(run(decode_driver)["d"])) == 4
        stats = decode_engine.kv_transfer_stats()
        assert stats is not None and stats.bytes == 3 * 114048 + 2954688
    finally:
        decode_driver.close()
        prefill_driver.close()


def test_a_prefill_rank_on_bootstrap_port_0_names_the_port_it_bound_in_its_handoffs(
    prefill: tuple[LLMEngine, LLMEngineDriver],
) -> None:
    engine, _ = prefill
    port = engine.bootstrap_port()
    assert port is not None and port > 0
    assert SimulatedAbilities(engine).connector.bootstrap_port == port
    params = handoff_of(prefill, "b")
    assert (params.remote_bootstrap_port, params.remote_dp_rank) == (port, 0)
    answer = bootstrap_call("127.0.0.1", port, {"op": "ping"}, 5.0)
    layout = engine.kv_layout()
    assert layout is not None and layout.engine == "simulated"
    assert answer == {
        "ok": True,
        "engine_id": params.remote_engine_id,
        "layout": layout.as_json(),
    }


def test_a_non_zero_bootstrap_port_is_rank_0s_and_rank_r_listens_on_it_plus_r(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []

    class Bound:
        """Stands in for the bootstrap server: records the port asked for, binds nothing."""

        def __init__(self, host: str, port: int, engine_id: str, verify: object) -> None:
            asked.append(port)
            self.port = port or 41234  # the kernel's choice for 0

    monkeypatch.setattr(connector, "BootstrapServer", Bound)
    assert PrefillConnector(9100, 2, 1.0, release_key(SECRET)).bootstrap_port == 9102
    assert PrefillConnector(0, 2, 1.0, release_key(SECRET)).bootstrap_port == 41234
    assert asked == [9102, 0]


def test_a_release_without_the_pairs_proof_is_ignored_and_counted(
    prefill: tuple[LLMEngine, LLMEngineDriver],
) -> None:
    engine, driver = prefill
    params = handoff_of(prefill, "r")
    stranger = HandoffSigner(b"another-pair-secret", 60.0).release_proof(params.transfer_id)
    for proof in (None, "0" * 64, stranger, params.release_proof[:-1]):
        message = {"op": "release", "transfer_id": params.transfer_id, "proof": proof}
        answer = bootstrap_call("127.0.0.1", params.remote_bootstrap_port, message, 5.0)
        assert answer["ok"] is False
    driver.iterate()
    assert engine.held_kv() == 1
    stats = engine.kv_transfer_stats()
    assert stats is not None and stats.failures == {"release_unverified": 4}
    message = {"op": "release", "transfer_id": params.transfer_id, "proof": params.release_proof}
    assert bootstrap_call("127.0.0.1", params.remote_bootstrap_port, message, 5.0) == {"ok": True}
    wait_released(engine, driver)


def test_a_prompt_that_is_not_the_handed_off_one_fails_the_provenance_check(
    prefill: tuple[LLMEngine, LLMEngineDriver], decode: tuple[LLMEngine, LLMEngineDriver]
) -> None:
    params = handoff_of(prefill, "p")
    decode_engine, decode_driver = decode
    free = decode_engine.scheduler.get_num_free_gpu_blocks()
    other = [*PROMPT[:-3], 19924, *PROMPT[-2:]]  # same length, one token differs
    add(decode_driver, "d", other, params)
    deltas = run(decode_driver)["d"]
    assert (deltas[-1].finish, deltas[-1].detail) == (Finish.KV_TRANSFER_FAILED, "kv_mismatch")
    assert tokens(deltas) == []
    assert decode_engine.scheduler.get_num_free_gpu_blocks() == free
    assert dict(decode_engine.kv_transfer_stats().failures) == {"kv_mismatch": 1}  # type: ignore[union-attr]
    wait_released(*prefill)  # a failed pull still releases the prefill side's hold


def test_a_prefill_side_that_is_gone_fails_the_transfer_and_frees_what_was_reserved(
    decode: tuple[LLMEngine, LLMEngineDriver],
) -> None:
    prefill_engine, prefill_driver = make("prefill")
    params = handoff_of((prefill_engine, prefill_driver), "p")
    prefill_driver.close()  # its transfer engine's memory is unregistered
    gone = msgspec.structs.replace(params, remote_port=_unused_port())
    decode_engine, decode_driver = decode
    free = decode_engine.scheduler.get_num_free_gpu_blocks()
    add(decode_driver, "d", PROMPT, gone)
    deltas = run(decode_driver)["d"]
    assert (deltas[-1].finish, deltas[-1].detail) == (Finish.KV_TRANSFER_FAILED, "transfer_error")
    assert decode_engine.scheduler.get_num_free_gpu_blocks() == free
    assert decode_engine.get_num_unfinished_requests() == 0


def test_an_abort_during_the_pull_frees_the_blocks_once_the_pull_returns(
    prefill: tuple[LLMEngine, LLMEngineDriver], decode: tuple[LLMEngine, LLMEngineDriver]
) -> None:
    params = handoff_of(prefill, "p")
    decode_engine, decode_driver = decode
    free = decode_engine.scheduler.get_num_free_gpu_blocks()
    add(decode_driver, "d", PROMPT, params)
    decode_driver.iterate()  # admitted: blocks reserved, the pull started
    assert decode_engine.scheduler.get_num_free_gpu_blocks() < free
    decode_driver.abort(["d"])
    assert "d" not in run(decode_driver)  # nothing more is reported for it
    assert decode_engine.scheduler.get_num_free_gpu_blocks() == free
    wait_released(*prefill)


def test_a_prompt_that_can_never_fit_fails_at_once(
    prefill: tuple[LLMEngine, LLMEngineDriver],
) -> None:
    params = handoff_of(prefill, "p")
    _, decode_driver = make("decode", kv_blocks=3)
    try:
        add(decode_driver, "d", PROMPT, params)
        deltas = run(decode_driver)["d"]
        assert (deltas[-1].finish, deltas[-1].detail) == (
            Finish.KV_TRANSFER_FAILED,
            "no_kv_room",
        )
    finally:
        decode_driver.close()
    wait_released(*prefill)  # the decode side gave up on it: the prefill side frees it


def test_a_decode_engine_refuses_a_request_without_a_handoff(
    decode: tuple[LLMEngine, LLMEngineDriver],
) -> None:
    _, driver = decode
    message = AddRequest("d", pack_token_ids(PROMPT), SamplingOptions(max_tokens=4))
    rejection = driver.add(message)
    assert rejection is not None and "cannot prefill" in rejection.message
