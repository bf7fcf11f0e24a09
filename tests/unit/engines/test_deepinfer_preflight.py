"""Preflight checks that mirror DeepInfer 0.1.0's own start-up checks (before any rank starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.deepinfer.preflight import (
    check_batch_limits,
    check_checkpoint,
    check_role,
    check_speculation,
    run_preflight,
)
from deepinfer_server.errors import ConfigError
from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin import engine_pythonpath


@pytest.mark.parametrize(
    ("max_model_len", "seqs", "batched", "env", "flag"),
    [
        # config.py:209-212: without chunked prefill a prompt must fit in one step
        (32768, 16, 16384, {}, "--max-model-len 32768"),
        # config.py:224-226: room for every running sequence and its draft tokens
        (4096, 1025, 4096, {}, "--max-num-seqs 1025"),
        # scheduler.hpp:116: at least one KV block per step
        (64, 4, 100, {}, "at least 128"),
        # scheduler.hpp:120-121
        (8192, 16, None, {"DEEPINFER_PREFILL_MAX_SUM_SEQLEN_K": "4096"}, "SUM_SEQLEN_K=4096"),
    ],
)
def test_batch_limits_the_engine_rejects_are_refused(
    max_model_len: int, seqs: int, batched: int | None, env: dict[str, str], flag: str
) -> None:
    with pytest.raises(ConfigError, match=flag):
        check_batch_limits(max_model_len, seqs, batched, env, nextn=3)


def test_batch_limits_the_engine_accepts_pass() -> None:
    check_batch_limits(32768, 16, None, {})  # DeepInfer's default: max(len, 4096, seqs*(1+n))
    check_batch_limits(16384, 16, 16384, {}, nextn=5)
    check_batch_limits(32768, 256, 32768, {})
    check_batch_limits(4096, 1024, 4096, {}, nextn=3)  # 1024 x 4 fits exactly
    with pytest.raises(ConfigError, match="--speculative-tokens"):
        check_batch_limits(4096, 1024, 4096, {}, nextn=4)


def test_speculation_needs_the_checkpoints_draft_layers(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    run_preflight(32768, 16, None, str(checkpoint), environ={}, speculative_tokens=5)
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 0
    (checkpoint / "config.json").write_text(json.dumps(config))
    run_preflight(32768, 16, None, str(checkpoint), environ={}, speculative_tokens=0)
    with pytest.raises(ConfigError, match=r"no draft layers.*--speculative-tokens 0"):
        run_preflight(32768, 16, None, str(checkpoint), environ={}, speculative_tokens=2)


def test_a_confidence_temperature_list_needs_one_entry_per_draft() -> None:
    variable = "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"
    check_speculation(3, None, {variable: "0.5,0.7,0.9"})
    check_speculation(3, None, {variable: "0.5"})  # one for every position
    check_speculation(0, None, {variable: "0.5,0.7"})  # drafts off: never read
    with pytest.raises(ConfigError, match="has 2 temperatures but --speculative-tokens is 3"):
        check_speculation(3, None, {variable: "0.5,0.7"})


def test_a_complete_checkpoint_passes(tmp_path: Path) -> None:
    run_preflight(32768, 16, None, str(write_checkpoint(tmp_path / "ckpt")), environ={})


def test_a_checkpoint_without_the_safetensors_index_is_refused(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    (checkpoint / "model.safetensors.index.json").unlink()
    with pytest.raises(ConfigError, match=r"no model\.safetensors\.index\.json"):
        check_checkpoint(checkpoint)


def test_a_missing_shard_is_refused(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    (checkpoint / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"missing shards.*model-00001-of-00001"):
        check_checkpoint(checkpoint)


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    (checkpoint / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(ConfigError, match="DeepseekV41ForCausalLM"):
        check_checkpoint(checkpoint)


@pytest.mark.e2e  # the server process
@pytest.mark.deepinfer_twin  # the CLI finds DeepInfer importable before its own checks
def test_the_cli_refuses_before_any_rank_starts(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": engine_pythonpath(), "CUDA_VISIBLE_DEVICES": "0"}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "deepinfer_server", str(checkpoint)),
            *("--port", "0", "--max-model-len", "8192"),
            *("--max-num-batched-tokens", "4096"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("deepinfer-server: error: --max-num-batched-tokens 4096")
    assert "rank" not in result.stderr.lower()


def test_a_transformers_release_that_breaks_deepinfers_tokenizer_is_refused() -> None:
    from deepinfer_server.engines.deepinfer.preflight import check_transformers

    check_transformers("4.50.0")
    check_transformers(None)  # not installed: DeepInfer's own import will say so
    with pytest.raises(ConfigError, match=r"transformers 4\.50\.0.*with transformers 5\.24\.0"):
        check_transformers("5.24.0")


@pytest.mark.parametrize("mode", [DisaggregationRole.PREFILL, DisaggregationRole.DECODE])
def test_a_role_refuses_what_it_would_move_or_keep_wrongly(mode: DisaggregationRole) -> None:
    check_role(mode, False, {"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "0"})
    with pytest.raises(ConfigError, match="--enable-prefix-caching"):
        check_role(mode, True, {})
    # DeepInfer's boolean rule: anything but "0", "", "false" and "False" turns it on.
    with pytest.raises(ConfigError, match="DEEPINFER_PREFILL_STORE_EXTRA_STATE"):
        check_role(mode, False, {"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "yes"})
