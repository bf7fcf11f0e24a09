"""A twin process that imports DeepInfer once and forks one child per `run_in_twin` body.

Importing DeepInfer (torch, transformers, DeepInfer's modules, the server's engine driver) is
about 9 s of a twin body's 10 when the body builds one small engine: most of what the twin lane
cost. `Zygote` starts one process per test process that does those imports, then forks a child
for each script it is sent. The child is a fresh process as far as the body can tell: its own
environment, argv, stdout and stderr (files the caller reads), and DeepInfer's environment
variables re-read on first use. What DeepInfer read at import is reported at start-up (`read`),
so that a caller whose environment differs there starts a fresh interpreter instead
(`Zygote.serves`).

The zygote forks from its only Python thread (nothing it imports starts one) and never builds
an engine, runs torch, or opens a process group itself: everything that would not survive a
fork happens in the child.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

#: Runs in the zygote: the imports, the report of what they read, then the fork loop.
ZYGOTE = r"""
import ctypes, json, os, select, signal, sys, traceback
ZYGOTE_PID = os.getpid()
import numpy, torch, tokenizers
from deepinfer._C.engine import RequestOutput
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.environ import _descriptors, envs
from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.deepinfer.prefix_engine import prefix_caching_engine
import deepinfer_server.ipc.codec, deepinfer_server.ipc.messages

# Read at start-up by the twin's hooks, the interpreter or OpenMP rather than by DeepInfer.
_FIXED_AT_START = ("DEEPINFER_TWIN_GPUS", "DEEPINFER_TWIN_GPU_CAPABILITY",
                   "DEEPINFER_TEST_RECORD_DIR", "PYTHONPATH", "OMP_NUM_THREADS")

def _read_at_import():
    read = {name: os.environ.get(name) for name, descriptor in _descriptors.items()
            if envs.__dict__.get(name, descriptor) is not descriptor}
    return read | {name: os.environ.get(name) for name in _FIXED_AT_START}

def _child(request):
    os.setpgid(0, 0)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the zygote
    if os.getppid() != ZYGOTE_PID:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for stream, path in ((1, request["stdout"]), (2, request["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, stream)
        os.close(fd)
    os.close(0)
    os.environ.clear()
    os.environ.update(request["env"])
    for name, descriptor in _descriptors.items():  # re-read on first use, as after an import
        if envs.__dict__.get(name, descriptor) is not descriptor:
            setattr(envs, name, descriptor)
    try:
        from deepinfer_twin import record
        record.remember_import_environment()
    except ImportError:
        pass
    sys.argv = ["-c", *request["argv"]]
    code = 0
    try:
        exec(compile(request["script"], "<twin body>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def _reply(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

_reply({"read": _read_at_import()})
children = set()
pending = b""
while True:
    readable, _, _ = select.select([0], [], [], 0.05)
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    if not readable:
        continue
    chunk = os.read(0, 1 << 20)
    if not chunk:
        break
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        pid = os.fork()
        if pid == 0:
            _child(json.loads(line))
        children.add(pid)
        _reply({"forked": pid})
for pid in children:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


@dataclass
class Child:
    """One forked body: its pid and the files its stdout and stderr went to."""

    pid: int
    stdout: Path
    stderr: Path


class Zygote:
    """One pre-imported twin process; `fork` runs a script in a child of it."""

    def __init__(self, env: dict[str, str]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._send_lock = threading.Lock()  # one fork request and its reply at a time
        self._exits_lock = threading.Lock()
        self._numbers = itertools.count()
        self._forked: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, queue.Queue[int]] = {}
        self._directory = Path(tempfile.mkdtemp(prefix="twin-zygote-"))
        assert self._process.stdout is not None
        first = self._process.stdout.readline()
        if not first:
            raise RuntimeError("the twin zygote failed to import DeepInfer")
        #: DeepInfer's variables its import read, and their values then.
        self.read: dict[str, str | None] = json.loads(first)["read"]
        threading.Thread(target=self._pump, daemon=True).start()

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a body with `env` sees what a fresh interpreter would: the variables
        DeepInfer read at import have the zygote's values there."""
        return self.alive() and all(env.get(name) == value for name, value in self.read.items())

    def alive(self) -> bool:
        return self._process.poll() is None

    def fork(self, script: str, argv: list[str], env: dict[str, str]) -> Child:
        """Start `script` (run as `python -c script *argv`) in a child with `env`."""
        assert self._process.stdin is not None
        number = next(self._numbers)
        with self._send_lock:
            stdout = self._directory / f"{number}.out"
            stderr = self._directory / f"{number}.err"
            request = {"script": script, "argv": argv, "env": env}
            request |= {"stdout": str(stdout), "stderr": str(stderr)}
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            pid = self._forked.get(timeout=30)
        return Child(pid, stdout, stderr)

    def wait(self, child: Child, timeout: float) -> tuple[int, str, str]:
        """The child's exit code, stdout and stderr; killed (and TimeoutExpired) at `timeout`."""
        try:
            code = self._exit_queue(child.pid).get(timeout=timeout)
        except queue.Empty:
            self.kill(child)
            raise subprocess.TimeoutExpired(["twin body", str(child.pid)], timeout) from None
        with self._exits_lock:  # a later child may get the same pid
            self._exits.pop(child.pid, None)
        self.kill(child)  # whatever the body started and left running
        stdout = child.stdout.read_text(errors="replace")
        stderr = child.stderr.read_text(errors="replace")
        child.stdout.unlink(missing_ok=True)
        child.stderr.unlink(missing_ok=True)
        return code, stdout, stderr

    def kill(self, child: Child) -> None:
        """Kill the child and whatever it started (it leads its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    def close(self) -> None:
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    def _pump(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            if "forked" in message:
                self._forked.put(message["forked"])
            else:
                self._exit_queue(message["exited"]).put(message["code"])

    def _exit_queue(self, pid: int) -> queue.Queue[int]:
        with self._exits_lock:
            return self._exits.setdefault(pid, queue.Queue())


_zygote: Zygote | None = None
_zygote_failed = False


def shared_zygote(env: dict[str, str]) -> Zygote | None:
    """This test process's zygote (started on first use with `env`, the base environment of
    twin bodies); None where it cannot start (it is then a fresh interpreter per body)."""
    global _zygote, _zygote_failed
    if _zygote is not None and _zygote.alive():
        return _zygote
    if _zygote_failed:
        return None  # it failed to start once: do not pay for that again
    try:
        _zygote = Zygote(env)
    except RuntimeError:
        _zygote_failed = True
        return None
    atexit.register(_zygote.close)
    return _zygote
