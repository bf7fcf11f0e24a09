"""Every option reaches ResolvedConfig (as given or by its documented derivation), and every
engine-wide setting reaches each rank's EngineSpec, without a server secret."""

from __future__ import annotations

import dataclasses
import pickle
import tempfile
from pathlib import Path
from typing import Any, cast

import pytest

from deepinfer_server.cli import parse_config
from deepinfer_server.config import ResolvedConfig, ServerConfig, resolve
from deepinfer_server.config.resolved import EngineDefaults, is_derived
from deepinfer_server.config.tenants import NamedKey, Tenant
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.backend import OF_THE_RANK
from deepinfer_server.engines.registry import get_backend
from deepinfer_server.engines.simulated.backend import SimulatedOptions
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.rank.spec import RankSpec
from deepinfer_server.server.startup import Prepared, rank_specs

STATE_DIR = "/srv/deepinfer-state"
STORE = "postgresql://responses:pw-789@db/responses"
SECRETS = (
    "key-k1-123",
    "key-k2-456",
    "seal-789",
    "pw-789",
    "key-k3-789",
    "pd-pair-secret-0123456789",
)
#: An --api-key-file naming one more key.
KEY_FILE = Path(tempfile.mkdtemp()) / "api-keys"
KEY_FILE.write_text("# team keys\nteam-a key-k3-789 max_running=2 weight=2\n")
#: A --disaggregation-secret-file.
PD_SECRET_FILE = KEY_FILE.parent / "pd-secret"
PD_SECRET_FILE.write_text(SECRETS[5] + "\n")
TEAM_A = Tenant("team-a", weight=2.0, max_running=2)

