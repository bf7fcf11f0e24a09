"""What unfinished request heads cost the API process: its resident memory before and while
N connections each send one M MB header line and never finish it (a simulated server, one API
process). Prints both and their ratio. A benchmark, not a test: nothing asserts.

    python bench/header_memory.py --connections 60 --mb 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from harness import Server

#: Seconds to let the server read what the connections sent before reading its memory.
SETTLE = 3.0


async def _hold(port: int, connections: int, size: int) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(connections):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size)
        writers.append(writer)
    for writer in writers:
        with contextlib.suppress(ConnectionError, TimeoutError):
            await asyncio.wait_for(writer.drain(), 30)
    await asyncio.sleep(SETTLE)
    return writers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=60)
    parser.add_argument("--mb", type=int, default=10, help="MB of header line per connection")
    args = parser.parse_args()
    with Server.deepinfer() as server:
        before = server.rss_bytes()

        async def measure() -> int:
            writers = await _hold(server.port, args.connections, args.mb * 1024 * 1024)
            held = server.rss_bytes()
            for writer in writers:
                writer.close()
            return held

        during = asyncio.run(measure())
    print(
        f"API process RSS: {before / 2**20:.0f} MiB idle, {during / 2**20:.0f} MiB while "
        f"{args.connections} connections send {args.mb} MB header lines "
        f"(x{during / before:.2f})"
    )


if __name__ == "__main__":
    main()
