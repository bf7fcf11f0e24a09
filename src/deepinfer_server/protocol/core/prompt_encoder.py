"""PromptEncoder: the V4.1 prompt encoding, reusing the tokens of an earlier prompt this one
extends (an agent's next turn resends the whole conversation).

Why a cut is safe: deepseek-recipe encodes each plain-text span between special tokens on its
own (`RenderedPrompt.special_ranges`), so no BPE merge or pre-tokenizer split crosses a special
token. Where two rendered prompts have the same text and the same special ranges up to the end
of a special token, their tokens up to it are the same. A cut anywhere else (inside plain text)
could differ and is never made. The rest of the prompt is encoded span by span as the recipe
does: a special range is its token, plain text goes through the tokenizer without its added
vocabulary (the pre-tokenizer and the BPE model; the whole pipeline at C speed when the span
holds no character an added token starts with, so that none can match).

The equivalence is checked, not only argued: a reused encoding is compared with the recipe's
own for one request in `check_every` (every one in the tests); a mismatch logs once and turns
reuse off for good. Entries are kept for prompts of at least `MIN_CHARS` characters, keyed by
their first `KEY_CHARS` characters (the conversation's start), least recently used first out
beyond `max_bytes`. Thread-safe: preparation runs on worker threads.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import tokenizers
from deepseek_recipe import Conversation, DeepseekV41Encoding, RenderedPrompt

logger = logging.getLogger(__name__)

#: Prompts shorter than this are encoded whole (a few ms at most) and not kept.
MIN_CHARS = 8192
#: The characters that name a conversation: candidates share them.
KEY_CHARS = 4096
#: Earlier prompts kept per conversation start (several conversations can share a system prompt).
CANDIDATES_PER_KEY = 4
#: Characters compared at once while looking for where two prompts part.
_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class _Encoded:
    """One prompt's text, special ranges and tokens, with the token count after each range."""

    text: str
    ranges: list[tuple[int, int]]
    tokens: npt.NDArray[np.int32]
    token_ends: npt.NDArray[np.int64]

    @property
    def size(self) -> int:
        return len(self.text) * 2 + self.tokens.nbytes + self.token_ends.nbytes


def common_prefix_length(a: str, b: str) -> int:
    """The length of the longest common prefix of two strings (C-speed slice compares)."""
    limit = min(len(a), len(b))
    at = 0
    while at < limit and a[at : at + _CHUNK] == b[at : at + _CHUNK]:
        at += _CHUNK
    low, high = at, min(limit, at + _CHUNK)
    while low < high:  # the first differing position lies in [low, high]
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return min(low, limit)