#: Every ServerConfig option set to a value other than its default: (command line, as given).
OPTIONS: dict[str, tuple[list[str], Any]] = {
    "model": (["/models/ckpt"], "/models/ckpt"),
    "engine": (["--engine", "simulated"], "simulated"),
    "served_model_name": (
        ["--served-model-name", "flash", "Flash-2", "flash"],
        ("flash", "Flash-2", "flash"),
    ),
    "host": (["--host", "127.0.0.2"], "127.0.0.2"),
    "port": (["--port", "9001"], 9001),
    "expert_parallel_size": (["--ep", "8"], 8),
    "data_parallel_size": (["--dp", "2"], 2),
    "context_parallel_size": (["--cp", "4"], 4),
    "max_model_len": (["--max-model-len", "4096"], 4096),
    "max_num_seqs": (["--max-num-seqs", "3"], 3),
    "max_queued_requests": (["--max-queued-requests", "7"], 7),
    "queue_timeout": (["--queue-timeout", "12.5"], 12.5),
    "clamp_max_tokens": (["--no-clamp-max-tokens"], False),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "2048"], 2048),
    "prefill_attempt_interval": (["--prefill-attempt-interval", "5"], 5),
    "prefill_any_attempt_interval": (["--prefill-any-attempt-interval", "6"], 6),
    "speculative_tokens": (["--speculative-tokens", "3"], 3),
    "enable_prefix_caching": (["--enable-prefix-caching"], True),
    "prefix_cache_scope": (["--prefix-cache-scope", "global"], "global"),
    "prefix_cache_retention_share": (["--prefix-cache-retention-share", "0.5"], 0.5),
    "kv_offload_host_gb": (["--kv-offload-host-gb", "8"], 8.0),
    "kv_offload_store": (["--kv-offload-store", "mooncake"], "mooncake"),
    "kv_offload_store_master": (["--kv-offload-store-master", "10.0.0.9:50051"], "10.0.0.9:50051"),
    "step_timeout": (["--step-timeout", "11"], 11.0),
    "request_timeout": (["--request-timeout", "13"], 13.0),
    "startup_timeout": (["--startup-timeout", "14"], 14.0),
    "default_thinking": (["--default-thinking", "disabled"], "disabled"),
    "api_key": (["--api-key", "key-k1-123", "--api-key", "key-k2-456"], SECRETS[:2]),
    "reasoning_secret": (["--reasoning-secret", "seal-789"], "seal-789"),
    "state_dir": (["--state-dir", STATE_DIR], STATE_DIR),
    "response_store": (["--response-store", STORE], STORE),
    "response_store_ttl": (["--response-store-ttl", "12h"], "12h"),
    "response_store_max_mb": (["--response-store-max-mb", "2"], 2),
    "batch_max_file_mb": (["--batch-max-file-mb", "3"], 3),
    "batch_max_lines": (["--batch-max-lines", "4"], 4),
    "batch_max_active": (["--batch-max-active", "5"], 5),
    "files_key_max_count": (["--files-key-max-count", "7"], 7),
    "batch_concurrency": (["--batch-concurrency", "6"], 6),
    "response_store_key_max_mb": (["--response-store-key-max-mb", "3"], 3),
    "response_store_max_response_mb": (["--response-store-max-response-mb", "4"], 4),
    "allowed_origins": (["--allowed-origins", "https://a"], ("https://a",)),
    "allowed_methods": (["--allowed-methods", "POST"], ("POST",)),
    "allowed_headers": (["--allowed-headers", "x-h"], ("x-h",)),
    "max_request_bytes": (["--max-request-bytes", "4096"], 4096),
    "max_images_per_request": (["--max-images-per-request", "2"], 2),
    "max_image_bytes": (["--max-image-bytes", "2048"], 2048),
    "allowed_media_domains": (
        ["--allowed-media-domains", "Images.Example.com"],
        ("Images.Example.com",),
    ),
    "media_fetch_timeout": (["--media-fetch-timeout", "3"], 3.0),
    "body_read_timeout": (["--body-read-timeout", "4"], 4.0),
    "header_timeout": (["--header-timeout", "5"], 5.0),
    "write_timeout": (["--write-timeout", "6"], 6.0),
    "sse_keepalive_seconds": (["--sse-keepalive-seconds", "0"], 0.0),
    "max_connections": (["--max-connections", "50"], 50),
    "max_queued_compiles_per_key": (["--max-queued-compiles-per-key", "3"], 3),
    "grammar_queue_timeout": (["--grammar-queue-timeout", "7.5"], 7.5),
    "grammar_warmup": (["--no-grammar-warmup"], False),
    "max_header_bytes": (["--max-header-bytes", "20000"], 20000),
    "max_header_line_bytes": (["--max-header-line-bytes", "2048"], 2048),
    "max_receive_buffer_mb": (["--max-receive-buffer-mb", "7"], 7),
    "disable_access_log": (["--disable-access-log"], True),
    "log_requests": (["--log-requests"], True),
    "log_level": (["--log-level", "debug"], "debug"),
    "shutdown_timeout": (["--shutdown-timeout", "2"], 2.0),
    "api_server_count": (["--api-server-count", "2"], 2),
    "stream_interval": (["--stream-interval", "4"], 4),
    "get_load_format": (["--get-load-format", "sglang"], "sglang"),
    "api_key_file": (["--api-key-file", str(KEY_FILE)], str(KEY_FILE)),
    "key_running_share": (["--key-running-share", "0.5"], 0.5),
    "key_queued_share": (["--key-queued-share", "0.25"], 0.25),
    "disaggregation_mode": (["--disaggregation-mode", "prefill"], DisaggregationRole.PREFILL),
    # Its one choice so far: the table cannot set it to anything but its default.
    "disaggregation_transfer_backend": (
        ["--disaggregation-transfer-backend", "mooncake"],
        "mooncake",
    ),
    "disaggregation_bootstrap_port": (["--disaggregation-bootstrap-port", "9100"], 9100),
    "disaggregation_ib_device": (["--disaggregation-ib-device", "mlx5_0"], "mlx5_0"),
    "disaggregation_transport": (["--disaggregation-transport", "tcp"], "tcp"),
    "disaggregation_host": (["--disaggregation-host", "10.0.0.7"], "10.0.0.7"),
    "disaggregation_kv_hold_timeout": (["--disaggregation-kv-hold-timeout", "9"], 9.0),
    "disaggregation_transfer_timeout": (["--disaggregation-transfer-timeout", "8"], 8.0),
    "disaggregation_secret_file": (
        ["--disaggregation-secret-file", str(PD_SECRET_FILE)],
        str(PD_SECRET_FILE),
    ),
}

#: Options with one choice so far (nothing else to set them to).
ONE_CHOICE = {"disaggregation_transfer_backend"}

#: The DERIVED fields of the configuration OPTIONS give, and how `resolve()` derives each.
DERIVED = {
    "engine_options": SimulatedOptions(),  # the backend's group, passed whole
    "served_model_names": ("flash", "Flash-2"),  # repeats dropped
    "expert_parallel_size": 8,  # --dp * --cp must equal --ep
    "data_parallel_size": 2,
    "context_parallel_size": 4,
    "max_model_len": 4096,  # else the engine's
    "prefill_attempt_interval": 5,  # else DEEPINFER_PREFILL_ATTEMPT_INTERVAL, else 70
    "prefill_any_attempt_interval": 6,  # else DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL, else 100
    "speculative_tokens": 3,  # else DEEPINFER_USE_NEXTN_DECODE, else 0
    "enable_prefix_caching": True,  # else the engine's default
    "kv_offload_host_gb": 8.0,  # else the engine's default with the cache on, else 0
    "allowed_media_domains": ("images.example.com",),  # lowercased
    "access_log": False,  # not --disable-access-log
    "api_keys": (*SECRETS[:2], SECRETS[4]),  # else $DEEPINFER_API_KEY; then the file's
    # --api-key's keys are api-key-1, 2, ...; the file's are named there.
    "named_keys": (
        NamedKey(SECRETS[0], Tenant("api-key-1")),
        NamedKey(SECRETS[1], Tenant("api-key-2")),
        NamedKey(SECRETS[4], TEAM_A),
    ),
    "tenants": (Tenant("api-key-1"), Tenant("api-key-2"), TEAM_A),  # else one: default
    "reasoning_secret": "seal-789",  # else $DEEPINFER_REASONING_SECRET
    "state_dir": STATE_DIR,  # absolute, else default_state_dir()
    "response_store": STORE,  # store_url(): sqlite paths made absolute, none -> None
    "response_store_ttl": 12 * 3600.0,  # seconds
    "response_store_max_bytes": 2 * 1024 * 1024,  # MiB
    "response_store_key_max_bytes": 2 * 1024 * 1024,  # MiB, at most the store's cap
    "response_store_max_response_bytes": 2 * 1024 * 1024,  # MiB, at most a key's cap
    "disaggregation_host": "10.0.0.7",  # else --host, else this machine's address
    # The file's bytes, stripped, else $DEEPINFER_DISAGGREGATION_SECRET.
    "disaggregation_secret": SECRETS[5].encode(),
}

