"""The twin's model: the one imitated part of DeepInfer (forward and sampling).

It says what the simulated engine says (the last user turn, `ScriptWriter`) so the suite's
expectations carry over, with the simulated engine's deterministic logprobs. Under a grammar the
token is chosen with DeepInfer's own matcher and bitmask: the per-request structured-output
bookkeeping below is `Sampler._get_so_mask`'s `update_so_status` rule
(model_executor/layers/sampler.py), applied to DeepInfer's `XGrammarMatcher`; the preferred
token comes from the simulated engine's planner and must be allowed by DeepInfer's mask (else
the lowest allowed token is taken, as an argmax over masked logits would be: token 0 when the
mask allows nothing).

With DEEPINFER_USE_NEXTN_DECODE = N > 0 it also drafts, as DeepInfer's MTP head would: each
decode step verifies the drafts it proposed the step before (a prompt step proposes none:
DeepInfer pads them, and the pads are rejected) and proposes N more. The proposals follow the
simulated engine's acceptance cycle (`token_generator.accepted_drafts`: all right, then one
fewer each step, down to none); a wrong proposal is DeepInfer's pad token. Verification is
real: the target's token at each draft position (the script's, under a grammar the mask's) is
compared with the draft, the matching prefix is accepted and the first mismatch gives the
step's own token, with the grammar matcher advanced over the accepted tokens and rolled back
after, as DeepInfer leaves it for the scheduler to accept them at the next step.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from deepinfer_server.engines.simulated.logprobs import context_key, prompt_logprobs, token_logprobs
from deepinfer_server.engines.simulated.script import ScriptWriter
from deepinfer_server.engines.simulated.token_generator import accepted_drafts

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """What the model keeps of one sequence between steps."""

    prompt: list[int]
    script: list[int]
    key: int
    planner: Any = None
    planner_failed: bool = False
    #: The drafts proposed at its last step, which its next decode step verifies.
    drafts: list[int] = field(default_factory=list)
    #: Its draft proposals so far (the acceptance cycle's step).
    proposals: int = 0


@dataclass
class Verified:
    """One sequence's decode step with drafts: the accepted drafts and the step's own token
    (each with its logprob and alternatives), the grammar status, the next drafts."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]
    so_status: int
    drafts: list[int]


