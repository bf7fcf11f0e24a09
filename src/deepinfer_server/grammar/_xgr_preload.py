"""Imported by the compile workers' fork server before it forks them: xgrammar (and PyTorch,
which it imports) once, and the vocabulary the workers compile over (`VOCAB_ENV`: a file holding
the tokenizer JSON, and the vocabulary size), so that starting a worker, or replacing a killed
one, is a fork rather than seconds of imports and vocabulary building. Without xgrammar there is
nothing to load."""

from __future__ import annotations

import contextlib
import os


def _preload() -> None:
    from deepinfer_server.grammar._xgr import Vocab
    from deepinfer_server.grammar.fork_server import VOCAB_ENV

    path, _, size = os.environ.get(VOCAB_ENV, "").rpartition(":")
    if not path:
        return
    try:
        with open(path, encoding="utf-8") as file:
            tokenizer_json = file.read()
    except OSError:  # gone: each worker builds its own
        return
    # Cached by its arguments: a worker asking for the same vocabulary gets this one.
    Vocab.from_tokenizer_json(tokenizer_json, int(size) if size else None)


def _load() -> None:
    from deepinfer_server.grammar._xgr import load_xgrammar
    from deepinfer_server.grammar.errors import GrammarUnavailable

    try:
        load_xgrammar()  # without PyTorch's distributed tensors: seconds less of imports
    except GrammarUnavailable:
        return
    import deepinfer_server.grammar.compile_job  # noqa: F401

    _preload()


with contextlib.suppress(ImportError):
    _load()
