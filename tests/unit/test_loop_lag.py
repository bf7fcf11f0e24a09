"""The loop-lag probe (`tests/loop_lag.py`) sees the loop held, whether the block held it in
its middle or until its end, and fails its check then."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.loop_lag import LoopLag


def test_a_held_loop_is_seen_wherever_the_block_holds_it() -> None:
    async def main() -> list[LoopLag]:
        probes = []
        async with LoopLag() as held_at_end:
            time.sleep(0.2)  # holds the loop: what the probe is there to catch
        probes.append(held_at_end)
        async with LoopLag() as held_midway:
            await asyncio.sleep(0.03)
            time.sleep(0.2)
            await asyncio.sleep(0.03)
        probes.append(held_midway)
        return probes

    for probe in asyncio.run(main()):
        assert probe.worst >= 0.15
        with pytest.raises(AssertionError, match="the event loop was held"):
            probe.check()