class TwinModel:
    """Deterministic next tokens for DeepInfer's scheduled sequences."""

    def __init__(self, checkpoint: str, vocab_size: int, eos_id: int) -> None:
        tokenizer_json = (Path(checkpoint) / "tokenizer.json").read_text(encoding="utf-8")
        self._tokenizer_json = tokenizer_json
        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self._script = ScriptWriter(self._tokenizer)
        self._vocab_size = vocab_size
        self._eos_id = eos_id
        self._requests: dict[tuple[str, int], _Request] = {}
        self._grammar: Any = None

    def sample(
        self, seq_metadata_list: list[Any], scheduled_seqs: list[Any], is_prompt: bool
    ) -> tuple[list[int], list[float], list[list[int]], list[list[float]], list[int]]:
        """Tokens, their logprobs, top alternatives and the structured-output statuses."""
        tokens: list[int] = []
        logprobs: list[float] = []
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        so_status: list[int] = []
        for metadata, seq in zip(seq_metadata_list, scheduled_seqs, strict=True):
            request = self._request(seq, is_prompt)
            position = seq.get_len() - seq.get_prompt_len()
            params = seq.sampling_params
            preferred = self._scripted(request, position, params)
            if params.so_args is not None and int(metadata.so_status) > 0:
                preferred = self._plan(request, params, preferred)
            status, token = self._constrain(metadata, preferred)
            so_status.append(status)
            values = token_logprobs(
                request.key, position, token, seq.sampling_params, self._vocab_size
            )
            tokens.append(token)
            logprobs.append(values.logprob)
            top_ids.append(values.top_token_ids)
            top_values.append(values.top_logprobs)
        return tokens, logprobs, top_ids, top_values, so_status

    def draft_tokens(self, seq: Any, count: int) -> list[int]:
        """The `count` drafts `seq`'s current step verifies (pads where none was proposed)."""
        request = self._requests.get((seq.request_id, seq.seq_id))
        drafts = request.drafts if request is not None else []
        return (drafts + [self.pad_id] * count)[:count]

    @property
    def pad_id(self) -> int:
        """DeepInfer's draft pad (`mtp_info_pool.get_nextn_pad_token_ids`)."""
        return self._vocab_size - 1

    def verify(self, metadata: Any, seq: Any, nextn: int) -> Verified:
        """One decode step of `seq` verifying its drafts and proposing `nextn` more."""
        request = self._request(seq, False)
        params = seq.sampling_params
        position = seq.get_len() - seq.get_prompt_len()
        drafts = self.draft_tokens(seq, int(metadata.seqlen_q) - 1)
        result = Verified([], [], [], [], 0, [])
        matcher = metadata.so_matcher if params.so_args is not None else None
        advanced = 0
        for index in range(len(drafts) + 1):
            preferred = self._scripted(request, position + index, params)
            if params.so_args is not None and int(metadata.so_status) > 0:
                preferred = self._plan(request, params, preferred)
            if index == 0:
                status, token = self._constrain(metadata, preferred)
                result.so_status = status
            elif result.so_status > 0 and matcher is not None and matcher.constrained():
                token = self._masked_choice(preferred, self._mask(matcher))
            else:
                token = preferred
            values = token_logprobs(request.key, position + index, token, params, self._vocab_size)
            result.tokens.append(token)
            result.logprobs.append(values.logprob)
            result.top_ids.append(values.top_token_ids)
            result.top_values.append(values.top_logprobs)
            if index == len(drafts) or drafts[index] != token:
                break
            if result.so_status > 0 and matcher is not None:
                if not matcher.accept_token(token):
                    break
                advanced += 1
        if advanced:
            assert matcher is not None
            matcher.rollback(advanced)
        # The next drafts: right for as many as the cycle says, then pads.
        after = position + len(result.tokens)
        right = accepted_drafts(nextn, request.proposals)
        request.proposals += 1
        result.drafts = [
            self._scripted(request, after + j, params) if j < right else self.pad_id
            for j in range(nextn)
        ]
        request.drafts = result.drafts
        return result

    def proposed_none(self, seq: Any) -> None:
        """A prompt step: DeepInfer pads the next step's drafts."""
        self._request(seq, True).drafts = []

    def _mask(self, matcher: Any) -> torch.Tensor:
        from deepinfer.structure_output.matcher import allocate_vocab_mask

        mask = allocate_vocab_mask(1, self._vocab_size, pin_memory=False)
        if not matcher.fill_vocab_mask(mask, 0):
            raise RuntimeError("filling the structured-output mask failed")
        return mask[0]

    def prompt_logprobs(self, scheduled_seqs: list[Any]) -> list[list[float] | None]:
        """Per sequence: its prompt logprobs when asked for, else None."""
        return [
            prompt_logprobs(self._request(seq, True).prompt)
            if seq.sampling_params.prompt_logprobs
            else None
            for seq in scheduled_seqs
        ]

    def forget(self, request_id: str, seq_id: int) -> None:
        self._requests.pop((request_id, seq_id), None)

    def _request(self, seq: Any, is_prompt: bool) -> _Request:
        key = (seq.request_id, seq.seq_id)
        request = self._requests.get(key)
        if request is None:
            prompt = seq.data.get_token_ids()[: seq.get_prompt_len()]
            # Image tokens (vocab_size + ImageTokenOffset) are not text: the images are
            # described from what DeepInfer's multimodal processor made of them.
            text_prompt = [token for token in prompt if token < self._vocab_size]
            script = self._script.answer_tokens(text_prompt, None)
            description = describe_processed_images(seq.multi_modal_data)
            if description:
                encoded = self._tokenizer.encode(description, add_special_tokens=False)
                script = list(encoded.ids) + script
            request = _Request(prompt=prompt, script=script, key=context_key(prompt))
            self._requests[key] = request
        return request

    def _scripted(self, request: _Request, position: int, params: Any) -> int:
        script = request.script
        if params.ignore_eos:
            at = position % (len(script) + 1)
            return script[at] if at < len(script) else self._eos_id
        return script[position] if position < len(script) else self._eos_id

    def _constrain(self, metadata: Any, preferred: int) -> tuple[int, int]:
        """DeepInfer's `update_so_status`, then the token under the matcher's bitmask."""
        status = int(metadata.so_status)
        if status <= 0 or metadata.last_output_token == -1:
            return status, preferred
        matcher = metadata.so_matcher
        if matcher is None or matcher.is_aborted():
            return -1, preferred
        try:
            if status == 2:
                for token in [*metadata.last_accepted_token, metadata.last_output_token]:
                    if not matcher.accept_token(token):
                        raise RuntimeError(f"matcher rejected step token {token}")
            elif status == 1:
                status = 2
            else:
                raise RuntimeError(f"unexpected so_status {status}")
            if not matcher.constrained():
                return status, preferred
            from deepinfer.structure_output.matcher import allocate_vocab_mask

            mask = allocate_vocab_mask(1, self._vocab_size, pin_memory=False)
            if not matcher.fill_vocab_mask(mask, 0):
                raise RuntimeError("filling the structured-output mask failed")
            return status, self._masked_choice(preferred, mask[0])
        except Exception:
            logger.exception("[SO] matcher failed, killing request %s", metadata.request_id)
            matcher.set_aborted("SO matcher runtime failure in update_so_status")
            return -1, preferred

    def _masked_choice(self, preferred: int, mask: torch.Tensor) -> int:
        if _allowed(mask, preferred):
            return preferred
        allowed = _allowed_ids(mask)
        # A mask that allows nothing leaves every logit at -inf, whose argmax is token 0;
        # DeepInfer's matcher rejects it on the next step and ends the request.
        return allowed[0] if allowed else 0

    def _plan(self, request: _Request, params: Any, preferred: int) -> int:
        """The simulated engine's grammar planner's choice (a value that completes within
        max_tokens); the twin keeps to the script when the planner cannot be built."""
        if request.planner_failed:
            return preferred
        if request.planner is None:
            from deepinfer_server.grammar import GrammarCompiler, SimulatedMatcher, Vocab

            try:
                if self._grammar is None:
                    vocab = Vocab.from_tokenizer_json(self._tokenizer_json, self._vocab_size)
                    self._grammar = GrammarCompiler(vocab)
                request.planner = SimulatedMatcher.from_so_args(
                    params.so_args, self._grammar, params.max_tokens
                )
            except Exception:
                logger.warning("the twin's grammar planner failed; following the script")
                request.planner_failed = True
                return preferred
        try:
            return int(request.planner.choose(preferred))
        except Exception:
            request.planner_failed = True
            return preferred


