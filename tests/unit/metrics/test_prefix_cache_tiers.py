"""The prefix-cache families split hits by tier and show the host tier's copies and occupancy:
counters summed over the ranks, occupancy per rank."""

from __future__ import annotations

from prometheus_client.core import Metric

from deepinfer_server.ipc.messages import HostTierStats, PrefixCacheStats
from deepinfer_server.metrics.aggregate import SEEN_BY_EVERY_PROCESS
from deepinfer_server.metrics.prefix_cache import PREFIX_CACHE_FAMILIES, PrefixCacheFamilies


def _samples(metrics: list[Metric]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for metric in metrics
        for sample in metric.samples
    }


def test_hits_split_by_tier_and_the_host_tier_is_summed_and_shown_per_rank() -> None:
    families = PrefixCacheFamilies("m")
    host = HostTierStats(700, 7_000, 0.5, 9_000, 0.25, 3, 40_000, 64_000)
    families.add(["m", "0"], PrefixCacheStats(5_000, 1_000, 2, host))
    families.add(["m", "1"], PrefixCacheStats(2_000, 500, 1))
    families.add(["m", "2"], None)
    samples = _samples(list(families.families()))
    model = (("model_name", "m"),)

    def tier(name: str) -> float:
        key = ("deepinfer:prefix_cache_hit_tokens_total", (*model, ("tier", name)))
        return samples[key]

    assert samples[("deepinfer:prefix_cache_hits_total", model)] == 1_500
    assert (tier("gpu"), tier("host")) == (800, 700)
    assert samples[("deepinfer:prefix_cache_host_restore_bytes_total", model)] == 7_000
    assert samples[("deepinfer:prefix_cache_host_restore_seconds_total", model)] == 0.5
    assert samples[("deepinfer:prefix_cache_host_offload_bytes_total", model)] == 9_000
    assert samples[("deepinfer:prefix_cache_host_offload_seconds_total", model)] == 0.25
    for rank, held, budget in (("0", 40_000, 64_000), ("1", 0, 0), ("2", 0, 0)):
        labels = (("dp_rank", rank), *model)
        assert samples[("deepinfer:prefix_cache_host_bytes", labels)] == held
        assert samples[("deepinfer:prefix_cache_host_budget_bytes", labels)] == budget
    assert samples[("deepinfer:prefix_cache_host_sequences", (("dp_rank", "0"), *model))] == 3


def test_every_prefix_cache_family_is_taken_from_one_process() -> None:
    names = {metric.name for metric in PrefixCacheFamilies("m").families()}
    assert names == {"deepinfer:" + name for name in PREFIX_CACHE_FAMILIES}
    assert names <= SEEN_BY_EVERY_PROCESS


def test_the_store_tiers_hits_and_errors_are_their_own() -> None:
    families = PrefixCacheFamilies("m")
    # 700 restored through the host tier, 512 of them first brought from the shared store.
    host = HostTierStats(700, 7_000, 0.5, 9_000, 0.25, 3, 40_000, 64_000, 512, 2)
    families.add(["m", "0"], PrefixCacheStats(5_000, 1_000, 2, host))
    families.add(["m", "1"], PrefixCacheStats(2_000, 300, 1, HostTierStats(*[0] * 8, 0, 1)))
    samples = _samples(list(families.families()))
    model = (("model_name", "m"),)

    def tier(name: str) -> float:
        return samples[("deepinfer:prefix_cache_hit_tokens_total", (*model, ("tier", name)))]

    assert (tier("gpu"), tier("host"), tier("store")) == (600, 188, 512)
    assert samples[("deepinfer:prefix_cache_store_errors_total", model)] == 3
