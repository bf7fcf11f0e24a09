"""The compile workers' fork server: it imports xgrammar (and PyTorch with it) and builds the
vocabulary once (`_xgr_preload`), so that starting a worker, or replacing a killed one, is a
fork rather than seconds of loading. The vocabulary reaches it through a file it reads at its
start (`VOCAB_ENV`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import tempfile
import threading
from multiprocessing import forkserver

#: What the workers' fork server imports before forking them (xgrammar, PyTorch with it).
PRELOAD = "deepinfer_server.grammar._xgr_preload"
#: "<tokenizer JSON file>:<vocab size or empty>", which the fork server's preload reads.
VOCAB_ENV = "DEEPINFER_GRAMMAR_WORKER_VOCAB"


_vocabulary_shared = False
_share_lock = threading.Lock()
#: The file the fork server reads at its start, removed once it forked a worker (it has read it).
_shared_file: str | None = None


def share_vocabulary(tokenizer_json: str, vocab_size: int | None) -> None:
    """Have the fork server build the workers' vocabulary once (`_xgr_preload`), if it has not
    started yet: the tokenizer goes into a file it reads."""
    global _vocabulary_shared, _shared_file
    with _share_lock:
        if _vocabulary_shared:  # by an earlier pool of this process: its fork server runs
            return
        _vocabulary_shared = True
    handle, path = tempfile.mkstemp(prefix="deepinfer-grammar-vocab-", suffix=".json")
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(tokenizer_json)
    os.environ[VOCAB_ENV] = f"{path}:{'' if vocab_size is None else vocab_size}"
    _shared_file = path
    atexit.register(remove_shared_file)  # in case no worker is ever forked


def remove_shared_file() -> None:
    """Remove the vocabulary's file, once the fork server has read it (or at exit)."""
    global _shared_file
    with _share_lock:
        path, _shared_file = _shared_file, None
    if path is not None:
        with contextlib.suppress(OSError):
            os.remove(path)


def start_fork_server(tokenizer_json: str, vocab_size: int | None) -> None:
    """Start the workers' fork server now (it imports xgrammar and builds the vocabulary), so
    that it loads while this process builds its own vocabulary."""
    share_vocabulary(tokenizer_json, vocab_size)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([PRELOAD])
    forkserver.ensure_running()


_stop_lock = threading.Lock()


def stop_fork_server() -> None:
    """Stop the fork server this process started, at once, even while it loads. It reads the
    pipe that tells it its parent is gone only once loaded, so one stopped during the warm-up
    would outlive the server by the rest of its load (seconds of imports). The next pool starts
    a new one, which preloads the vocabulary again."""
    global _vocabulary_shared
    # The standard library has no public stop: `_stop` is what its own tests use (it closes
    # the alive pipe, reaps the process and removes its socket), after a kill for one loading.
    server = getattr(forkserver, "_forkserver", None)
    with _stop_lock:
        pid: int | None = getattr(server, "_forkserver_pid", None)
        if server is None or pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()
    remove_shared_file()
    with _share_lock:
        _vocabulary_shared = False
    os.environ.pop(VOCAB_ENV, None)