def describe_processed_images(multi_modal_data: Any) -> str:
    """`[image 1: 644x476 sha256:0123abcd] ` per image DeepInfer's processor prepared: its size
    as resized for the vision encoder and a digest of its pixels."""
    if not isinstance(multi_modal_data, dict):
        return ""
    sizes = multi_modal_data.get("images_input_size")
    pixels = multi_modal_data.get("images_raw")
    if sizes is None or pixels is None:
        return ""
    raw = pixels.contiguous().view(torch.uint8).numpy().tobytes()
    parts = []
    offset = 0
    for index, (width, height) in enumerate(sizes.tolist()):
        length = width * height * 3
        digest = hashlib.sha256(raw[offset : offset + length]).hexdigest()[:8]
        offset += length
        parts.append(f"[image {index + 1}: {width}x{height} sha256:{digest}] ")
    return "".join(parts)


def _allowed(mask: torch.Tensor, token: int) -> bool:
    word = int(mask[token >> 5]) & 0xFFFFFFFF
    return bool(word >> (token & 31) & 1)


def _allowed_ids(mask: torch.Tensor) -> list[int]:
    words = mask.to(torch.int64) & 0xFFFFFFFF
    found: list[int] = []
    for index in torch.nonzero(words).flatten().tolist():
        word = int(words[index])
        for bit in range(32):
            if word >> bit & 1:
                found.append(index * 32 + bit)
        if found:
            return found
    return found
