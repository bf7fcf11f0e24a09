"""The first structured request of a fresh server, sent the moment `/health` first answers 200.

Starts `deepinfer-server --engine simulated` on a new state directory, polls `/health` and, the
moment it answers 200, sends a `json_schema` request (a schema never compiled before): the first
figure is the seconds from that 200 to the answer. It then stops the server, starts it again on
the same state directory and does the same: the second figure. It also prints when
`deepinfer:grammar_ready` first said 1 after `/health` (read every 0.1 s, once the request is
answered), which says how long the warm-up itself took. `--src` runs another checkout's
sources instead (for a comparison; its grammar_ready is not read):

    python bench/first_structured.py              (needs the [grammar] extra)
    python bench/first_structured.py --rounds 3   (medians)
    python bench/first_structured.py --src /path/to/main/src
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from grammar_startup import _free_port, _structured, wait_healthy

MODEL = "deepseek-flash"
_READY_LINE = f'deepinfer:grammar_ready{{model_name="{MODEL}"}} 1.0'


def _grammar_ready(base_url: str) -> bool:
    return _READY_LINE in httpx.get(base_url + "/metrics", timeout=10).text.splitlines()


def one_start(state_dir: Path, name: str, src: Path | None) -> tuple[float, float, float]:
    """Start a server on `state_dir` (from the sources `src`, else this checkout's): (seconds
    from /health 200 to the answer of a new schema, seconds from /health 200 to grammar_ready
    1, or to the answer when the server has no such gauge, seconds from the start to /health
    200: what a warm-up behind /health costs the start)."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "deepinfer_server", "--engine", "simulated"]
    spawned = time.perf_counter()
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(src)} if src else os.environ.copy(),
    )
    try:
        wait_healthy(server, base_url, "the server", poll=0.02)
        healthy = time.perf_counter()
        answered = _structured(base_url, name)
        while src is None and not _grammar_ready(base_url):
            time.sleep(0.1)
        return answered, time.perf_counter() - healthy, healthy - spawned
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    """Print the first structured request's time after /health, fresh and after a restart."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--src", type=Path, help="another checkout's src/ to run instead (no grammar_ready read)"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    fresh: list[tuple[float, float, float]] = []
    restarted: list[tuple[float, float, float]] = []
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="first-structured-") as state_dir:
            fresh.append(one_start(Path(state_dir), f"fresh{index}", args.src))
            restarted.append(one_start(Path(state_dir), f"again{index}", args.src))
        print(f"round {index + 1}: fresh {fresh[-1]}, restarted {restarted[-1]}", file=sys.stderr)
    labels = ("fresh state directory", "restart, same state directory")
    for label, runs in zip(labels, (fresh, restarted), strict=True):
        answer = statistics.median(r[0] for r in runs)
        ready = statistics.median(r[1] for r in runs)
        start = statistics.median(r[2] for r in runs)
        print(
            f"{label}: first json_schema answer {answer:.2f} s after /health 200 "
            f"(grammar_ready 1 at {ready:.2f} s; /health 200 {start:.2f} s after the start; "
            f"median of {len(runs)})"
        )


if __name__ == "__main__":
    main()
