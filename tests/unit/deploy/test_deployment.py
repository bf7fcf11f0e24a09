"""Deployment artefacts checked without Docker or GPUs: Dockerfile (hadolint), the dependency
check, the entrypoint, the GPUStack backend YAML, and the operator's validation script."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from deepinfer_server.cli import parse_config
from deepinfer_server.config import ResolvedConfig
from tests.lanes import import_lane
from tests.paths import REPO
from tests.server import LiveServer, refusing_port

ROOT = REPO
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
BACKEND_YAML = ROOT / "gpustack-deepinfer-server-backend.yaml"
GPUSTACK_REASON = (
    "needs GPUStack (pip install '.[test,gpustack]' in a venv without the grammar extra: "
    "GPUStack pins a newer transformers; Python < 3.13)"
)

# Keys GPUStack 2.3.0's POST /v2/inference-backends/from-yaml keeps (routes/inference_backend.py).
IMPORT_KEYS = {
    "backend_name",
    "version_configs",
    "default_version",
    "default_backend_param",
    "default_run_command",
    "default_entrypoint",
    "health_check_path",
    "description",
    "default_env",
    "enabled",
    "backend_source",
    "parameter_format",
    "common_parameters",
}
VERSION_KEYS = {"image_name", "run_command", "entrypoint", "custom_framework", "env"}
_PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_.]*)\}\}")


def parallelism(config: ResolvedConfig) -> tuple[int, int, int]:
    """(EP, DP, CP) of a resolved configuration."""
    return (
        config.expert_parallel_size,
        config.data_parallel_size,
        config.context_parallel_size,
    )


def _load_dependency_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_dependencies", ROOT / "docker" / "check_dependencies.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _load_dependency_check()

NCCL_OVERRIDE = (
    'torch 2.13.0+cu132 has requirement nvidia-nccl-cu13==2.29.7; platform_system == "Linux", '
    "but you have nvidia-nccl-cu13 2.32.3."
)


# Dockerfile


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_ignored_hadolint_rule_is_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for index, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[index - 1].startswith("#") and "hadolint" not in lines[index - 1], (
                f"line {index + 1}: an ignored rule needs a comment that says why"
            )


def test_dockerfile_pins_and_cache_layout() -> None:
    text = DOCKERFILE.read_text()
    for arg in [
        "MAX_JOBS=8",
        "FLASH_MLA_SKIP_REG_SPILL_CHECK=",
        "CUDA_VERSION=13.2.0",
        "PYTHON_VERSION=3.12",
        "DEEPSEEK_RECIPE_VERSION=0.2.0",
        "DEEPINFER_COMMIT=9bd9cf243fc53ef9afbf8f04d391d989117d6ab9",
    ]:
        assert f"ARG {arg}" in text
    assert "HF_HOME=/cache/huggingface" in text and "DEEPINFER_JIT_CACHE_DIR=/cache/jit" in text
    assert 'VOLUME ["/cache"]' in text
    assert text.count("-devel-ubuntu") == 2  # the runtime stage keeps the CUDA JIT toolchain
    assert 'ENTRYPOINT ["/usr/local/bin/deepinfer-entrypoint"]' in text


def test_runtime_stage_has_libnuma_and_copies_deepinfer_without_git_history() -> None:
    build, runtime = DOCKERFILE.read_text().split(" AS runtime", 1)
    assert re.search(r"apt-get install[^\n]*(?:\\\n[^\n]*)*\blibnuma1\b", runtime)
    copy = build.index("COPY src /opt/deepinfer-server/src")
    assert "find /opt/DeepInfer -name .git -prune -exec rm -rf {} +" in build[:copy]
    assert "COPY --from=build /opt/DeepInfer /opt/DeepInfer" in runtime


def test_documented_build_arguments_exist_in_the_dockerfile() -> None:
    docs = (ROOT / "docs" / "operations" / "docker.md").read_text()
    assert "docker build --build-arg MAX_JOBS=8 -t deepinfer-server:latest ." in docs
    for name in set(re.findall(r"--build-arg (\w+)=", docs)):
        assert re.search(rf"^ARG {name}=", DOCKERFILE.read_text(), re.MULTILINE), name


# Dependency check


@pytest.mark.parametrize(
    ("output", "ok"),
    [
        ("No broken requirements found.\n", True),
        (NCCL_OVERRIDE + "\n", True),
        (NCCL_OVERRIDE.replace("2.32.3.", "2.31.0."), False),  # another NCCL version
        (NCCL_OVERRIDE.replace("==2.29.7", "==2.28.9"), False),  # another torch pin
        (NCCL_OVERRIDE.replace("torch 2.13.0+cu132", "deep-ep 2.5.0"), False),  # another package
        (
            NCCL_OVERRIDE + "\nfastapi 0.128.0 has requirement starlette<0.51,>=0.40, but you have "
            "starlette 0.52.0.",
            False,
        ),
        ("deepinfer 0.1.0 requires xgrammar, which is not installed.", False),
        ("something pip never printed before", False),
    ],
    ids=[
        "clean",
        "nccl-override",
        "other-nccl",
        "other-pin",
        "other-package",
        "extra-conflict",
        "missing",
        "unparseable",
    ],
)
def test_dependency_check_allows_only_the_exact_nccl_override(output: str, ok: bool) -> None:
    allowed, failing = check.evaluate(output, check.DEFAULT_ALLOWANCES)
    assert (not failing) is ok
    if ok and "nccl" in output:
        assert allowed == [NCCL_OVERRIDE]


def test_dependency_check_command(tmp_path: Path) -> None:
    recorded = tmp_path / "pip-check.txt"
    recorded.write_text(NCCL_OVERRIDE + "\n")
    script = ROOT / "docker" / "check_dependencies.py"
    passed = subprocess.run(
        [sys.executable, str(script), "--pip-check-output", str(recorded)],
        capture_output=True,
        text=True,
    )
    assert passed.returncode == 0 and "allowed (intentional override)" in passed.stdout
    recorded.write_text(NCCL_OVERRIDE.replace("2.32.3.", "2.33.0.") + "\n")
    failed = subprocess.run(
        [sys.executable, str(script), "--pip-check-output", str(recorded)],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1 and "CONFLICT" in failed.stdout


# Entrypoint


@pytest.fixture()
def fake_server_bin(tmp_path: Path) -> Path:
    fake = tmp_path / "deepinfer-server"
    fake.write_text('#!/bin/bash\necho "pid=$$ memlock=$(ulimit -l) stack=$(ulimit -s) args=$*"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def _limits_raisable() -> bool:
    return subprocess.run(["bash", "-c", "ulimit -l unlimited && ulimit -s 65536"]).returncode == 0


def _run_entrypoint(path: Path, *prefix: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, str(ENTRYPOINT), "/models/x", "--ep", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PATH": f"{path}:{os.environ['PATH']}", **env},
    )


def test_entrypoint_sets_limits_and_execs_the_server(fake_server_bin: Path) -> None:
    hard_memlock = subprocess.run(["bash", "-c", "ulimit -H -l"], capture_output=True, text=True)
    memlock = hard_memlock.stdout.strip()
    process = _run_entrypoint(
        fake_server_bin, DEEPINFER_MEMLOCK_LIMIT=memlock, DEEPINFER_STACK_LIMIT_KB="16384"
    )
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"pid={process.pid} " in out  # exec: the server replaced the entrypoint's process
    assert f"memlock={memlock} stack=16384 args=/models/x --ep 8" in out


@pytest.mark.skipif(not _limits_raisable(), reason="this sandbox cannot raise locked memory")
def test_entrypoint_default_limits(fake_server_bin: Path) -> None:
    out, err = _run_entrypoint(fake_server_bin).communicate(timeout=30)
    assert "memlock=unlimited stack=65536 args=/models/x --ep 8" in out, err


def test_entrypoint_explains_a_limit_it_cannot_raise(fake_server_bin: Path) -> None:
    prefix: tuple[str, ...] = ()
    if _limits_raisable():
        if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
            pytest.skip("needs util-linux setpriv and prlimit to drop CAP_SYS_RESOURCE")
        prefix = (
            "prlimit",
            "--memlock=65536:65536",
            "setpriv",
            "--inh-caps=-sys_resource",
            "--bounding-set=-sys_resource",
        )
    process = _run_entrypoint(fake_server_bin, *prefix)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 1
    assert "cannot raise the locked-memory limit to unlimited" in err
    assert "--ulimit memlock=-1" in err
    assert "pid=" not in out  # the server was not started


# GPUStack backend YAML


@pytest.fixture(scope="module")
def backend() -> dict[str, Any]:
    document = yaml.safe_load(BACKEND_YAML.read_text())
    assert isinstance(document, dict), "GPUStack's YAML import takes one object"
    return document


def render(template: str, **variables: object) -> str:
    """GPUStack's placeholder substitution (utils/template.py): {{name}}, no spaces."""
    return _PLACEHOLDER.sub(lambda m: str(variables.get(m.group(1), m.group(0))), template)


