"""`--engine deepinfer` end to end (real rank processes and HTTP) on DeepInfer's own code.

The ranks run DeepInfer 0.1.0's LLMEngine, scheduler and CP workers with the CPU twin's model
(`DEEPINFER_TWIN_DIR`, as `.ci/run` sets it; marker `deepinfer_twin`: without the twin these
tests skip). The twin records what each rank constructed its engine with
(`DEEPINFER_TEST_RECORD_DIR`); "GPUs" are whatever CUDA_VISIBLE_DEVICES names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin import engine_pythonpath
from tests.server import LiveServer, free_port


def _env(record_dir: Path, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": engine_pythonpath(),
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
        "DEEPINFER_TEST_RECORD_DIR": str(record_dir),
        **extra,
    }


def _records(record_dir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (record_dir / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "DeepSeek-V4.1-Flash")


@pytest.mark.deepinfer_twin
def test_ranks_construct_deepinfer_as_configured(checkpoint: Path, tmp_path: Path) -> None:
    env = _env(tmp_path)
    args = [
        str(checkpoint),
        "--served-model-name",
        "deepseek-flash",
        "--ep",
        "8",
        "--dp",
        "2",
        "--max-model-len",
        "16384",
        "--max-num-batched-tokens",
        "16384",
        "--gpu-memory-utilization",
        "0.85",
        "--trust-remote-code",
    ]
    with LiveServer(*args, engine="deepinfer", env=env) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        request: dict[str, Any] = {
            "model": "deepseek-flash",
            "messages": [{"role": "user", "content": "Hello from DeepInfer"}],
            "seed": 7,
            "extra_body": {"thinking": {"type": "disabled"}},
        }
        # Two overlapping requests: least-loaded routing puts one on each rank.
        endless = {**request, "extra_body": {"thinking": {"type": "disabled"}, "ignore_eos": True}}
        stream = client.chat.completions.create(stream=True, max_tokens=2000, **endless)
        chunks = iter(stream)
        next(chunks)
        sampled = {"thinking": {"type": "disabled"}, "top_k": 40}
        reply = client.chat.completions.create(
            **{**request, "extra_body": sampled}, logprobs=True, top_logprobs=2
        )
        assert reply.choices[0].message.content == "Hello from DeepInfer"
        assert reply.choices[0].logprobs is not None
        content_logprobs = reply.choices[0].logprobs.content or []
        assert len(content_logprobs) == reply.usage.completion_tokens  # type: ignore[union-attr]
        assert all(len(entry.top_logprobs) == 2 for entry in content_logprobs)
        assert "Hello from DeepInfer" in "".join(
            next(chunks).choices[0].delta.content or "" for _ in range(8)
        )
        stream.close()
        assert server.stop(signal.SIGTERM) == 0

    for rank, gpus, ignore_eos in [(0, "0,1,2,3", True), (1, "4,5,6,7", False)]:
        records = _records(tmp_path, rank)
        constructed = records[0]
        # DeepInfer forks its multimodal worker before the rank connects to the API process:
        # the forked child must not inherit the rank's links (its Unix sockets).
        assert constructed["threads_at_mm_fork"]
        assert constructed["unix_sockets_at_mm_fork"] == 0
        args_seen = constructed["engine_args"]
        assert args_seen["model"] == args_seen["tokenizer"] == str(checkpoint)
        assert args_seen["served_model_name"] == "deepseek-flash"
        assert (args_seen["engine_rank"], args_seen["data_parallel_size"]) == (rank, 2)
        assert (args_seen["context_parallel_size"], args_seen["expert_parallel_size"]) == (4, 8)
        assert args_seen["max_model_len"] == 16384
        assert args_seen["max_num_batched_tokens"] == 16384
        assert args_seen["gpu_memory_utilization"] == 0.85
        assert args_seen["trust_remote_code"] is True
        assert args_seen["stop_preempted_request"] is False
        assert args_seen["engine_type"] == "NORMAL"
        imported_with = constructed["import_env"]
        assert imported_with["CUDA_VISIBLE_DEVICES"] == gpus
        assert imported_with["DEEPINFER_USE_NEXTN_DECODE"] == "0"
        assert imported_with["DEEPINFER_ACCELERATOR"] == "nvidia"
        assert "DEEPINFER_JIT_CACHE_DIR" in imported_with
        assert int(imported_with["MASTER_PORT"]) > 50
        sampling = [r["payload"] for r in records if r["event"] == "sampling_params"]
        assert sampling and sampling[0]["seq_seed"] == 7
        assert sampling[0]["ignore_eos"] is ignore_eos
        # top_k and top_logprobs reach the engine of the rank that ran the second request.
        assert sampling[0]["top_k"] == (-1 if ignore_eos else 40)
        assert sampling[0]["top_logprobs"] == (0 if ignore_eos else 2)
        assert records[-1]["event"] == "closed"  # every rank closed together on SIGTERM
    # The DP group spans the ranks, as DeepInfer's does: in lockstep, the idle rank stepped
    # exactly as often as the busy one.
    steps = [_records(tmp_path, rank)[-1]["payload"]["steps"] for rank in (0, 1)]
    assert steps[0] == steps[1] > 0


@pytest.mark.deepinfer_twin
def test_dead_cp_worker_fails_the_service(checkpoint: Path, tmp_path: Path) -> None:
    with LiveServer(str(checkpoint), "--ep", "2", engine="deepinfer", env=_env(tmp_path)) as server:
        children = _records(tmp_path, 0)[0]["payload"]  # the engine's children by name
        assert set(children) == {"worker-cp1", "multi-modal-worker-0"}  # CP=2
        workers = [psutil.Process(children["worker-cp1"])]
        workers[0].kill()
        health = server.wait_for_health("failed", timeout=30)
        assert "worker-cp1" in health["reason"]
        server.wait_for_line("engine child process worker-cp1", timeout=10)  # the log names it


def _run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer_server", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.mark.deepinfer_twin
def test_construction_error_ends_the_server_with_the_engines_message(
    checkpoint: Path, tmp_path: Path
) -> None:
    # The twin's node reports a non-SM100 GPU, on which DeepInfer's own start-up raises.
    env = _env(tmp_path, DEEPINFER_TWIN_GPU_CAPABILITY="9.0")
    result = _run_cli(str(checkpoint), "--ep", "2", "--dp", "2", env=env)
    assert result.returncode == 1
    assert "unknown GPU type" in result.stderr
    assert "ready (EP=" not in result.stderr  # the start-up line: it never served


@pytest.mark.deepinfer_twin  # the CLI finds DeepInfer importable before counting GPUs
def test_too_few_gpus_is_refused_before_start(checkpoint: Path, tmp_path: Path) -> None:
    result = _run_cli(str(checkpoint), "--ep", "8", env=_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1"))
    assert result.returncode == 2
    assert "needs 8 GPUs but only 2 are visible" in result.stderr


def test_hung_step_is_detected_by_the_step_timeout() -> None:
    with LiveServer(
        "--ep",
        "2",
        "--dp",
        "2",
        "--sim-fault",
        "step-hang",
        "--sim-fault-rank",
        "1",
        "--sim-fault-after-steps",
        "2",
        "--step-timeout",
        "1",
    ) as server:
        response = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={
                "model": "deepseek-flash",
                "messages": [{"role": "user", "content": "x " * 50}],
                "max_tokens": 40,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert response.status_code == 503
        assert "completed no engine step" in response.json()["error"]["message"]
        health = httpx.get(server.base_url + "/health", timeout=30)
        assert health.status_code == 503 and "hung" in health.json()["reason"]
        ranks = server.rank_processes()
        assert server.stop(signal.SIGTERM) == 0
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)


def _engine_family(server: LiveServer) -> list[psutil.Process]:
    """Every process under the server: ranks, CP workers and multi-modal workers."""
    return psutil.Process(server.process.pid).children(recursive=True)


def _rank(server: LiveServer) -> psutil.Process:
    """The one DP rank (a direct child of the server; its CP worker is spawned too)."""
    (rank,) = [p for p in server.rank_processes() if p.ppid() == server.process.pid]
    return rank


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.deepinfer_twin
def test_sigterm_on_an_idle_server_exits_fast_and_leaves_no_process(
    checkpoint: Path, tmp_path: Path
) -> None:
    with LiveServer(str(checkpoint), "--ep", "2", engine="deepinfer", env=_env(tmp_path)) as server:
        family = _engine_family(server)
        rank = _rank(server)
        # the rank's worker-cp1 (spawned) and multi-modal-worker-0 (forked)
        assert len(rank.children()) == 2
        started = time.monotonic()
        assert server.stop(signal.SIGTERM, timeout=30) == 0
        elapsed = time.monotonic() - started
        _, still_alive = psutil.wait_procs(family, timeout=2)
        assert not _alive(still_alive), [p.pid for p in still_alive]
        assert elapsed < 5.0, f"shutdown took {elapsed:.1f}s"
        assert "did not stop in time" not in server.log


@pytest.mark.deepinfer_twin
def test_a_killed_rank_is_noticed_and_leaves_no_orphan(checkpoint: Path, tmp_path: Path) -> None:
    with LiveServer(str(checkpoint), "--ep", "2", engine="deepinfer", env=_env(tmp_path)) as server:
        rank = _rank(server)
        engine_children = rank.children()
        assert len(engine_children) == 2  # worker-cp1 and multi-modal-worker-0
        rank.kill()
        # The rank's sentinel fires although its forked child inherited it: the child dies too.
        server.wait_for_health("failed", timeout=15)
        _, still_alive = psutil.wait_procs(engine_children, timeout=5)
        assert not _alive(still_alive), [p.pid for p in still_alive]
        assert server.stop(signal.SIGTERM) == 0


@pytest.mark.deepinfer_twin
def test_deepinfer_sees_its_exported_variables_and_none_of_the_servers_secrets(
    checkpoint: Path, tmp_path: Path
) -> None:
    env = _env(
        tmp_path,
        DEEPINFER_USE_NEXTN_DECODE="2",
        DEEPINFER_JIT_CACHE_DIR=str(tmp_path / "jit"),
        DEEPINFER_API_KEY="key-123",
        DEEPINFER_REASONING_SECRET="seal-456",
    )
    with LiveServer(str(checkpoint), "--ep", "2", engine="deepinfer", env=env) as server:
        reply = httpx.post(
            server.base_url + "/v1/chat/completions",
            headers={"Authorization": "Bearer key-123"},  # the HTTP process still has the key
            json={
                "model": str(checkpoint),
                "messages": [{"role": "user", "content": "one two three"}],
                "thinking": {"type": "disabled"},
                "stream": True,
            },
            timeout=30,
        )
        assert "one two three" in "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in reply.text.splitlines()
            if line.startswith("data: {")
        )
        keyless = httpx.get(server.base_url + "/v1/models", timeout=30)
        assert keyless.status_code == 401  # the key is still required
        engine_family = _engine_family(server)
        assert engine_family
        for process in engine_family:
            inherited = process.environ()
            assert "DEEPINFER_API_KEY" not in inherited, process.name()
            assert "DEEPINFER_REASONING_SECRET" not in inherited, process.name()
    imported_with = _records(tmp_path, 0)[0]["import_env"]
    # Exported DeepInfer variables override the server's defaults.
    assert imported_with["DEEPINFER_USE_NEXTN_DECODE"] == "2"
    assert imported_with["DEEPINFER_JIT_CACHE_DIR"] == str(tmp_path / "jit")
    assert "DEEPINFER_API_KEY" not in imported_with
    assert "DEEPINFER_REASONING_SECRET" not in imported_with
