"""RowCopier: copies of a DeepInfer rank's KV block rows and state rows to and from host memory.

The rows are those disaggregation moves (`cache_memory.CacheMemory`: one row of `gpu_blocks`
per KV block, one row of `gpu_states` per state slot, the layout `KVLayout` describes), on the
driver worker (CP = 1: the host tier refuses more). On a GPU a copy runs on a stream of its own
into (or out of) pinned host memory: that stream first waits for the default stream (the rows
as every queued step leaves them), and the default stream waits for the copy's event, so no
later step reuses an offloaded row, or reads a restored one, before the copy is done, and the
CPU never waits. The host tensors stay referenced until their copy's event has passed. On the
CPU twin a copy is a plain one. Each copy's seconds are measured (CUDA events; the wall clock on
the twin) and handed to `seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Where measured copy seconds go: (offloaded, seconds) with offloaded False for a restore.
SecondsSink = Callable[[bool, float], None]


@dataclass
class HostRows:
    """One entry's rows in host memory: its KV block rows, in table order, and its state row."""

    blocks: Any
    state: Any
    #: On a GPU, the event after which the host tensors hold the rows (None: they do now).
    ready: Any = None

    @property
    def nbytes(self) -> int:
        """The bytes held."""
        return int(self.blocks.nbytes) + int(self.state.nbytes)


@dataclass
class _InFlight:
    start: Any
    done: Any
    offloaded: bool
    rows: HostRows
    counted: bool


class RowCopier:
    """The copies between one rank's cache rows (`cache_engine`) and host memory."""

    def __init__(self, cache_engine: Any, seconds: SecondsSink) -> None:
        import torch

        self._blocks = cache_engine.gpu_blocks
        self._states = cache_engine.gpu_states
        self._seconds = seconds
        self.on_gpu = bool(self._blocks.is_cuda)
        self._stream = torch.cuda.Stream(self._blocks.device) if self.on_gpu else None  # type: ignore[no-untyped-call]
        self._in_flight: list[_InFlight] = []

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block row."""
        return int(self._blocks[0].nbytes)

    @property
    def state_bytes(self) -> int:
        """Bytes of one state row."""
        return int(self._states[0].nbytes)

    def rows_from(self, blocks: bytes, state: bytes) -> HostRows:
        """Host rows holding the bytes of whole block rows `blocks` and of a state row."""
        return HostRows(_tensor(blocks, self._blocks), _tensor(state, self._states)[0])

    def offload(self, blocks: Sequence[int], slot: int, counted: bool = True) -> HostRows:
        """Copy block rows `blocks` and state row `slot` to host memory (its seconds handed
        on when `counted`: a copy for the shared store is not the host tier's)."""
        import torch

        self.reap()
        if not self.on_gpu:
            started = time.perf_counter()
            index = torch.tensor(list(blocks), dtype=torch.long)
            rows = HostRows(self._blocks.index_select(0, index), self._states[slot].clone())
            if counted:
                self._seconds(True, time.perf_counter() - started)
            return rows
        shape = (len(blocks), *self._blocks.shape[1:])
        rows = HostRows(
            torch.empty(shape, dtype=self._blocks.dtype, pin_memory=True),
            torch.empty(self._states.shape[1:], dtype=self._states.dtype, pin_memory=True),
        )
        with self._copying(True, rows, counted):
            for at, block in enumerate(blocks):
                rows.blocks[at].copy_(self._blocks[block], non_blocking=True)
            rows.state.copy_(self._states[slot], non_blocking=True)
        return rows

    def restore(self, rows: HostRows, blocks: Sequence[int], slot: int) -> None:
        """Copy the first `len(blocks)` block rows of `rows` into `blocks`, its state row into
        `slot`."""
        import torch

        self.reap()
        if not self.on_gpu:
            started = time.perf_counter()
            index = torch.tensor(list(blocks), dtype=torch.long)
            self._blocks.index_copy_(0, index, rows.blocks[: len(blocks)])
            self._states[slot].copy_(rows.state)
            self._seconds(False, time.perf_counter() - started)
            return
        with self._copying(False, rows):
            for at, block in enumerate(blocks):
                self._blocks[block].copy_(rows.blocks[at], non_blocking=True)
            self._states[slot].copy_(rows.state, non_blocking=True)

    def _copying(self, offloaded: bool, rows: HostRows, counted: bool = True) -> Any:
        """The side stream, ordered after the default stream's queued work and before its
        next (a context manager)."""
        import contextlib

        import torch

        stream = self._stream
        assert stream is not None
        default = torch.cuda.current_stream(self._blocks.device)

        @contextlib.contextmanager
        def ordered() -> Any:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stream.wait_stream(default)
            with torch.cuda.stream(stream):
                start.record(stream)
                yield
                done.record(stream)
            default.wait_event(done)
            rows.ready = done
            self._in_flight.append(_InFlight(start, done, offloaded, rows, counted))

        return ordered()

    def reap(self) -> None:
        """Count the copies done and let go of their host tensors (GPU)."""
        if not self._in_flight:
            return
        left = []
        for copy in self._in_flight:
            if copy.done.query():
                if copy.counted:
                    self._seconds(copy.offloaded, copy.start.elapsed_time(copy.done) / 1000.0)
            else:
                left.append(copy)
        self._in_flight = left


def _tensor(data: bytes, like: Any) -> Any:
    """Rows of `like`'s shape and dtype (on the CPU) holding `data`."""
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(like.dtype).reshape(-1, *like.shape[1:])


def row_bytes(tensor: Any) -> bytes:
    """The bytes of host tensor `tensor`."""
    import torch

    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
