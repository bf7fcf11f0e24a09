"""LLMEngine stand-in: DeepInfer 0.1.0's construction checks and surface, simulated behaviour."""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
from collections.abc import Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.dp_group import TcpDpGroup
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.engine_type import EngineType
from deepinfer.sampling_params import SamplingParams
from deepinfer_server.engines.simulated.engine import LLMEngine as SimulatedEngine
from deepinfer_server.engines.simulated.engine import SimEngineArgs


def _cp_worker(commands: Connection) -> None:
    """A CP worker (worker/base.py): pdeathsig only after its init phase, then it serves
    broadcasts until "stop", when it leaves with `os._exit(0)` inside the driver's `close()`."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # set_pdeathsig(SIGKILL), base.py:42-46
    while True:
        try:
            command = commands.recv()
        except EOFError:
            command = "stop"
        if command == "stop":
            os._exit(0)


def _mm_worker(requests: Any) -> None:
    """multi-modal-worker-0 (ve/multimodal_processor.py): forked, no pdeathsig, no signal
    handling of its own; it blocks on its input queue forever."""
    while True:
        requests.get()


def _unix_socket_count() -> int:
    """How many Unix-domain sockets this process has open (from /proc)."""
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


class _MultimodalProcessor:
    """The part of MultimodalProcessor that matters for shutdown (`workers`, `stop()`)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        # The rank's OS threads when DeepInfer forks (main thread, start-up progress reporter)
        # and its connected Unix sockets: a forked child must inherit neither a thread nor
        # the rank's links to the API processes.
        self.threads_at_fork = sorted(
            Path(f"/proc/self/task/{task}/comm").read_text().strip()
            for task in os.listdir("/proc/self/task")
        )
        self.unix_sockets_at_fork = _unix_socket_count()
        self._requests = context.Queue()
        self.workers = [
            context.Process(
                target=_mm_worker, args=(self._requests,), name="multi-modal-worker-0", daemon=True
            )
        ]
        for worker in self.workers:
            worker.start()

    def stop(self) -> None:
        """terminate(); join() without a timeout only with the pinned pool (:317-326)."""
        for worker in self.workers:
            worker.terminate()
        if os.environ.get("DEEPINFER_USE_MULTIMODAL_POOL", "1") not in ("0", "false", "False"):
            for worker in self.workers:
                worker.join()


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        # Real: list(map(int, os.environ["CUDA_VISIBLE_DEVICES"].split(","))) (llm_engine.py:188)
        gpu_ids = list(map(int, os.environ["CUDA_VISIBLE_DEVICES"].split(",")))
        self.driver_gpu_id = gpu_ids[0]
        failure = os.environ.get("FAKE_DEEPINFER_FAIL")
        if failure:
            raise RuntimeError(failure)
        tokenizer_dir = Path(engine_args.tokenizer or engine_args.model)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (tokenizer_dir / name).is_file():
                raise FileNotFoundError(f"{name} not found in {tokenizer_dir}")
        self._closed = False
        self._cp_commands: list[Connection] = []
        # V4.1 always builds the multimodal processor (mm_enabled), before _init_workers.
        self.multi_modal_processor: _MultimodalProcessor | None = None
        if engine_args.engine_type is not EngineType.COMPLETION:
            self.multi_modal_processor = _MultimodalProcessor()
        for cp_rank in range(1, engine_args.context_parallel_size):
            context = multiprocessing.get_context("spawn")
            receiver, sender = context.Pipe(duplex=False)
            worker = context.Process(
                target=_cp_worker, args=(receiver,), name=f"worker-cp{cp_rank}", daemon=True
            )
            worker.start()
            receiver.close()
            self._cp_commands.append(sender)
        self._record_dir = os.environ.get("DEEPINFER_TEST_RECORD_DIR")
        self._args = engine_args
        self._engine = SimulatedEngine(
            SimEngineArgs(
                tokenizer_json=(tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"),
                # DeepInfer's DP group spans the ranks (rendezvous at MASTER_PORT - 50).
                lockstep=TcpDpGroup(  # type: ignore[arg-type]
                    engine_args.data_parallel_size, engine_args.engine_rank
                ),
                engine_rank=engine_args.engine_rank,
                data_parallel_size=engine_args.data_parallel_size,
                max_model_len=engine_args.max_model_len or 4096,
                max_num_seqs=engine_args.max_num_seqs,
                ttft_ms=1.0,
                itl_ms=2.0,
                tokens_per_step=1 + int(os.environ.get("DEEPINFER_USE_NEXTN_DECODE", "5")),
                prefill_attempt_interval=int(
                    os.environ.get("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "70")
                ),
                prefill_any_attempt_interval=int(
                    os.environ.get("DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL", "100")
                ),
            )
        )
        self.tokenizer = self._engine.tokenizer
        self.eos_id = self._engine.eos_id
        # Real: the Scheduler binding (get_num_free_gpu_blocks) and CacheConfig (num_gpu_blocks).
        self.scheduler = self._engine.scheduler
        self.cache_config = self._engine.cache_config
        self._record("constructed", {c.name: c.pid for c in multiprocessing.active_children()})

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    def add_request(
        self,
        /,
        user_id: str,
        request_id: str,
        sampling_params: dict | SamplingParams | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict | None = None,
        arrival_time: float | None = None,
        extra: dict | None = None,
        enqueue: bool = True,
        chunk_checkpoints: list[int] | None = None,
    ) -> object | None:
        if isinstance(sampling_params, dict):
            self._record("sampling_params", sampling_params)
        if multi_modal_data is not None:
            self._record(
                "multi_modal_data",
                {
                    "image_sizes": [list(size) for size in multi_modal_data.get("image_sizes", [])],
                    "image_bytes": [len(data) for data in multi_modal_data.get("image_bytes", [])],
                },
            )
        return self._engine.add_request(
            user_id, request_id, sampling_params, prompt_token_ids, multi_modal_data
        )

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        return self._engine.abort_request(request_id)

    def get_num_unfinished_requests(self) -> int:
        return self._engine.get_num_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> np.ndarray:
        return self._engine.step()

    def flush_inflight_reqs(self) -> np.ndarray:
        return self._engine.flush_inflight_reqs()

    def close(self) -> None:
        """llm_engine.py:350-366: idempotent; CP workers leave on "stop" (nobody joins them),
        then the multimodal worker is terminated."""
        if self._closed:
            return
        self._engine.close()
        for commands in self._cp_commands:
            commands.send("stop")
            commands.close()
        if self.multi_modal_processor is not None:
            self.multi_modal_processor.stop()
        self._closed = True
        self._record("closed", {"steps": self._engine._steps})

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.close()

    def _record(self, event: str, payload: object = None) -> None:
        if not self._record_dir:
            return
        import deepinfer

        entry = {
            "event": event,
            "pid": os.getpid(),
            "engine_args": {
                k: (v.name if hasattr(v, "name") else v) for k, v in vars(self._args).items()
            },
            "import_env": {
                k: v
                for k, v in deepinfer.IMPORT_TIME_ENV.items()
                if k.startswith(("DEEPINFER_", "CUDA_", "MASTER_", "TOKENIZERS_"))
            },
            "payload": payload,
            "threads_at_mm_fork": (
                None
                if self.multi_modal_processor is None
                else self.multi_modal_processor.threads_at_fork
            ),
            "unix_sockets_at_mm_fork": (
                None
                if self.multi_modal_processor is None
                else self.multi_modal_processor.unix_sockets_at_fork
            ),
        }
        path = Path(self._record_dir) / f"rank{self._args.engine_rank}.jsonl"
        with path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(entry) + "\n")
