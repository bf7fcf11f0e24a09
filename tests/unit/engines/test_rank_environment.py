"""Rank environment for DeepInfer: GPU assignment, speculative decoding default, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_server.engines.deepinfer.environment import (
    rank_environment,
    so_builder_cpus,
    visible_gpus,
)
from deepinfer_server.errors import ConfigError

EIGHT = list(range(8))


@pytest.mark.parametrize(
    ("dp", "expected"),
    [
        (1, ["0,1,2,3,4,5,6,7"]),
        (2, ["0,1,2,3", "4,5,6,7"]),
        (4, ["0,1", "2,3", "4,5", "6,7"]),
        (8, ["0", "1", "2", "3", "4", "5", "6", "7"]),
    ],
)
def test_ep8_gpu_assignment(dp: int, expected: list[str]) -> None:
    cp = 8 // dp
    got = [
        rank_environment(rank, EIGHT, cp, 8, 29600, environ={})["CUDA_VISIBLE_DEVICES"]
        for rank in range(dp)
    ]
    assert got == expected


def test_existing_cuda_visible_devices_is_honoured_in_order() -> None:
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7,0,1,2,3"})
    assert gpus == [4, 5, 6, 7, 0, 1, 2, 3]
    env = rank_environment(1, gpus, 4, 8, 29600, environ={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # rank 1's driver GPU is 0


def test_too_few_gpus_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs 8 GPUs but only 4"):
        rank_environment(0, [0, 1, 2, 3], 8, 8, 29600, environ={})
    with pytest.raises(ConfigError, match="integer GPU indices"):
        visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1234-abcd"})


def test_gpus_counted_from_the_driver(tmp_path: Path) -> None:
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (gpus / bus).mkdir(parents=True)
    assert visible_gpus({}, device_root=tmp_path) == [0, 1]
    assert visible_gpus({}, device_root=tmp_path / "nothing") == []


def test_defaults_and_rendezvous() -> None:
    env = rank_environment(0, EIGHT, 8, 8, 29600, environ={"HOME": "/home/u"})
    # Speculative decoding is --speculative-tokens' (DeepInferBackend.rank_environments).
    assert "DEEPINFER_USE_NEXTN_DECODE" not in env
    assert env["DEEPINFER_ENABLE_MTP_VARLEN"] == "0"
    assert env["DEEPINFER_ACCELERATOR"] == "nvidia"
    assert env["DEEPINFER_USE_MULTIMODAL_POOL"] == "0"
    assert env["DEEPINFER_JIT_CACHE_DIR"].endswith("deepinfer/jit")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29600")


def test_user_exported_deepinfer_variables_win() -> None:
    user = {
        "DEEPINFER_ENABLE_MTP_VARLEN": "1",
        "DEEPINFER_JIT_CACHE_DIR": "/cache/jit",
        "DEEPINFER_ACCELERATOR": "ascend",
        "MASTER_ADDR": "10.0.0.5",
    }
    env = rank_environment(0, EIGHT, 8, 8, 29600, environ=user)
    # Not set by the server, so the rank inherits the user's value.
    assert "DEEPINFER_ENABLE_MTP_VARLEN" not in env
    assert "DEEPINFER_JIT_CACHE_DIR" not in env
    assert "DEEPINFER_ACCELERATOR" not in env
    assert env["MASTER_ADDR"] == "10.0.0.5"


def test_grammar_cpus_default_to_what_deepinfer_can_bind() -> None:
    # 2 GPUs on 16 cores: 8 cores per GPU, DeepInfer's default of 4 fits.
    assert so_builder_cpus(1, 2, 16, set(range(16)), None) == "4"
    # 8 GPUs on 2 cores: no core per GPU, so DeepInfer would raise on every structured
    # request; 0 leaves one grammar thread unbound.
    assert so_builder_cpus(3, 8, 2, {0, 1}, None) == "0"
    # A cpuset-limited container: GPU 1's cores 8-11 are outside the affinity mask.
    assert so_builder_cpus(1, 2, 16, set(range(8)), None) == "0"
    assert so_builder_cpus(0, 2, 16, {0, 1}, None) == "2"


def test_exported_grammar_cpus_that_cannot_work_are_refused_naming_the_setting() -> None:
    assert so_builder_cpus(0, 2, 16, set(range(16)), "8") == "8"
    with pytest.raises(ConfigError, match=r"DEEPINFER_SO_BUILDER_CPUS=4.*at most 0"):
        so_builder_cpus(3, 8, 2, {0, 1}, "4")
    with pytest.raises(ConfigError, match="DEEPINFER_SO_BUILDER_CPUS='many'"):
        so_builder_cpus(0, 1, 4, {0, 1, 2, 3}, "many")
