"""The simulated engine's cost model: a decode step's length grows with its batch, and a
prefill/decode pair's KV rows are as many bytes as DeepInfer allocates for the checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.kv_memory import KVMemory
from deepinfer_server.engines.simulated.kv_size import (
    RELEASED_TEXT_CONFIG,
    KVSize,
    TextConfig,
    kv_size_option,
    read_text_config,
    valid_kv_bytes,
)
from deepinfer_server.engines.simulated.step_clock import StepClock
from deepinfer_server.model.kv_block import BLOCK_SIZE
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.checkpoint import TEXT_CONFIG, write_checkpoint

#: BOS <｜User｜> "Hello" <｜Assistant｜> </think>
PROMPT = np.asarray([0, 128803, 19923, 128804, 128822], dtype=np.int32)


# The decode step's cost


def test_a_decode_step_lasts_longer_by_the_per_request_cost_of_each_sequence() -> None:
    clock = StepClock(itl_ms=10.0, itl_ms_per_request=0.5)
    assert clock.decode_end(100.0, 0) == 100.0
    assert clock.decode_end(100.0, 1) == pytest.approx(100.0005)
    assert clock.decode_end(100.0, 64) == pytest.approx(100.032)
    assert StepClock(itl_ms=10.0).decode_end(100.0, 64) == 100.0


def _decode_seconds(streams: int, per_request_ms: float, max_tokens: int) -> float:
    """Wall time for `streams` requests of `max_tokens` tokens on one engine whose steps
    cost nothing but `per_request_ms` per decoded sequence."""
    engine = LLMEngine.from_engine_args(
        SimEngineArgs(
            tokenizer_json=embedded_tokenizer_json(),
            lockstep=new_lockstep_group(1, 5.0),
            ttft_ms=0.0,
            itl_ms=0.0,
            itl_ms_per_request=per_request_ms,
        )
    )
    params = {"max_tokens": max_tokens, "ignore_eos": True}
    for index in range(streams):
        assert engine.add_request("u", f"r{index}", params, PROMPT) is not None
    started = time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.monotonic() - started
    engine.close()
    return elapsed


def test_an_engines_decode_steps_take_longer_with_a_bigger_batch() -> None:
    # Each request's first token comes from its prompt step, the other 7 from decode steps,
    # so the 4-stream run decodes 7 steps of 4 sequences: at least 7 * 4 * 15 ms.
    assert _decode_seconds(4, per_request_ms=15.0, max_tokens=8) >= 7 * 4 * 0.015
    # Without the per-request cost the same run takes no time the cost model adds.
    assert _decode_seconds(4, per_request_ms=0.0, max_tokens=8) < 7 * 4 * 0.015


# KV sizes from the checkpoint's config


def test_the_released_flash_keeps_891_bytes_a_token_and_a_state_slot_per_sequence() -> None:
    # Per 128-token block, the four KV-source layers only: three of ratio 2 (64 tokens of
    # 288-byte FP4 main KV and 68-byte indexer K each), one of ratio 1 (128 of each), the
    # block padded to lcm(128, 288) = 1152: 3 * (18432 + 4352) + 36864 + 8704 = 113920 ->
    # 114048. The slot: 43 sliding windows of 129 MXFP8 records (68112 bytes, padded to 68128)
    # and three ratio-2 rings of 2 x [2, 512] fp32, padded to lcm(32, 528) = 1056.
    size = KVSize.of_config(RELEASED_TEXT_CONFIG)
    assert size.block_bytes == 114048
    assert size.bytes_per_token == 891
    assert size.state_bytes == 2954688  # 43 * 68128 + 3 * 8192 = 2954080, padded
    assert size.transfer_bytes(3000) == 24 * 114048 + 2954688


def test_only_the_kv_source_layers_keep_rows_in_a_block() -> None:
    sources_only = KVSize.of_config(RELEASED_TEXT_CONFIG)
    every_layer: TextConfig = {**RELEASED_TEXT_CONFIG, "kv_source_layer_ids": list(range(40))}
    assert KVSize.of_config(every_layer).block_bytes > 9 * sources_only.block_bytes
    mxfp8: TextConfig = {**RELEASED_TEXT_CONFIG, "use_fp4_sparse_kv": False}
    assert KVSize.of_config(mxfp8).block_bytes > sources_only.block_bytes


def test_a_state_slot_grows_with_the_tokens_it_can_roll_back() -> None:
    one = KVSize.of_config(RELEASED_TEXT_CONFIG, backtracking_tokens=1)
    six = KVSize.of_config(RELEASED_TEXT_CONFIG, backtracking_tokens=6)
    assert six.block_bytes == one.block_bytes
    assert six.state_bytes - one.state_bytes >= 43 * 5 * 528


def test_a_checkpoints_config_sizes_its_rows(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    layers = read_text_config(str(checkpoint))["num_hidden_layers"]
    assert layers == TEXT_CONFIG["num_hidden_layers"]
    size = KVSize.of_checkpoint(str(checkpoint))
    assert size == KVSize.of_config(TEXT_CONFIG)  # type: ignore[arg-type]
    assert size != KVSize.of_config(RELEASED_TEXT_CONFIG)
    assert read_text_config(str(tmp_path / "nothing")) is RELEASED_TEXT_CONFIG
    assert read_text_config(None) is RELEASED_TEXT_CONFIG


def test_the_option_is_auto_or_a_number_of_bytes() -> None:
    assert all(valid_kv_bytes(v) for v in (None, "auto", "1", "891"))
    assert not any(valid_kv_bytes(v) for v in ("0", "-8", "big", "1.5", ""))
    assert kv_size_option(None, None, 0) is None
    assert kv_size_option("100", None, 0) == KVSize(block_bytes=100 * BLOCK_SIZE, state_bytes=0)
    assert kv_size_option("auto", None, 5) == KVSize.of_config(RELEASED_TEXT_CONFIG, 6)


# The rows a transfer moves


class _Agent:
    """The part of a transfer agent KVMemory uses: it registers and unregisters memory."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, address: int, length: int) -> None:
        self.registered[address] = length

    def unregister(self, address: int) -> None:
        del self.registered[address]


def test_kv_memory_rows_are_the_sizes_asked_for_with_the_provenance_at_their_start() -> None:
    agent = _Agent()
    size = KVSize(block_bytes=114048, state_bytes=2954688)
    memory = KVMemory(5, 3, agent, size)  # type: ignore[arg-type]
    assert agent.registered == {memory.kv_address: 5 * 114048, memory.state_address: 3 * 2954688}
    layout = memory.layout(0, None)
    assert (layout.block_bytes, layout.state_bytes) == (114048, 2954688)
    memory.write_prompt([2, 4], list(range(200)), 1, 7, 99)
    row = memory.blocks[4, : 72 * 8].view(np.int32).reshape(-1, 2)
    assert row[:, 0].tolist() == list(range(128, 200)) and set(row[:, 1].tolist()) == {99}
    assert memory.slots[1, :16].view(np.int32).tolist() == [200, 7, 99, 0]
    memory.close()
    assert agent.registered == {}


def test_kv_memory_without_a_size_keeps_the_provenance_alone() -> None:
    memory = KVMemory(5, 3, _Agent())  # type: ignore[arg-type]
    assert memory.blocks.shape == (5, BLOCK_SIZE * 8) and memory.slots.shape == (3, 16)
