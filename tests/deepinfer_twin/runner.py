"""Drive DeepInfer's own LLMEngine (the CPU twin) through the server's engine driver.

`run_in_twin(checkpoint, body)` runs `body` in a fresh process that has the twin on its path:
the prelude below builds one DP rank's `LLMEngine` exactly as the server's rank does
(`engines/deepinfer/engine.py`), wraps it in the server's `LLMEngineDriver`, and gives `body`
helpers to add requests and iterate; `body` assigns `RESULT`, which comes back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.deepinfer_twin import engine_pythonpath
from tests.server import free_port

PRELUDE = '''
import json, os, sys
import numpy as np
from deepinfer._C.engine import RequestOutput
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, SamplingOptions, StructuredOutput
from tokenizers import Tokenizer

CHECKPOINT = sys.argv[1]
TOKENIZER = Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
ENGINE = LLMEngine.from_engine_args(EngineArgs(
    model=CHECKPOINT, max_model_len=4096, max_num_seqs=8, data_parallel_size=1,
    stop_preempted_request=False,
))
DRIVER = LLMEngineDriver(ENGINE, RequestOutput)

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


def run_in_twin(
    checkpoint: Path, body: str, env: dict[str, str] | None = None, timeout: float = 240
) -> Any:
    """Run `body` after the prelude in a twin process; what it put in RESULT."""
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    environment = {
        **os.environ,
        "PYTHONPATH": engine_pythonpath(),
        "CUDA_VISIBLE_DEVICES": "0",
        "MASTER_ADDR": "127.0.0.1",
        # DeepInfer's rendezvous is MASTER_PORT - 50.
        "MASTER_PORT": str(free_port() + 50),
        "DEEPINFER_USE_NEXTN_DECODE": "0",
        "DEEPINFER_USE_MULTIMODAL_POOL": "0",
        "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1",
        "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    completed = subprocess.run(
        [sys.executable, "-c", script, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith("RESULT="):
            return json.loads(line[len("RESULT=") :])
    raise AssertionError(
        f"the twin script failed ({completed.returncode}):\n{completed.stderr[-4000:]}"
    )