def test_backend_keys_survive_the_yaml_import(backend: dict[str, Any]) -> None:
    assert set(backend) - IMPORT_KEYS == {"icon"}  # icon is dropped by the import, kept for later
    assert backend["backend_name"] == "DeepInfer-server-custom"
    assert backend["backend_name"].endswith("-custom")
    assert backend["default_version"] in backend["version_configs"]
    for version in backend["version_configs"].values():
        assert set(version) <= VERSION_KEYS
        assert version["image_name"] == "quay.io/enjoydemo/deepinfer-server:latest"
        assert version["custom_framework"] == "cuda"
    assert backend["health_check_path"] == "/health"
    assert backend["icon"].startswith("https://")
    assert backend["default_entrypoint"] == "/usr/local/bin/deepinfer-entrypoint"
    assert backend["default_env"] == {
        "DEEPINFER_JIT_CACHE_DIR": "/var/lib/gpustack/cache/deepinfer/jit",
        "GPUSTACK_HOST_IPC": "true",
        "NCCL_IB_HCA": "=mlx5_0",
        "NCCL_IB_SL": "0",
        "EP_OVERRIDE_RDMA_SL": "0",
    }
    assert backend["description"]


def test_no_unrendered_placeholders(backend: dict[str, Any]) -> None:
    text = BACKEND_YAML.read_text()
    assert not re.search(r"\{\{\s+|\s+\}\}", text), "GPUStack does not substitute {{ spaced }}"
    used = set(_PLACEHOLDER.findall(backend["default_run_command"]))
    assert used == {"model_path", "port", "model_name", "gpu_count"}


