"""What each rank's DeepInfer engine was constructed with and asked, for tests to read.

With `DEEPINFER_TEST_RECORD_DIR` set, every `LLMEngine` appends JSON lines to
`rank<engine_rank>.jsonl` in that directory: the EngineArgs and the environment DeepInfer was
imported with ("constructed", with the engine's child processes by name and the threads and
Unix sockets the rank had when DeepInfer forked its multimodal worker), each dict passed to
`add_request` ("sampling_params"), each `multi_modal_data` ("multi_modal_data", sizes only),
and "closed" with the number of `step()` calls. The tap wraps DeepInfer's methods and calls
them unchanged.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
from pathlib import Path
from types import ModuleType
from typing import Any

IMPORT_TIME_ENV: dict[str, str] = {}
_RECORDED_PREFIXES = ("DEEPINFER_", "CUDA_", "MASTER_", "TOKENIZERS_")


def remember_import_environment() -> None:
    IMPORT_TIME_ENV.clear()
    IMPORT_TIME_ENV.update(os.environ)


def _threads() -> list[str]:
    return sorted(
        Path(f"/proc/self/task/{task}/comm").read_text().strip()
        for task in os.listdir("/proc/self/task")
    )


def _unix_socket_count() -> int:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return len(inodes & {line.split()[6] for line in lines})


class _Recorder:
    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.engine_args: dict[str, Any] = {}
        self.rank = 0
        self.fork_threads: list[str] | None = None
        self.fork_sockets: int | None = None

    def write(self, event: str, payload: object = None, **extra: object) -> None:
        entry = {
            "event": event,
            "pid": os.getpid(),
            "engine_args": self.engine_args,
            "import_env": {
                key: value
                for key, value in IMPORT_TIME_ENV.items()
                if key.startswith(_RECORDED_PREFIXES)
            },
            "payload": payload,
            "threads_at_mm_fork": self.fork_threads,
            "unix_sockets_at_mm_fork": self.fork_sockets,
            **extra,
        }
        path = self.directory / f"rank{self.rank}.jsonl"
        with path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(entry, default=str) + "\n")


def _plain(value: object) -> object:
    return value.name if hasattr(value, "name") else value


def install_engine_tap(module: ModuleType) -> None:
    """Wrap `LLMEngine` (deepinfer.engine.llm_engine) when the record directory is set."""
    directory = os.environ.get("DEEPINFER_TEST_RECORD_DIR")
    if not directory:
        return
    recorder = _Recorder(directory)
    engine_class = module.LLMEngine
    from_engine_args = engine_class.from_engine_args.__func__
    init = engine_class.__init__
    add_request = engine_class.add_request
    step = engine_class.step
    close = engine_class.close

    def recorded_from_engine_args(cls: type, engine_args: Any) -> Any:
        recorder.engine_args = {k: _plain(v) for k, v in vars(engine_args).items()}
        recorder.rank = int(engine_args.engine_rank)
        return from_engine_args(cls, engine_args)

    @functools.wraps(init)
    def recorded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        self._twin_steps = 0
        init(self, *args, **kwargs)
        recorder.fork_threads = _FORK_STATE.get("threads")
        recorder.fork_sockets = _FORK_STATE.get("sockets")
        children = {c.name: c.pid for c in multiprocessing.active_children()}
        recorder.write("constructed", children)

    @functools.wraps(add_request)
    def recorded_add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = ("user_id", "request_id", "sampling_params", "prompt_token_ids", "multi_modal_data")
        bound = dict(zip(names, args, strict=False)) | kwargs
        params = bound.get("sampling_params")
        if isinstance(params, dict):
            recorder.write("sampling_params", params)
        data = bound.get("multi_modal_data")
        if data is not None:
            recorder.write(
                "multi_modal_data",
                {
                    "image_sizes": [list(size) for size in data.get("image_sizes", [])],
                    "image_bytes": [len(item) for item in data.get("image_bytes", []) or []],
                },
                prompt_token_ids=[int(t) for t in bound["prompt_token_ids"]],
            )
        return add_request(self, *args, **kwargs)

    @functools.wraps(step)
    def recorded_step(self: Any) -> Any:
        self._twin_steps += 1
        return step(self)

    @functools.wraps(close)
    def recorded_close(self: Any) -> None:
        was_closed = getattr(self, "closed", True)
        close(self)
        if not was_closed:
            recorder.write("closed", {"steps": getattr(self, "_twin_steps", 0)})

    engine_class.from_engine_args = classmethod(recorded_from_engine_args)
    engine_class.__init__ = recorded_init
    engine_class.add_request = recorded_add_request
    engine_class.step = recorded_step
    engine_class.close = recorded_close


def install_fork_tap(module: ModuleType) -> None:
    """Note the rank's threads and Unix sockets when DeepInfer forks its multimodal worker."""
    directory = os.environ.get("DEEPINFER_TEST_RECORD_DIR")
    if not directory:
        return
    processor_class = module.MultimodalProcessor
    start_workers = processor_class._start_workers

    @functools.wraps(start_workers)
    def recorded_start_workers(self: Any, num_workers: int) -> None:
        _FORK_STATE["threads"] = _threads()
        _FORK_STATE["sockets"] = _unix_socket_count()
        start_workers(self, num_workers)

    processor_class._start_workers = recorded_start_workers


_FORK_STATE: dict[str, Any] = {}
