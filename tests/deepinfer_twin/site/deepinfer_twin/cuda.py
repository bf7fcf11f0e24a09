"""CPU stand-ins for the CUDA events and streams DeepInfer's host code synchronises on.

On a CPU every "device" operation has finished when the call returns, so an event is complete
as soon as it is recorded and a stream never has pending work. Only the objects DeepInfer's
engine and worker create on their host path are replaced; no device memory is pretended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class CpuEvent:
    """`torch.cuda.Event` on a CPU: recorded means complete."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        del kwargs
        self._enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: object = None) -> None:
        import time

        del stream
        self._recorded_at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: object = None) -> None:
        del stream

    def elapsed_time(self, end: CpuEvent) -> float:
        if self._recorded_at is None or end._recorded_at is None:
            raise RuntimeError("elapsed_time needs two recorded events")
        return (end._recorded_at - self._recorded_at) * 1000.0


class CpuStream:
    """`torch.cuda.Stream` on a CPU: nothing is ever pending on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_event(self, event: object) -> None:
        del event

    def wait_stream(self, stream: object) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record()
        return event

    @property
    def cuda_stream(self) -> int:
        return 0


_DEFAULT_STREAM = CpuStream()


@contextlib.contextmanager
def _stream(stream: object) -> Iterator[None]:
    del stream
    yield


def install() -> None:
    """Replace torch.cuda's event and stream entry points (torch must be a CPU build)."""
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("the DeepInfer twin is for machines without CUDA")
    torch.cuda.Event = CpuEvent  # type: ignore[misc,assignment]
    torch.cuda.Stream = CpuStream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = _stream  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