@pytest.mark.parametrize("gpus", [8, 4, 2, 1])
def test_rendered_command_parses_into_ep_dp_cp(backend: dict[str, Any], gpus: int) -> None:
    command = render(
        backend["default_run_command"],
        model_path="/var/lib/gpustack/cache/huggingface/ds flash",
        port=40123,
        model_name="deepseek-v4.1-flash",
        gpu_count=gpus,
    )
    argv = shlex.split(command) + [
        t for p in backend["default_backend_param"] for t in p.split("=", 1)
    ]
    config = parse_config(argv)
    assert config.model == "/var/lib/gpustack/cache/huggingface/ds flash"
    assert parallelism(config) == (gpus, 1, gpus)
    assert (config.host, config.port) == ("0.0.0.0", 40123)
    assert config.served_model_names == ("deepseek-v4.1-flash",)
    assert config.startup_timeout == 3600
    assert config.engine_options.trust_remote_code  # type: ignore[attr-defined]
    assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens) == (
        32768,
        16,
        32768,
    )


@pytest.mark.parametrize(
    ("role_params", "expected"),
    [([], (4, 1, 4)), (["--data-parallel-size=4"], (4, 4, 1))],
    ids=["prefill", "decode"],
)
def test_prefill_and_decode_deployments_split_one_worker(
    backend: dict[str, Any], role_params: list[str], expected: tuple[int, int, int]
) -> None:
    """docs/operations/gpustack.md's split of one 8-GPU worker: four GPUs per role; the decode
    deployment's extra --data-parallel-size=4 overrides the command's 1 (CP=1, as a COMPLETION
    engine needs)."""
    command = render(
        backend["default_run_command"], model_path="/m", port=1, model_name="m", gpu_count=4
    )
    config = parse_config([*shlex.split(command), *role_params])
    assert parallelism(config) == expected
    for option in ("--disaggregation-mode", "--disaggregation-bootstrap-port"):
        assert option in backend["common_parameters"]


