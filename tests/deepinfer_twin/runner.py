"""Drive DeepInfer's own LLMEngine (the CPU twin) through the server's engine driver.

`run_in_twin(checkpoint, body)` runs `body` in a process of its own with the twin on its path:
the prelude below builds one DP rank's `LLMEngine` exactly as the server's rank does
(`engines/deepinfer/engine.py`), wraps it in the server's `LLMEngineDriver`, and gives `body`
helpers to add requests and iterate; `body` assigns `RESULT`, which comes back as JSON.
`engine` options change what is built: `prefix_cache` (the server's `PrefixCacheSettings`
fields: the engine is the server's prefix-caching subclass), `max_num_seqs`, `max_model_len`,
`context_parallel_size`; `build: False` builds nothing (the body builds the engine and assigns
ENGINE). `run_in_twin_ranks` runs one such process per DP rank at once.

Each body runs in a child forked from this test process's zygote (`zygote.py`), which imported
DeepInfer once; a body whose environment changes what DeepInfer read at import runs in a fresh
interpreter instead, as every body did before the zygote.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer_server.engines.deepinfer.ports import choose_master_port
from tests.deepinfer_twin import engine_pythonpath
from tests.deepinfer_twin.zygote import shared_zygote
from tests.server import PortTaken, on_free_ports, port_taken

PRELUDE = '''
import json, os, sys
import numpy as np
from deepinfer._C.engine import RequestOutput
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer_server.engines.deepinfer.abilities import DeepInferAbilities
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, SamplingOptions, StructuredOutput
from tokenizers import Tokenizer

CHECKPOINT = sys.argv[1]
OPTIONS = json.loads(sys.argv[2])
TOKENIZER = Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
ENGINE_CLASS = LLMEngine
if OPTIONS.get("prefix_cache") is not None:
    from deepinfer_server.engines.deepinfer.prefix_settings import PrefixCacheSettings
    from deepinfer_server.engines.deepinfer.prefix_engine import prefix_caching_engine
    ENGINE_CLASS = prefix_caching_engine(LLMEngine, PrefixCacheSettings(**OPTIONS["prefix_cache"]))
CP = OPTIONS.get("context_parallel_size", 1)
if OPTIONS.get("build", True):
    ENGINE = ENGINE_CLASS.from_engine_args(EngineArgs(
        model=CHECKPOINT, max_model_len=OPTIONS.get("max_model_len", 4096),
        max_num_seqs=OPTIONS.get("max_num_seqs", 8),
        data_parallel_size=OPTIONS.get("data_parallel_size", 1),
        engine_rank=OPTIONS.get("engine_rank", 0), context_parallel_size=CP,
        stop_preempted_request=False,
    ))
    CACHE = ENGINE.prefix_cache if OPTIONS.get("prefix_cache") is not None else None
    ABILITIES = DeepInferAbilities(ENGINE, prefix_cache=CACHE)
    DRIVER = LLMEngineDriver(ENGINE, RequestOutput, ABILITIES)

def prompt(text):
    rendered = f"<｜begin▁of▁sentence｜><｜User｜>{text}<｜Assistant｜></think>"
    return TOKENIZER.encode(rendered, add_special_tokens=False).ids

def add(request_id, text, max_tokens=32, **sampling):
    return DRIVER.add(AddRequest(
        request_id, pack_token_ids(prompt(text)), SamplingOptions(max_tokens=max_tokens, **sampling)
    ))

def run(max_iterations=2000):
    """Iterate until idle; the tokens and finish of every request that produced output."""
    seen = {}
    for _ in range(max_iterations):
        unfinished, deltas = DRIVER.iterate()
        for delta in deltas:
            entry = seen.setdefault(delta.request_id, {"tokens": [], "finish": None})
            entry["tokens"].extend(delta.tokens.token_ids)
            if delta.finish is not None:
                entry["finish"] = delta.finish.name
        if not unfinished and not deltas and DRIVER.num_live == 0:
            break
    return seen

def iterate(count):
    for _ in range(count):
        DRIVER.iterate()

def text_of(tokens):
    return TOKENIZER.decode(tokens)

RESULT = None
'''

EPILOGUE = """
print("RESULT=" + json.dumps(RESULT))
ENGINE.close()
"""


def _environment(env: dict[str, str] | None, gpus: str, master_port: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": engine_pythonpath(),
        "CUDA_VISIBLE_DEVICES": gpus,
        "MASTER_ADDR": "127.0.0.1",
        # DeepInfer's rendezvous is MASTER_PORT - 50.
        "MASTER_PORT": str(master_port),
        "DEEPINFER_USE_NEXTN_DECODE": "0",
        "DEEPINFER_USE_MULTIMODAL_POOL": "0",
        "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1",
        "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }


def _start(script: str, argv: list[str], env: dict[str, str]) -> Callable[[float], Any]:
    """Start `script` in a twin process; a function that waits for it (a timeout in seconds)
    and returns its RESULT."""
    zygote = shared_zygote(_environment(None, "0", 0))
    if zygote is not None and zygote.serves(env):
        child = zygote.fork(script, argv, env)

        def forked(timeout: float) -> Any:
            return _result(*zygote.wait(child, timeout))

        return forked
    process = subprocess.Popen(
        [sys.executable, "-c", script, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def spawned(timeout: float) -> Any:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        return _result(process.returncode, stdout, stderr)

    return spawned


def _master_port() -> int:
    """A MASTER_PORT whose rendezvous port (MASTER_PORT - 50) is free too, as the server picks
    it: DeepInfer's torch.distributed binds both and cannot bind port 0 and say which it bound."""
    return choose_master_port(0, {})


