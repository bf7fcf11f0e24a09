#!/usr/bin/env python3
"""GuideLLM 0.8.x against deepinfer-server on the simulated engine, offline, in one command.

    python bench/guidellm_run.py [--guidellm PATH] [--seconds 8] [--out bench/guidellm-out]

Writes the simulated engine's embedded tokenizer (tokenizer.json, tokenizer_config.json) to a
directory for GuideLLM's `huggingface_auto` tokenizer, starts the server, runs a short sweep
with synthetic 64-token prompts and 32-token outputs (GuideLLM sends max_completion_tokens,
ignore_eos, stream_options.continuous_usage_stats and content as text parts), and exits 0 only
if every benchmark completed requests with zero errors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Server

from deepinfer_server.model.tokenizer import write_embedded_tokenizer


def errors_in(report: dict[str, object]) -> list[str]:
    problems = []
    benchmarks = report.get("benchmarks") or []
    assert isinstance(benchmarks, list)
    if not benchmarks:
        problems.append("no benchmarks in the report")
    for index, benchmark in enumerate(benchmarks):
        totals = benchmark["scheduler_state"]
        done = totals.get("successful_requests", 0)
        failed = totals.get("errored_requests", 0)
        if failed or not done:
            problems.append(f"benchmark {index}: {done} successful, {failed} errored")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The client lane's installation (scripts/install-test-clients.sh), else the one on PATH.
    lane = Path(__file__).resolve().parents[1] / ".test-clients" / "guidellm" / "bin" / "guidellm"
    default = str(lane) if lane.exists() else shutil.which("guidellm") or "guidellm"
    parser.add_argument("--guidellm", default=default)
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each sweep step")
    parser.add_argument("--out", type=Path, default=Path("bench/guidellm-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as scratch,
        Server.deepinfer(
            "--sim-ttft-ms",
            "10",
            "--sim-itl-ms",
            "5",
            "--max-num-seqs",
            "64",
        ) as server,
    ):
        tokenizer = Path(scratch) / "tokenizer"
        write_embedded_tokenizer(tokenizer)
        report = args.out / "benchmarks.json"
        command = [
            args.guidellm,
            "run",
            "--backend",
            f"kind=openai_http,target=http://127.0.0.1:{server.port}",
            "--profile",
            "kind=sweep,sweep_size=4",
            "--constraint",
            f"kind=max_duration,seconds={args.seconds:g}",
            "--data",
            "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--output",
            f"kind=json,path={report}",
            "--output",
            f"kind=csv,path={args.out / 'benchmarks.csv'}",
            "--disable-console-interactive",
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        result = subprocess.run(command, env=env, check=False)
        if result.returncode != 0:
            print(f"guidellm exited with {result.returncode}", file=sys.stderr)
            return 1
    problems = errors_in(json.loads(report.read_text()))
    for problem in problems:
        print(f"FAIL {problem}")
    print("guidellm sweep: " + ("FAILED" if problems else f"passed with zero errors ({report})"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
