#!/usr/bin/env python3
"""A small, fast load generator for deepinfer-server benchmarks (standard library + uvloop).

Each of `--concurrency` workers keeps one HTTP/1.1 keep-alive connection and sends the same
request in a loop until `--duration` seconds have passed (or `--requests` completed). It parses
only what it must: chunked framing and SSE `data:` lines; with `--timing` it also records the
arrival time of every chunk and the cumulative token count from continuous usage stats. With
`--distinct MARKER` the first MARKER in the body becomes a number of its own in every request
(distinct prompts after a shared prefix, for the prefix cache).
Prints one JSON object with counts, durations, latencies and its own CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Totals:
    requests: int = 0
    errors: int = 0
    cut: int = 0
    status: dict[int, int] = field(default_factory=dict)
    frames: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if b":" in line:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _one(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    request: bytes,
    timing: bool,
    totals: Totals,
    frame_gaps: bool = False,
) -> None:
    started = time.perf_counter()
    writer.write(request)
    status, headers = await _read_headers(reader)
    totals.status[status] = totals.status.get(status, 0) + 1
    first_at: float | None = None
    last_at = started
    last_tokens = 0
    if headers.get(b"transfer-encoding") == b"chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.perf_counter()
            frames = data.count(b"data: {")
            totals.frames += frames
            if frame_gaps and frames:
                # One token per frame (a paced stream): the gap between chunks is the ITL.
                if first_at is None:
                    first_at = now
                    totals.ttft.append(now - started)
                else:
                    totals.itl.extend([(now - last_at) / frames] * frames)
                last_at = now
            elif timing and frames:
                tokens = last_tokens
                for line in data.split(b"\n"):
                    if line.startswith(b"data: {"):
                        usage = json.loads(line[6:]).get("usage") or {}
                        tokens = max(tokens, usage.get("completion_tokens", tokens))
                new = tokens - last_tokens
                if new > 0:
                    if first_at is None:
                        first_at = now
                        totals.ttft.append(now - started)
                        new -= 1
                    if new > 0:
                        totals.itl.extend([(now - last_at) / new] * new)
                    last_at = now
                    last_tokens = tokens
    else:
        length = int(headers.get(b"content-length", b"0"))
        body = await reader.readexactly(length)
        totals.frames += body.count(b'"completion_tokens"')
    totals.latency.append(time.perf_counter() - started)
    if status == 200:
        totals.requests += 1
    else:
        totals.errors += 1


@dataclass
class Requests:
    """The request to send: the same bytes every time, or with `marker` in the body replaced by
    a new number each time."""

    host: str
    port: int
    path: str
    body: bytes
    marker: bytes | None = None
    sent: int = 0

    def __post_init__(self) -> None:
        self._same = build_request(self.host, self.port, self.path, self.body)

    def next(self) -> bytes:
        if self.marker is None:
            return self._same
        self.sent += 1
        body = self.body.replace(self.marker, str(self.sent).encode(), 1)
        return build_request(self.host, self.port, self.path, body)


async def _worker(
    host: str,
    port: int,
    requests: Requests,
    deadline: float,
    budget: list[int],
    timing: bool,
    totals: Totals,
    frame_gaps: bool,
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            request = requests.next()
            try:
                # --duration bounds the run: a request still streaming then is cut (the
                # connection closes, and the server aborts it), its tokens so far counted.
                await asyncio.wait_for(
                    _one(reader, writer, request, timing, totals, frame_gaps),
                    deadline - time.perf_counter(),
                )
            except TimeoutError:
                totals.cut += 1
                break
    finally:
        writer.close()


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    ).encode() + body


async def run(args: argparse.Namespace) -> dict[str, object]:
    body = json.dumps(json.loads(args.body)).encode()
    marker = args.distinct.encode() if args.distinct else None
    if marker is not None and marker not in body:
        raise SystemExit(f"--distinct {args.distinct!r} is not in the body")
    requests = Requests(args.host, args.port, args.path, body, marker)
    totals = Totals()
    budget = [args.requests]
    started = time.perf_counter()
    cpu_started = resource.getrusage(resource.RUSAGE_SELF)
    deadline = started + args.duration
    await asyncio.gather(
        *(
            _worker(
                args.host,
                args.port,
                requests,
                deadline,
                budget,
                args.timing,
                totals,
                args.frame_gaps,
            )
            for _ in range(args.concurrency)
        )
    )
    elapsed = time.perf_counter() - started
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    cpu_seconds = (cpu.ru_utime - cpu_started.ru_utime) + (cpu.ru_stime - cpu_started.ru_stime)
    return {
        "elapsed": elapsed,
        "requests": totals.requests,
        "errors": totals.errors,
        "cut": totals.cut,
        "status": totals.status,
        "frames": totals.frames,
        "ttft": totals.ttft,
        "itl": totals.itl,
        "latency": totals.latency,
        "client_cpu": cpu_seconds / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("--body", required=True, help="the JSON request body")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=10**9)
    parser.add_argument("--timing", action="store_true", help="record TTFT and ITL per token")
    parser.add_argument(
        "--frame-gaps", action="store_true", help="record the gaps between SSE chunks as ITL"
    )
    parser.add_argument(
        "--distinct", help="a string in the body to replace by a new number in every request"
    )
    parser.add_argument("--cpu", type=int, help="pin this process to one CPU")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