CLEARED_VARIABLES = (
    "DEEPINFER_API_KEY",
    "DEEPINFER_REASONING_SECRET",
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
    "DEEPINFER_USE_NEXTN_DECODE",
    "DEEPINFER_STATE_DIR",
    "DEEPINFER_DISAGGREGATION_SECRET",
)


@pytest.fixture(autouse=True)
def _no_fallback_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in CLEARED_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def _every_option_set() -> ResolvedConfig:
    return parse_config([arg for argv, _ in OPTIONS.values() for arg in argv])


def test_the_table_sets_every_option_to_a_value_other_than_its_default() -> None:
    options = {f.name: f for f in dataclasses.fields(ServerConfig)}
    assert sorted(OPTIONS) == sorted(options)
    for name, (_, given) in OPTIONS.items():
        if name in ONE_CHOICE:
            continue
        assert given != options[name].default, name


def test_every_resolved_field_is_its_option_as_given_or_its_documented_derivation() -> None:
    config = _every_option_set()
    resolved_fields = dataclasses.fields(ResolvedConfig)
    assert sorted(f.name for f in resolved_fields if is_derived(f)) == sorted(DERIVED)
    for f in resolved_fields:
        expected = DERIVED[f.name] if is_derived(f) else OPTIONS[f.name][1]
        value = getattr(config, f.name)
        assert (value, type(value)) == (expected, type(expected)), f.name


def test_every_option_reaches_the_resolved_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    # A role needs the pair's secret; from the environment, so the file option stays its own.
    monkeypatch.setenv("DEEPINFER_DISAGGREGATION_SECRET", SECRETS[5] + "-from-the-environment")

    def resolved(server: ServerConfig) -> ResolvedConfig:
        return resolve(server, SimulatedOptions(), EngineDefaults(model_required=False))

    defaults = resolved(ServerConfig())
    for name, (_, given) in OPTIONS.items():
        if name in ONE_CHOICE:
            assert getattr(defaults, name) == given
            continue
        changed = resolved(ServerConfig(**{name: given}))
        assert changed != defaults, f"--{name.replace('_', '-')} reaches no ResolvedConfig field"


def test_an_option_copied_as_given_keeps_its_secrecy() -> None:
    options = {f.name: f for f in dataclasses.fields(ServerConfig)}
    for f in dataclasses.fields(ResolvedConfig):
        if not is_derived(f):
            assert f.repr == options[f.name].repr, f.name
    shown = repr(_every_option_set())
    assert not [secret for secret in SECRETS if secret in shown]


def _specs(config: ResolvedConfig) -> list[RankSpec]:
    prepared = Prepared(
        get_backend(config.engine), "/cache/ckpt", 29500, "", cast(RecipeContext, None)
    )
    return rank_specs(config, prepared, "/tmp/unused")


def test_every_engine_wide_spec_field_is_the_resolved_setting() -> None:
    config = _every_option_set()
    specs = [rank.engine for rank in _specs(config)]
    assert [spec.rank for spec in specs] == [0, 1]
    assert {spec.model for spec in specs} == {"/cache/ckpt"}  # the checkpoint, not MODEL
    spec_fields = dataclasses.fields(specs[0])
    own = [f.name for f in spec_fields if f.metadata == OF_THE_RANK]
    assert own == ["rank", "model", "environment"]  # every other field is engine-wide
    engine_wide = [f for f in spec_fields if f.name not in own]
    for f in engine_wide:
        expected = getattr(config, f.name)
        # A spec default would hide a setting that never reached it.
        assert expected != f.default, f"{f.name}: the configuration keeps the spec's default"
        assert [getattr(spec, f.name) for spec in specs] == [expected] * 2, f.name


def test_no_server_secret_reaches_a_rank() -> None:
    for rank in _specs(_every_option_set()):
        wire = pickle.dumps(rank)
        assert pickle.loads(wire) == rank
        assert not [secret for secret in SECRETS if secret.encode() in wire]