def _result(returncode: int, stdout: str, stderr: str) -> Any:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT=") :])
    if port_taken(stderr):
        raise PortTaken("another process took the twin's MASTER_PORT or its rendezvous port")
    raise AssertionError(f"the twin script failed ({returncode}):\n{stderr[-6000:]}")


def run_in_twin(
    checkpoint: Path,
    body: str,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    engine: dict[str, Any] | None = None,
) -> Any:
    """Run `body` after the prelude in a twin process; what it put in RESULT."""
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    options = engine or {}
    gpus = ",".join(str(gpu) for gpu in range(options.get("context_parallel_size", 1)))
    argv = [str(checkpoint), json.dumps(options)]
    return on_free_ports(
        lambda: _start(script, argv, _environment(env, gpus, _master_port()))(timeout)
    )


def start_in_twin(
    checkpoint: Path, body: str, engine: dict[str, Any] | None = None
) -> Callable[[float], Any]:
    """Start `body` as `run_in_twin` runs it, without waiting: a function that waits for it
    (a timeout in seconds) and returns its RESULT (for a body that must outlive another's)."""
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    argv = [str(checkpoint), json.dumps(engine or {})]
    return _start(script, argv, _environment(None, "0", _master_port()))


def run_in_twin_ranks(
    checkpoint: Path,
    body: str,
    ranks: int,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    engine: dict[str, Any] | None = None,
) -> list[Any]:
    """`run_in_twin` on `ranks` DP ranks of one engine group at once (one process each, as the
    server's ranks); each rank's RESULT. `body` must iterate in lockstep on every rank."""
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    return on_free_ports(lambda: _run_ranks(checkpoint, script, ranks, env, timeout, engine))


def _run_ranks(
    checkpoint: Path,
    script: str,
    ranks: int,
    env: dict[str, str] | None,
    timeout: float,
    engine: dict[str, Any] | None,
) -> list[Any]:
    master_port = _master_port()
    waits = []
    for rank in range(ranks):
        options = {**(engine or {}), "data_parallel_size": ranks, "engine_rank": rank}
        argv = [str(checkpoint), json.dumps(options)]
        waits.append(_start(script, argv, _environment(env, str(rank), master_port)))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for wait in waits:
            results.append(wait(max(deadline - time.monotonic(), 0.1)))
    finally:
        for wait in waits[len(results) + 1 :]:  # the rest are killed at their (spent) deadline
            with contextlib.suppress(Exception):
                wait(0.1)
    return results
