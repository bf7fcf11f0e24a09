"""What a batch input file past `--batch-max-lines` (50,000) costs the server when
`POST /v1/batches` refuses it: how long the refusal takes, how late another API key's
`GET /v1/models` (polled every 10 ms meanwhile) is answered at worst, and how much the API
process's resident memory grows at its peak. Two files: millions of one-character lines
(`--lines`), and 50,001 well-formed requests (every one read before the last passes the
limit); and a Message Batches body of 50,001 requests (`POST /v1/messages/batches`). A
benchmark, not a test: nothing asserts.

    python bench/batch_input.py                 # this checkout
    python bench/batch_input.py --base HEAD~3   # and another revision, for comparison
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from harness import ROOT, Server, extract_src

KEY_A, KEY_B = "key-a", "key-b"
#: A well-formed request line, numbered.
REQUEST = (
    b'{"custom_id":"r%06d","method":"POST","url":"/v1/chat/completions","body":'
    b'{"model":"m","messages":[{"role":"user","content":"Say hello."}]}}\n'
)
#: A well-formed request of a message batch, numbered.
MESSAGE = (
    b'{"custom_id":"r%06d","params":{"model":"m","max_tokens":8,'
    b'"messages":[{"role":"user","content":"Say hello."}]}}'
)
#: The label of a Message Batches body.
MESSAGES = "a Message Batches body of "
#: The default --batch-max-lines.
MAX_LINES = 50_000
#: How often the other key asks for the models, in seconds.
POLL = 0.01


def _status(pid: int, field: str) -> int:
    """A `/proc/PID/status` size field (VmRSS, VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak(pid: int) -> None:
    """Start the process's peak resident memory (VmHWM) from its current size."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


async def _poll(client: httpx.AsyncClient, latencies: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        answer = await client.get("/v1/models", timeout=300)
        answer.raise_for_status()
        latencies.append(time.perf_counter() - started)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL)


#: What is asked for while the other key polls: the refusal's request.
Refusal = Callable[[], Awaitable[httpx.Response]]


async def _file_refusal(a: httpx.AsyncClient, content: bytes) -> Refusal:
    """Upload `content`; the batch of it to ask for."""
    upload = await a.post(
        "/v1/files", files={"file": ("many.jsonl", content)}, data={"purpose": "batch"}, timeout=120
    )
    upload.raise_for_status()
    body = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    return lambda: a.post("/v1/batches", json=body, timeout=300)


async def _body_refusal(a: httpx.AsyncClient, raw: bytes) -> Refusal:
    """The message batch of body `raw` to ask for."""
    headers = {"content-type": "application/json"}
    return lambda: a.post("/v1/messages/batches", content=raw, headers=headers, timeout=300)


async def _measure(port: int, pid: int, content: bytes, messages: bool) -> dict[str, float]:
    base = f"http://127.0.0.1:{port}"
    async with (
        httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY_A}"}) as a,
        httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY_B}"}) as b,
    ):
        refusal = await (_body_refusal if messages else _file_refusal)(a, content)
        await b.get("/v1/models")  # the poller's connection is open before the measure
        _reset_peak(pid)
        before = _status(pid, "VmRSS")
        latencies: list[float] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(b, latencies, stop))
        started = time.perf_counter()
        answer = await refusal()
        refused = time.perf_counter() - started
        stop.set()
        await poller
    if answer.status_code != 400 or "--batch-max-lines" not in answer.text:
        raise RuntimeError(f"expected the 400, got {answer.status_code}: {answer.text[:200]}")
    return {
        "refused_s": refused,
        "models_worst_ms": max(latencies) * 1000,
        "models_median_ms": statistics.median(latencies) * 1000,
        "models_polls": len(latencies),
        "rss_growth_mib": (_status(pid, "VmHWM") - before) / 2**20,
        "file_mib": len(content) / 2**20,
    }


def _run(name: str, src: Path, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as state:
        args = ("--api-key", KEY_A, "--api-key", KEY_B, "--state-dir", state)
        env = {**os.environ, "PYTHONPATH": str(src)}
        with Server.deepinfer(*args, "--batch-max-file-mb", "16", env=env) as server:
            for kind, content in files.items():
                messages = kind.startswith(MESSAGES)
                found = asyncio.run(_measure(server.port, server.process.pid, content, messages))
                print(
                    f"{name}: {kind} ({found['file_mib']:.1f} MiB) refused in "
                    f"{found['refused_s']:.2f} s; another key's GET /v1/models at worst "
                    f"{found['models_worst_ms']:.0f} ms, median {found['models_median_ms']:.0f} "
                    f"ms ({found['models_polls']:.0f} polls); "
                    f"API process peak RSS growth {found['rss_growth_mib']:.0f} MiB"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_100_000)
    parser.add_argument("--base", help="also measure this git revision, first")
    args = parser.parse_args()
    files = {
        f"{args.lines} one-character lines": b"x\n" * args.lines,
        f"{MAX_LINES + 1} requests": b"".join(REQUEST % n for n in range(MAX_LINES + 1)),
        f"{MESSAGES}{MAX_LINES + 1} requests": b'{"requests":['
        + b",".join(MESSAGE % n for n in range(MAX_LINES + 1))
        + b"]}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            _run(f"base {args.base}", extract_src(args.base, Path(tmp)), files)
        _run("this", ROOT / "src", files)


if __name__ == "__main__":
    main()