class PromptEncoder:
    """`encode(conversation)` as the recipe's encoding does it, cheaper for extended prompts."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        check_every: int = 64,
    ) -> None:
        """`tokenizer` is the recipe's vocabulary as a `tokenizers.Tokenizer`."""
        self._tokenizer = tokenizer
        vocabulary = tokenizer.get_added_tokens_decoder()
        self._special_ids = {token.content: token_id for token_id, token in vocabulary.items()}
        #: Whether a token ID is an added (special) token, by ID.
        size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocabulary, default=0) + 1)
        self._is_special = np.zeros(size, dtype=bool)
        self._is_special[list(vocabulary)] = True
        #: A plain span holding none of these can match no added token: the fast path.
        self._markers = frozenset(
            token.content[0] for token in vocabulary.values() if token.content
        )
        self._max_bytes = max_bytes
        self._check_every = max(1, check_every)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, list[_Encoded]] = OrderedDict()
        self._bytes = 0
        self._reuses = 0
        self.enabled = True

    def encode(
        self,
        encoding: DeepseekV41Encoding,
        conversation: Conversation,
        rendered: RenderedPrompt | None = None,
    ) -> list[int]:
        """The conversation's prompt token IDs under `encoding`, as `encoding.encode` gives
        them (`rendered`: the conversation's rendering, if at hand)."""
        if rendered is None:
            rendered = encoding.render_conversation(conversation)
        text = rendered.prompt
        if not self.enabled or len(text) < MIN_CHARS:
            whole: list[int] = encoding.encode(conversation)
            return whole
        ranges = rendered.special_ranges
        key = text[:KEY_CHARS]
        encoded = self._reuse(key, text, ranges)
        if encoded is None:
            whole = encoding.encode(conversation)
            self._keep(key, self._indexed(text, ranges, whole))
            return whole
        tokens: list[int] = encoded.tokens.tolist()
        with self._lock:
            self._reuses += 1
            check = self._reuses % self._check_every == 0
        if check and not self._agrees(encoding, conversation, tokens):
            whole = encoding.encode(conversation)
            return whole
        self._keep(key, encoded)
        return tokens

    # Internals

    def _reuse(self, key: str, text: str, ranges: list[tuple[int, int]]) -> _Encoded | None:
        """This prompt encoded from the earlier prompt sharing the longest cut, if any."""
        with self._lock:
            candidates = list(self._entries.get(key, ()))
        best: tuple[int, _Encoded] | None = None
        for candidate in candidates:
            kept = _shared_ranges(candidate, text, ranges)
            if kept and (best is None or kept > best[0]):
                best = (kept, candidate)
        if best is None:
            return None
        kept, candidate = best
        cut = candidate.ranges[kept - 1][1]
        if cut * 2 < len(text):  # little to reuse: the recipe encodes faster than our spans
            return None
        head = int(candidate.token_ends[kept - 1])
        tail, tail_ends = self._encode_from(text, ranges[kept:], cut)
        tokens = np.concatenate([candidate.tokens[:head], np.array(tail, dtype=np.int32)])
        ends = np.concatenate([candidate.token_ends[:kept], head + np.array(tail_ends, np.int64)])
        return _Encoded(text, ranges, tokens, ends)

    def _encode_from(
        self, text: str, ranges: list[tuple[int, int]], at: int
    ) -> tuple[list[int], list[int]]:
        """Tokens of `text[at:]` span by span, and the count after each special range."""
        tokens: list[int] = []
        ends: list[int] = []
        for start, end in ranges:
            if at < start:
                tokens.extend(self._plain(text[at:start]))
            tokens.append(self._special_ids[text[start:end]])
            ends.append(len(tokens))
            at = end
        if at < len(text):
            tokens.extend(self._plain(text[at:]))
        return tokens, ends

    def _plain(self, span: str) -> list[int]:
        """A plain span's tokens without the added vocabulary, as the recipe encodes it."""
        if self._markers.isdisjoint(span):
            ids: list[int] = self._tokenizer.encode(span, add_special_tokens=False).ids
            return ids
        tokenizer = self._tokenizer
        normalizer = tokenizer.normalizer
        if normalizer is not None:
            span = normalizer.normalize_str(span)
        pre_tokenizer = tokenizer.pre_tokenizer
        pieces = (
            [piece for piece, _ in pre_tokenizer.pre_tokenize_str(span)]
            if pre_tokenizer
            else [span]
        )
        model = tokenizer.model
        return [token.id for piece in pieces for token in model.tokenize(piece)]

    def _indexed(
        self, text: str, ranges: list[tuple[int, int]], tokens: list[int]
    ) -> _Encoded | None:
        """An entry for a prompt the recipe encoded whole: its special tokens located among
        its tokens (None, keeping nothing, unless there is exactly one per special range)."""
        array = np.array(tokens, dtype=np.int32)
        positions = np.flatnonzero(self._is_special[array])
        if len(positions) != len(ranges):
            return None
        expected = np.array([self._special_ids[text[s:e]] for s, e in ranges], dtype=np.int32)
        if not np.array_equal(array[positions], expected):
            return None
        return _Encoded(text, ranges, array, positions.astype(np.int64) + 1)

    def _agrees(
        self, encoding: DeepseekV41Encoding, conversation: Conversation, tokens: list[int]
    ) -> bool:
        if encoding.encode(conversation) == tokens:
            return True
        logger.error(
            "prompt encoding reuse disagreed with deepseek-recipe's encoding; it is off from now "
            "on (prompts are encoded whole): please report this"
        )
        self.enabled = False
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        return False

    def _keep(self, key: str, encoded: _Encoded | None) -> None:
        if encoded is None:
            return
        with self._lock:
            entries = self._entries.pop(key, [])
            entries.insert(0, encoded)
            self._bytes += encoded.size
            for dropped in entries[CANDIDATES_PER_KEY:]:
                self._bytes -= dropped.size
            self._entries[key] = entries[:CANDIDATES_PER_KEY]
            while self._bytes > self._max_bytes and self._entries:
                _, oldest = self._entries.popitem(last=False)
                self._bytes -= sum(entry.size for entry in oldest)


def _shared_ranges(candidate: _Encoded, text: str, ranges: list[tuple[int, int]]) -> int:
    """How many leading special ranges `text` shares with the candidate, text included: the
    cut after the last of them is safe (0: none is)."""
    same = common_prefix_length(candidate.text, text)
    kept = 0
    for mine, theirs in zip(candidate.ranges, ranges, strict=False):
        if mine != theirs or mine[1] > same:
            break
        kept += 1
    return kept
