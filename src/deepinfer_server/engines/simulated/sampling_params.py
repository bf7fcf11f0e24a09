"""SamplingParams with DeepInfer 0.1.0's fields, defaults and validation (sampling_params.py)."""

from __future__ import annotations

import random

from deepinfer_server.engines.simulated.inputs import SoArgs

_MIN_TEMPERATURE = 1e-5
_INT32_MAX = 2**31 - 1


class SamplingParams:
    """Per-request sampling settings; validated on construction exactly as DeepInfer does."""

    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        ignore_eos: bool = False,
        max_tokens: int = 16,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
        first_n_token_no_eos: int = 0,
        eos_id: int = 0,
        so_args: SoArgs | None = None,
        golden_token_ids: list[int] | None = None,
        seq_seed: int | None = None,
    ) -> None:
        del logprobs  # accepted and discarded, as in DeepInfer
        if max_tokens == 0:
            max_tokens = 1
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.prompt_logprobs = prompt_logprobs
        self.top_logprobs = top_logprobs
        self.first_n_token_no_eos = first_n_token_no_eos
        self.eos_id = eos_id
        self.so_args = so_args
        self.golden_token_ids = golden_token_ids
        if seq_seed is None:
            seq_seed = random.getrandbits(64)
        elif not isinstance(seq_seed, int):
            raise TypeError()
        self.seq_seed = seq_seed & 0xFFFF_FFFF_FFFF_FFFF
        self._verify()
        if self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
            self.top_p = 1.0
            self.top_k = -1

    def _verify(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0 or self.top_k > _INT32_MAX:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0 <= self.top_logprobs <= 1000:
            raise ValueError(f"top_logprobs must be in [0, 1000], got {self.top_logprobs}.")
