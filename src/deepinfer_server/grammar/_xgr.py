"""Lazy access to xgrammar (an optional dependency) and the vocabulary facts grammars need."""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from types import ModuleType
from typing import Any

from deepinfer_server.grammar.errors import GrammarUnavailable
from deepinfer_server.model.tokens import EOS_TOKEN

THINK_END = "</think>"
_CPP_PREFIX = re.compile(r"^\[[0-9:.]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar() -> ModuleType:
    """The xgrammar module, or GrammarUnavailable when it is not installed."""
    try:
        return importlib.import_module("xgrammar")
    except ImportError as exc:
        raise GrammarUnavailable() from exc


def load_xgrammar() -> ModuleType:
    """Import xgrammar in a process of this server's own that never uses PyTorch's distributed
    tensors (the compile workers' fork server, a simulated rank); GrammarUnavailable without it.

    xgrammar imports transformers' PyTorch helpers, which import `torch.distributed.tensor` for
    tensor parallelism when `torch.distributed.is_available()`, and with it torch.fx and SymPy:
    about 40% of the whole import, seconds of CPU in each process that loads xgrammar at start.
    Saying "unavailable" while xgrammar loads leaves them out; nothing here parallelises tensors,
    and the answer is restored at once. In an engine's process (DeepInfer imports xgrammar
    itself), use `xgrammar()`."""
    if "xgrammar" in sys.modules:
        return xgrammar()
    try:
        distributed = importlib.import_module("torch.distributed")
    except ImportError:
        return xgrammar()
    available = distributed.is_available
    setattr(distributed, "is_available", _unavailable)  # noqa: B010
    try:
        return xgrammar()
    finally:
        setattr(distributed, "is_available", available)  # noqa: B010


def _unavailable() -> bool:
    return False


def clean_error(exc: BaseException) -> str:
    """xgrammar's C++ message without its timestamp/file prefix, first line only."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


@dataclass(frozen=True)
class VocabSource:
    """What a `Vocab` is built from: enough for a process that never builds one itself (the
    API process hands it to its compile workers)."""

    tokenizer_json: str = field(repr=False)
    #: The model's (mask) size when it exceeds the tokenizer's.
    vocab_size: int | None = None

    def build(self) -> Vocab:
        """The Vocab (imports xgrammar; cached per process)."""
        return _vocab(self.tokenizer_json, self.vocab_size)


@dataclass(frozen=True, eq=False)
class Vocab:
    """A tokenizer as grammars see it: xgrammar TokenizerInfo plus the ids the server needs.

    Build it once per process with `Vocab.from_tokenizer_json`.
    """

    tokenizer: Any  # tokenizers.Tokenizer
    info: Any  # xgrammar.TokenizerInfo
    eos_id: int
    vocab_size: int
    think_end_ids: tuple[int, ...]
    #: What it was built from, for processes that build their own (`compile_workers`).
    tokenizer_json: str = field(default="", repr=False)
    requested_size: int | None = None

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: str, vocab_size: int | None = None) -> Vocab:
        """TokenizerInfo as DeepInfer builds it (`from_huggingface`): the full vocabulary with
        added tokens, the vocab type read from the tokenizer, EOS as the only stop token.
        `vocab_size` is the model's (mask) size when it exceeds the tokenizer's."""
        return _vocab(tokenizer_json, vocab_size)

    @property
    def source(self) -> VocabSource:
        """What this vocabulary was built from."""
        return VocabSource(self.tokenizer_json, self.requested_size)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (added tokens such as `｜DSML｜` become their own ids)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @cached_property
    def decoded(self) -> tuple[bytes, ...]:
        """The bytes of every token, by id (built on first use: a second of CPU that a
        compile worker's fork server never needs)."""
        return tuple(self.info.decoded_vocab)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (empty for ids past the tokenizer)."""
        decoded = self.decoded
        return decoded[token_id] if 0 <= token_id < len(decoded) else b""


@lru_cache(maxsize=4)
def _vocab(tokenizer_json: str, vocab_size: int | None) -> Vocab:
    xgr = xgrammar()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    table = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab_size or 0, max(table.values()) + 1)
    encoded = [""] * size
    for token, index in table.items():
        encoded[index] = token
    # From the JSON as given: the tokenizer's own `to_str()` would serialise it again first.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN} token")
    info = xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=size,
        stop_token_ids=[int(eos)],
        add_prefix_space=meta["add_prefix_space"],
    )
    think_end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False).ids)
    return Vocab(tokenizer, info, int(eos), size, think_end, tokenizer_json, vocab_size)
