"""Prefix-aware rank choice: send a request to the DP rank that holds its prompt's longest
cached prefix, unless that rank is much more loaded than the least-loaded one.

Pure functions of the in-flight counts (unit-tested without processes). The rule is the one
of SGLang's and vLLM Router's `cache_aware` policy across replicas (`--cache-threshold 0.3`,
`--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`), with the absolute threshold
scaled to one rank's running capacity: 64 requests is a quarter of a replica running 256, so a
rank of `--max-num-seqs` 16 is "much more loaded" at 4 more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class RankHint(Protocol):
    """What a request's rank choice goes by besides load (`PrefixHint`, `RouteHint`)."""

    def choose(self, in_flight: Sequence[int], least: int) -> int:
        """The rank for the request, given each rank's requests in flight and the least-loaded
        rank `least`."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixRouting:
    """When a request goes to the rank that holds its prefix instead of the least-loaded one."""

    #: Requests a rank runs at once (`--max-num-seqs`); beyond it a request waits for a slot.
    running_slots: int
    #: The held prefix must cover more than this share of the prompt (the routers'
    #: `--cache-threshold`).
    cache_threshold: float = 0.3
    #: Prefixes shorter than this are not worth a less even spread (the engines cache none).
    min_tokens: int = 256
    #: "Much more loaded": more than `balance_abs` requests more in flight than the least-loaded
    #: rank AND more than `balance_rel` times as many (the routers' balance thresholds).
    balance_abs: int = 4
    balance_rel: float = 1.5

    @classmethod
    def for_ranks_of(cls, max_num_seqs: int) -> PrefixRouting:
        """The thresholds for ranks of `max_num_seqs` running requests each."""
        return cls(running_slots=max_num_seqs, balance_abs=max(2, max_num_seqs // 4))

    def much_more_loaded(self, loaded: int, least: int) -> bool:
        """Whether a rank with `loaded` requests in flight is much more loaded than one with
        `least`: past the balance thresholds, or full (the request would wait for a slot) while
        the other has a free one."""
        if loaded >= self.running_slots > least:
            return True
        return loaded - least > self.balance_abs and loaded > self.balance_rel * least


@dataclass(frozen=True, slots=True)
class PrefixHint:
    """What each rank is believed to hold of one prompt, for the rank choice."""

    #: Per rank, the prompt tokens of the longest prefix it holds (a multiple of the block).
    held_tokens: Sequence[int]
    prompt_tokens: int
    policy: PrefixRouting

    def worth(self, tokens: int) -> bool:
        """Whether a held prefix of `tokens` is worth a less even spread: long enough, and a
        large enough share of the prompt."""
        policy = self.policy
        return tokens >= policy.min_tokens and tokens > policy.cache_threshold * self.prompt_tokens

    def holds(self, rank: int) -> bool:
        """Whether `rank` holds the prompt's longest known prefix, one worth routing by."""
        tokens = self.held_tokens[rank]
        return tokens == max(self.held_tokens) and self.worth(tokens)

    def choose(self, in_flight: Sequence[int], least: int) -> int:
        """The rank holding the longest prefix (the less loaded one on ties) when the prefix
        is worth it and that rank is not much more loaded than `least`; else `least`."""
        held = self.held_tokens
        best = max(range(len(held)), key=lambda rank: (held[rank], -in_flight[rank]))
        if not self.worth(held[best]):
            return least
        if self.policy.much_more_loaded(in_flight[best], in_flight[least]):
            return least
        return best
