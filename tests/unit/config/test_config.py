"""Command line and configuration: DP/CP/EP derivation, defaults, exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

from deepinfer_server.cli import build_parser, main, parse_config
from deepinfer_server.config import ResolvedConfig, derive_parallelism
from deepinfer_server.engines.backend import EngineSpec
from deepinfer_server.engines.deepinfer.backend import DeepInferBackend, DeepInferOptions
from deepinfer_server.engines.deepinfer.prefix_engine import prefix_cache_settings
from deepinfer_server.engines.registry import get_backend
from deepinfer_server.engines.simulated.backend import SimulatedOptions
from deepinfer_server.engines.simulated.builder import host_tier_settings
from deepinfer_server.engines.simulated.kv_size import kv_size_option
from deepinfer_server.errors import ConfigError
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.server.startup import Prepared, rank_specs
from tests.checkpoint import write_checkpoint


def parallelism(config: ResolvedConfig) -> tuple[int, int, int]:
    """(EP, DP, CP) of a resolved configuration."""
    return (
        config.expert_parallel_size,
        config.data_parallel_size,
        config.context_parallel_size,
    )


@pytest.mark.parametrize(
    ("ep", "dp", "cp", "expected"),
    [
        (1, None, None, (1, 1, 1)),
        (8, None, None, (8, 1, 8)),
        (8, 2, None, (8, 2, 4)),
        (8, 8, None, (8, 8, 1)),
        (8, None, 2, (8, 4, 2)),
        (8, 4, 2, (8, 4, 2)),
        (None, None, None, (1, 1, 1)),
        (None, 2, None, (2, 2, 1)),
        (None, 2, 4, (8, 2, 4)),
    ],
)
def test_parallelism_derivation(
    ep: int | None, dp: int | None, cp: int | None, expected: tuple[int, int, int]
) -> None:
    assert derive_parallelism(ep, dp, cp) == expected


@pytest.mark.parametrize(
    ("ep", "dp", "cp"), [(8, 3, None), (8, None, 3), (8, 2, 2), (8, 0, None), (0, None, None)]
)
def test_inconsistent_parallelism_is_rejected(ep: int, dp: int | None, cp: int | None) -> None:
    with pytest.raises(ConfigError):
        derive_parallelism(ep, dp, cp)


def test_simulated_defaults() -> None:
    config = parse_config(["--engine", "simulated"])
    assert config.served_model_names == ("deepseek-flash",)
    assert config.max_model_len == 32768
    assert parallelism(config) == (1, 1, 1)
    assert config.max_num_seqs == 16
    assert config.max_queued_requests == 512
    assert config.queue_timeout == 300
    assert config.request_timeout == 600
    assert config.startup_timeout == 3600
    assert config.admission_capacity == 16 + 512
    assert config.api_server_count == 1
    assert config.stream_interval == 1
    options = config.engine_options
    assert isinstance(options, SimulatedOptions)
    assert (options.sim_ttft_ms, options.sim_itl_ms, options.sim_tokens_per_step) == (20, 10, 1)


def test_served_name_defaults_to_model_and_long_flags_parse() -> None:
    config = parse_config(
        [
            "/models/ckpt",
            "--engine",
            "deepinfer",
            "--expert-parallel-size",
            "8",
            "--data-parallel-size",
            "2",
            "--max-queued-requests",
            "4",
            "--trust-remote-code",
            "--default-thinking",
            "disabled",
            "--max-num-batched-tokens",
            "8192",
        ]
    )
    assert config.served_model_names == ("/models/ckpt",)
    assert (config.data_parallel_size, config.context_parallel_size) == (2, 4)
    assert config.admission_capacity == 2 * 16 + 4
    assert isinstance(config.engine_options, DeepInferOptions)
    assert config.engine_options.trust_remote_code and config.default_thinking == "disabled"
    assert config.max_num_batched_tokens == 8192


def test_help_documents_every_option() -> None:
    help_text = build_parser().format_help()
    for flag in [
        "--engine",
        "--served-model-name",
        "--ep",
        "--dp",
        "--cp",
        "--max-model-len",
        "--max-num-seqs",
        "--max-queued-requests",
        "--queue-timeout",
        "--request-timeout",
        "--startup-timeout",
        "--gpu-memory-utilization",
        "--trust-remote-code",
        "--default-thinking",
        "--sim-ttft-ms",
        "--sim-itl-ms",
        "--sim-tokens-per-step",
        "--sim-kv-blocks",
        "--get-load-format",
        "--api-server-count",
        "--stream-interval",
        "--disaggregation-transport",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
    ]:
        assert flag in help_text


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--engine", "simulated", "--ep", "8", "--dp", "3"],
        ["--engine", "simulated", "--ep", "8", "--dp", "2", "--cp", "2"],
        ["--engine", "simulated", "--max-num-seqs", "0"],
        ["--engine", "simulated", "--sim-kv-blocks", "1"],
        ["--engine", "simulated", "--sim-kv-bytes-per-token", "big"],
        ["--engine", "simulated", "--sim-kv-bytes-per-token", "0"],
        ["--engine", "simulated", "--sim-itl-ms-per-request", "-1"],
        ["--ep", "8"],  # the default engine needs MODEL
        ["--engine", "simulated", "--api-server-count", "0"],
        ["--engine", "simulated", "--stream-interval", "0"],
        ["--engine", "simulated", "--max-header-line-bytes", "100"],
        ["--engine", "simulated", "--max-header-bytes", "4096"],  # under the line bound
        ["--engine", "simulated", "--max-receive-buffer-mb", "0"],
        ["--engine", "simulated", "--disaggregation-transport", "rdma"],  # no RDMA device
    ],
)
def test_bad_command_lines_exit_2_with_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # In process: the command line is refused before anything starts (an exception escaping
    # `main` would be the console script's traceback).
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer-server: error:")


@pytest.mark.e2e  # the process: start-up's checks run in `run`, after the parse
def test_deepinfer_engine_without_deepinfer_installed(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    result = _cli(str(checkpoint), "--engine", "deepinfer")
    assert result.returncode == 2
    assert "DeepInfer package" in result.stderr and "--engine simulated" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.e2e
def test_checkpoint_directory_without_tokenizer_fails_clearly(tmp_path: Path) -> None:
    result = _cli(str(tmp_path), "--engine", "simulated")
    assert result.returncode == 2
    assert "tokenizer.json" in result.stderr


def test_api_keys_repeat_fall_back_to_the_environment_and_stay_out_of_repr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    config = parse_config(["--engine", "simulated", "--api-key", "k1", "--api-key", "k2"])
    assert config.api_keys == ("k1", "k2")
    assert "k1" not in repr(config)
    assert parse_config(["--engine", "simulated"]).api_keys == ()
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    assert parse_config(["--engine", "simulated"]).api_keys == ("from-env",)
    assert parse_config(["--engine", "simulated", "--api-key", "flag"]).api_keys == ("flag",)


def test_reasoning_secret_falls_back_to_the_environment_and_stays_out_of_repr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEEPINFER_REASONING_SECRET", raising=False)
    assert parse_config(["--engine", "simulated"]).reasoning_secret is None
    config = parse_config(["--engine", "simulated", "--reasoning-secret", "s3cr3t"])
    assert config.reasoning_secret == "s3cr3t"
    assert "s3cr3t" not in repr(config)
    monkeypatch.setenv("DEEPINFER_REASONING_SECRET", "from-env")
    assert parse_config(["--engine", "simulated"]).reasoning_secret == "from-env"


def test_cors_options_repeat() -> None:
    config = parse_config(
        [
            "--engine",
            "simulated",
            "--allowed-origins",
            "https://a",
            "--allowed-origins",
            "https://b",
            "--allowed-methods",
            "POST",
        ]
    )
    assert config.allowed_origins == ("https://a", "https://b")
    assert config.allowed_methods == ("POST",) and config.allowed_headers == ()


def test_several_served_names_first_is_reported() -> None:
    config = parse_config(
        ["--engine", "simulated", "--served-model-name", "flash", "claude-sonnet-4-5", "flash"]
    )
    assert config.served_model_names == ("flash", "claude-sonnet-4-5")
    assert config.served_model_name == "flash"


def test_dp_alone_derives_ep_and_a_mismatch_says_which_flags_to_pass() -> None:
    config = parse_config(["--engine", "simulated", "--dp", "2"])
    assert (config.expert_parallel_size, config.data_parallel_size) == (2, 2)
    with pytest.raises(ConfigError, match="pass --dp 3 without --ep"):
        parse_config(["--engine", "simulated", "--ep", "8", "--dp", "3"])


def test_engine_choices_come_from_the_registry() -> None:
    from deepinfer_server.engines.registry import BACKENDS

    action = next(a for a in build_parser()._actions if a.dest == "engine")
    assert sorted(action.choices or ()) == sorted(BACKENDS)


def test_prefill_intervals_flag_then_deepinfer_variable_then_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", raising=False)
    monkeypatch.delenv("DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL", raising=False)
    config = parse_config(["--engine", "simulated"])
    assert (config.prefill_attempt_interval, config.prefill_any_attempt_interval) == (70, 100)
    monkeypatch.setenv("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "9")
    assert parse_config(["--engine", "simulated"]).prefill_attempt_interval == 9
    config = parse_config(
        [
            *("--engine", "simulated", "--prefill-attempt-interval", "3"),
            *("--prefill-any-attempt-interval", "4"),
        ]
    )
    assert (config.prefill_attempt_interval, config.prefill_any_attempt_interval) == (3, 4)
    with pytest.raises(ConfigError, match="--prefill-attempt-interval must be at least 1"):
        parse_config(["--engine", "simulated", "--prefill-attempt-interval", "0"])
    monkeypatch.setenv("DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL", "x")
    with pytest.raises(ConfigError, match="DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"):
        parse_config(["--engine", "simulated"])


def test_deepinfer_ranks_get_the_prefill_intervals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = parse_config(
        ["/models/ckpt", "--engine", "deepinfer", "--dp", "2", "--prefill-attempt-interval", "5"]
    )
    for environment in DeepInferBackend().rank_environments(config, 29500):
        assert environment["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] == "5"
        assert environment["DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"] == "100"


def test_speculative_tokens_flag_then_deepinfer_variable_then_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    assert parse_config(["--engine", "simulated"]).speculative_tokens == 0
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert parse_config(["--engine", "simulated"]).speculative_tokens == 2
    flag = ["--engine", "simulated", "--speculative-tokens", "4"]
    assert parse_config(flag).speculative_tokens == 4
    with pytest.raises(ConfigError, match="--speculative-tokens must not be negative"):
        parse_config(["--engine", "simulated", "--speculative-tokens", "-1"])
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "five")
    with pytest.raises(ConfigError, match="DEEPINFER_USE_NEXTN_DECODE='five'"):
        parse_config(["--engine", "simulated"])


def test_deepinfer_ranks_get_the_speculative_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")  # the flag wins over an export
    config = parse_config(
        ["/models/ckpt", "--engine", "deepinfer", "--dp", "2", "--speculative-tokens", "3"]
    )
    for environment in DeepInferBackend().rank_environments(config, 29500):
        assert environment["DEEPINFER_USE_NEXTN_DECODE"] == "3"
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
    config = parse_config(["/models/ckpt", "--engine", "deepinfer"])
    (environment,) = DeepInferBackend().rank_environments(config, 29500)
    assert environment["DEEPINFER_USE_NEXTN_DECODE"] == "0"  # DeepInfer's own default is 5
    prepared = Prepared(get_backend("simulated"), None, 29500, "", cast(RecipeContext, None))
    simulated = parse_config(["--engine", "simulated", "--speculative-tokens", "3"])
    assert [spec.engine.speculative_tokens for spec in rank_specs(simulated, prepared, "/x")] == [3]


def test_the_simulated_engine_takes_one_way_of_emitting_several_tokens_a_step() -> None:
    config = parse_config(
        ["--engine", "simulated", "--speculative-tokens", "2", "--sim-tokens-per-step", "3"]
    )
    with pytest.raises(ConfigError, match="give one of them"):
        get_backend("simulated").preflight(config, None)


def test_prefix_caching_defaults_per_engine_and_the_flags_reach_every_rank() -> None:
    deepinfer = parse_config(["/models/ckpt", "--engine", "deepinfer", "--dp", "2"])
    assert deepinfer.enable_prefix_caching is False  # until validated on GPUs
    assert parse_config(["--engine", "simulated"]).enable_prefix_caching is True
    on = parse_config(["/models/ckpt", "--engine", "deepinfer", "--enable-prefix-caching"])
    assert on.enable_prefix_caching is True
    off = parse_config(["--engine", "simulated", "--no-enable-prefix-caching"])
    assert off.enable_prefix_caching is False
    config = parse_config(["--engine", "simulated", "--dp", "2", "--enable-prefix-caching"])
    prepared = Prepared(get_backend("simulated"), None, 29500, "", cast(RecipeContext, None))
    specs = rank_specs(config, prepared, "/tmp/unused")
    assert [spec.engine.enable_prefix_caching for spec in specs] == [True, True]


def test_the_host_tier_defaults_per_engine_and_deepinfer_takes_it_on_one_cp_worker() -> None:
    simulated = parse_config(["--engine", "simulated"])
    assert simulated.kv_offload_host_gb == 64.0
    assert (
        parse_config(["--engine", "simulated", "--no-enable-prefix-caching"]).kv_offload_host_gb
        == 0
    )
    prepared = Prepared(get_backend("simulated"), None, 29500, "", cast(RecipeContext, None))
    sized = parse_config(["--engine", "simulated", "--kv-offload-host-gb", "2"])
    (spec,) = rank_specs(sized, prepared, "/x")
    assert spec.engine.kv_offload_host_gb == 2.0
    # The tier copies the checkpoint's rows (the released V4.1-Flash's without one), or the
    # size --sim-kv-bytes-per-token gives.
    settings = host_tier_settings(spec.engine, sized.engine_options, None)
    assert settings is not None and settings.budget_bytes == 2_000_000_000
    assert (settings.block_bytes, settings.state_bytes) == (114_048, 2_954_688)
    given = parse_config(["--engine", "simulated", "--sim-kv-bytes-per-token", "100"])
    (spec,) = rank_specs(given, prepared, "/x")
    settings = host_tier_settings(spec.engine, given.engine_options, kv_size_option("100", None, 0))
    assert settings is not None and settings.block_bytes == 128 * 100
    assert parse_config(["/models/ckpt", "--engine", "deepinfer"]).kv_offload_host_gb == 0
    with pytest.raises(ConfigError, match="must not be negative"):
        parse_config(["--engine", "simulated", "--kv-offload-host-gb", "-1"])
    tier = ["--enable-prefix-caching", "--kv-offload-host-gb", "8"]
    config = parse_config(["/models/ckpt", "--engine", "deepinfer", *tier])
    DeepInferBackend().preflight(config, None)  # accepted; off unless given
    spec = EngineSpec(
        rank=0, model="/models/ckpt", served_model_name="flash", data_parallel_size=1,
        context_parallel_size=1, expert_parallel_size=1, max_model_len=4096, max_num_seqs=8,
        max_num_batched_tokens=None, engine_options=config.engine_options,
        kv_offload_host_gb=config.kv_offload_host_gb,
    )  # fmt: skip
    settings = prefix_cache_settings(spec)
    assert settings.host_tier_bytes == 8_000_000_000
    assert (settings.host_bandwidth, settings.prefill_tokens_per_s) == (50e9, 20_000.0)
    two_cp = ["/models/ckpt", "--engine", "deepinfer", "--context-parallel-size", "2", *tier]
    with pytest.raises(ConfigError, match="needs --context-parallel-size 1"):
        DeepInferBackend().preflight(parse_config(two_cp), None)


def test_the_store_tier_needs_its_master_and_the_host_tier() -> None:
    backend = get_backend("simulated")
    store = ["--engine", "simulated", "--kv-offload-store", "mooncake"]
    with pytest.raises(ConfigError, match="needs --kv-offload-store-master"):
        backend.preflight(parse_config(store), None)
    with_master = [*store, "--kv-offload-store-master", "127.0.0.1:50051"]
    with pytest.raises(ConfigError, match="needs --kv-offload-host-gb"):
        backend.preflight(parse_config([*with_master, "--kv-offload-host-gb", "0"]), None)
    with pytest.raises(ConfigError, match="needs --kv-offload-store"):
        master_only = ["--engine", "simulated", "--kv-offload-store-master", "127.0.0.1:50051"]
        backend.preflight(parse_config(master_only), None)
    config = parse_config(with_master)
    backend.preflight(config, None)
    prepared = Prepared(backend, None, 29500, "", cast(RecipeContext, None))
    (spec,) = rank_specs(config, prepared, "/x")
    assert (spec.engine.kv_offload_store, spec.engine.kv_offload_store_master) == (
        "mooncake",
        "127.0.0.1:50051",
    )
    # DeepInfer's engine restores through its host tier too: refused without it.
    deepinfer = ["/models/ckpt", "--engine", "deepinfer", *with_master[2:]]
    with pytest.raises(ConfigError, match="it needs --kv-offload-host-gb above 0"):
        DeepInferBackend().preflight(parse_config([*deepinfer, "--kv-offload-host-gb", "0"]), None)
    no_master = parse_config([*deepinfer[:-2], "--kv-offload-host-gb", "1"])
    with pytest.raises(ConfigError, match="needs --kv-offload-store-master"):
        DeepInferBackend().preflight(no_master, None)
    sized = ["--kv-offload-store-segment-gb", "8", "--kv-offload-store-buffer-gb", "0.5"]
    hosted = parse_config([*deepinfer, "--kv-offload-host-gb", "1", *sized])
    DeepInferBackend().preflight(hosted, None)
    spec = EngineSpec(
        rank=0, model="/models/ckpt", served_model_name="flash", data_parallel_size=1,
        context_parallel_size=1, expert_parallel_size=1, max_model_len=4096, max_num_seqs=8,
        max_num_batched_tokens=None, engine_options=hosted.engine_options,
        kv_offload_host_gb=1.0, kv_offload_store="mooncake",
        kv_offload_store_master="127.0.0.1:50051",
    )  # fmt: skip
    store = prefix_cache_settings(spec).store
    assert store is not None and (store.master, store.hostname) == ("127.0.0.1:50051", "127.0.0.1")
    assert (store.segment_bytes, store.buffer_bytes) == (8 * 10**9, 5 * 10**8)
    with pytest.raises(ConfigError, match="--kv-offload-store-segment-gb must be positive"):
        parse_config([*deepinfer, "--kv-offload-store-segment-gb", "0"])
    with pytest.raises(ConfigError, match="--sim-store-bandwidth-gbps must be positive"):
        parse_config(["--engine", "simulated", "--sim-store-bandwidth-gbps", "0"])
    with pytest.raises(ConfigError, match="--sim-store-lookup-timeout-ms must be positive"):
        parse_config(["--engine", "simulated", "--sim-store-lookup-timeout-ms", "0"])