def test_gpustack_packaged_deepinfer_entry_flags_parse() -> None:
    """The command GPUStack's own packaged `DeepInfer` entry renders (8 GPUs), plus its hints."""
    argv = [
        "/var/lib/gpustack/cache/huggingface/deepseek-ai/DeepSeek-V4.1-Flash",
        "--host",
        "0.0.0.0",
        "--port",
        "40123",
        "--served-model-name",
        "deepseek-v4.1-flash",
        "--expert-parallel-size",
        "8",
        "--data-parallel-size",
        "1",
        "--trust-remote-code",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "32768",
        "--startup-timeout",
        "3600",
        "--gpu-memory-utilization=0.85",
        "--context-parallel-size=8",
        "--request-timeout=900",
    ]
    config = parse_config(argv)
    assert parallelism(config) == (8, 1, 8)
    assert config.request_timeout == 900
    assert config.engine_options.gpu_memory_utilization == 0.85  # type: ignore[attr-defined]


@pytest.mark.gpustack
def test_backend_validates_with_gpustacks_own_classes(backend: dict[str, Any]) -> None:
    schemas = import_lane("gpustack", "gpustack.schemas.inference_backend", GPUSTACK_REASON)
    routes = import_lane("gpustack", "gpustack.routes.inference_backend", GPUSTACK_REASON)
    data = {key: backend[key] for key in IMPORT_KEYS if key in backend}
    data["version_configs"] = schemas.VersionConfigDict(
        root={name: schemas.VersionConfig(**cfg) for name, cfg in data["version_configs"].items()}
    )
    routes.validate_custom_suffix(data["backend_name"], None)
    model = schemas.InferenceBackendCreate.model_validate(data)
    command = model.replace_command_param(
        version=None,
        model_path="/m",
        port=40000,
        worker_ip="10.0.0.5",
        model_name="x",
        gpu_count=8,
        gpu_ids=list(range(8)),
    )
    config = parse_config(shlex.split(command))
    assert parallelism(config) == (8, 1, 8)
    assert model.get_container_entrypoint() == ["/usr/local/bin/deepinfer-entrypoint"]


# Operator validation script


def test_validate_deployment_script_passes_against_a_live_server(shared_server: LiveServer) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "validate-deployment.sh"), shared_server.base_url, "4096"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS streamed tool call: get_weather" in result.stdout
    assert "PASS /v1/models max_model_len: 4096" in result.stdout


def test_validate_deployment_script_fails_on_a_wrong_context(shared_server: LiveServer) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "validate-deployment.sh"), shared_server.base_url, "32768"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 1
    assert "expected 32768" in result.stdout


def test_validate_deployment_script_fails_without_a_server() -> None:
    with refusing_port() as port:
        result = subprocess.run(
            ["bash", str(ROOT / "scripts" / "validate-deployment.sh"), f"http://127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHON": sys.executable},
        )
    assert result.returncode != 0
