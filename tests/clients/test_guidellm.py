"""GuideLLM's default sweep against a server with the default admission: no errored request.

The sweep's throughput step sends up to 512 requests at once, far beyond the 16 running
sequences; with no queue (the old `--max-queued-requests 0`) most of them were 429s and the
sweep chose its later rates from the refused throughput. GuideLLM runs from its own virtual
environment (its dependencies clash with the `grammar` extra's pins), which
`scripts/install-test-clients.sh` makes under the npm prefix.

Shortened for the lane, the profile left as it is: three seconds per step (`max_duration`),
64-token prompts and 32-token answers (so that one GuideLLM worker dispatches the throughput
step's burst within them), one worker process started by a fork server (ten spawned workers
took most of the time on two cores), its data loader generating 1,024 prompts ahead rather
than 4,096 (a third of the test's CPU), and the simulated engine's fast steps; admission keeps
its defaults. With `--max-queued-requests 0` the same run had 114 errored requests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from deepinfer_server.model.tokenizer import write_embedded_tokenizer
from tests.clients.conftest import NPM_PREFIX, live_server, run_client
from tests.lanes import missing_lane
from tests.metrics_scrape import scrape, value

pytestmark = [pytest.mark.clients, pytest.mark.timeout(420)]

GUIDELLM = NPM_PREFIX / "guidellm" / "bin" / "guidellm"
#: GuideLLM's default sweep: synchronous, throughput, then 8 constant rates in between.
SWEEP_SIZE = 10
#: DP 1 x `--max-num-seqs 4`: below what GuideLLM's throughput step keeps in flight whatever
#: the machine's speed (with the default 16 slots and 1 ms steps, an idle machine answered
#: as fast as GuideLLM's one worker sent, and the queue was never used).
RUNNING_CAPACITY = 4


def run_sweep(target: str, work: Path) -> dict[str, Any]:
    tokenizer = work / "tokenizer"
    write_embedded_tokenizer(tokenizer)
    report = work / "benchmarks.json"
    command = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={target}",
        "--profile",
        "kind=sweep",
        "--data",
        "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
        "--constraint",
        "kind=max_duration,seconds=3",
        # The loader's data worker generates this many prompts ahead (4096 by default, tokenizing
        # each): enough for the throughput step's 512 at once and what follows in 3 s.
        "--data-loader",
        "kind=pytorch,prefetch_factor=1024",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(work),
        "HF_HUB_OFFLINE": "1",
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
        "GUIDELLM__MP_CONTEXT_TYPE": "forkserver",
    }
    done = run_client(command, env, work, timeout=360)
    assert done.returncode == 0, (
        f"guidellm exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    )
    loaded: dict[str, Any] = json.loads(report.read_text())
    return loaded


def test_guidellm_default_sweep_has_no_errors(tmp_path: Path) -> None:
    if not GUIDELLM.exists():
        missing_lane(
            "clients", f"GuideLLM is not at {GUIDELLM} (run scripts/install-test-clients.sh)"
        )
    with live_server(
        "--sim-itl-ms", "1", "--sim-ttft-ms", "5", "--max-num-seqs", str(RUNNING_CAPACITY)
    ) as server:
        report = run_sweep(server.base_url, tmp_path)
        refused = value(scrape(server.base_url), "deepinfer:request_failure_total", status="429")
    benchmarks = report["benchmarks"]
    kinds = [benchmark["config"]["strategy"]["type_"] for benchmark in benchmarks]
    assert kinds == ["synchronous", "throughput", *["constant"] * (SWEEP_SIZE - 2)]
    states = [benchmark["scheduler_state"] for benchmark in benchmarks]
    outcomes = [
        (kind, state["successful_requests"], state["errored_requests"])
        for kind, state in zip(kinds, states, strict=True)
    ]
    assert all(ok > 0 and errored == 0 for _, ok, errored in outcomes), outcomes
    assert refused == 0
    # The throughput step had more requests in flight than run at once: the queue held them.
    throughput = benchmarks[1]["metrics"]["request_concurrency"]["total"]
    assert throughput["max"] > RUNNING_CAPACITY, throughput
