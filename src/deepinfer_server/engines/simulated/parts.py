"""The simulated engine's parts, built from its construction arguments.

The tokenizer and its EOS, the answer scripts, the grammar builds, the KV pool, the prefix cache
and its state slots, the queues and the token generator: what `LLMEngine` wires together, with
the token bounds DeepInfer derives from its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenizers import Tokenizer

from deepinfer_server.engines.simulated.kv_blocks import KVBlocks, default_pool
from deepinfer_server.engines.simulated.matcher_builds import MatcherBuilds
from deepinfer_server.engines.simulated.prefix_cache import MAX_ROLLBACK, PrefixCache
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.script import ScriptWriter
from deepinfer_server.engines.simulated.state_slots import StateSlots
from deepinfer_server.engines.simulated.token_generator import TokenGenerator
from deepinfer_server.model.tokens import EOS_TOKEN
from deepinfer_server.prefix_cache.host_tier import HostTier, HostTierSettings
from deepinfer_server.prefix_cache.store_tier import StoreTier


class PartsArgs(Protocol):
    """The construction arguments the parts read (`engine.SimEngineArgs` has them all)."""

    tokenizer_json: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    tokens_per_step: int
    speculative_tokens: int
    kv_blocks: int | None
    enable_prefix_caching: bool
    prefix_cache_retention_share: float
    host_tier: HostTierSettings | None
    store_tier: StoreTier | None
    prefill_tokens_per_s: float


@dataclass(frozen=True)
class EngineParts:
    """One engine's parts and the token bounds of its prompt steps."""

    tokenizer: Tokenizer
    eos_id: int
    vocab_size: int
    script: ScriptWriter
    builds: MatcherBuilds
    kv: KVBlocks
    cache: PrefixCache
    table: RequestTable
    generator: TokenGenerator
    #: The prompt tokens one step computes at most (DeepInfer's max_num_batched_tokens).
    batched_tokens: int
    #: The longest prompt a prefill accepts.
    prompt_limit: int

    @classmethod
    def build(cls, args: PartsArgs, step_tokens: int) -> EngineParts:
        """The parts of an engine whose decode step takes `step_tokens` tokens a sequence."""
        tokenizer = Tokenizer.from_str(args.tokenizer_json)
        eos = tokenizer.token_to_id(EOS_TOKEN)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        kv = KVBlocks(args.kv_blocks or default_pool(args.max_num_seqs, args.max_model_len))
        # DeepInfer's default max_num_batched_tokens (config.py:219-228); without chunked
        # prefill it bounds both the prompt length and the prompt tokens of one step.
        batched_tokens = args.max_num_batched_tokens or max(
            args.max_model_len, 4096, args.max_num_seqs * step_tokens
        )
        prompt_limit = min(args.max_model_len, batched_tokens)
        cache = PrefixCache(
            kv,
            StateSlots.for_running(args.max_num_seqs),
            enabled=args.enable_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            batched_tokens=batched_tokens,
            prompt_limit=prompt_limit,
            host=None if args.host_tier is None else HostTier(args.host_tier, MAX_ROLLBACK),
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            store=args.store_tier,
            retention_share=args.prefix_cache_retention_share,
        )
        table = RequestTable(kv, cache)
        eos_id = 1 if eos is None else int(eos)
        generator = TokenGenerator(
            table,
            eos_id,
            vocab_size,
            args.max_model_len,
            args.tokens_per_step,
            args.max_num_batched_tokens or 0,
            args.speculative_tokens,
        )
        return cls(
            tokenizer=tokenizer,
            eos_id=eos_id,
            vocab_size=vocab_size,
            script=ScriptWriter(tokenizer),
            builds=MatcherBuilds(args.tokenizer_json, vocab_size),
            kv=kv,
            cache=cache,
            table=table,
            generator=generator,
            batched_tokens=batched_tokens,
            prompt_limit=prompt_limit,
        )
