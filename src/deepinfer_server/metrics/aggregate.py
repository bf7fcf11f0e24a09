"""One consistent view of the metrics of several API server processes (`--api-server-count`).

Each API server process observes the requests it serves; on a scrape, the process that answers
asks the others for a `Snapshot` and sums it into its own samples, so every request is counted
once whichever process answers. What every process sees alike is taken from the answering one
alone: every rank sends its step reports to every process, so the step histogram, the KV-cache
usage, the prefix-cache counters and health are the same everywhere (summing them would count
them N times).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from deepinfer_server.metrics.prefix_cache import PREFIX_CACHE_FAMILIES
from deepinfer_server.metrics.registry import PREFIX, RankLoad, ServerMetrics

#: Families every process holds in full: taken from the answering process, never summed.
SEEN_BY_EVERY_PROCESS = frozenset(
    PREFIX + name
    for name in (
        "engine_step_seconds",
        "kv_cache_usage_perc",
        *PREFIX_CACHE_FAMILIES,
        "healthy",
        # Read from admission's counts, which every process shares.
        "tenant_requests_running",
        "tenant_requests_queued",
        "prompt_tokens_computed",
        "kv_transfer_bytes",
        "kv_transfer_failures",
        "kv_transfer_held_requests",
        "kv_transfer_seconds",
        "kv_transfer_wait_seconds",
        "kv_transfer_transport_info",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    )
)

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Snapshot:
    """What one API server process contributes to the others' views (picklable)."""

    #: Family name -> (sample name, sorted labels) -> value, for the summed families.
    families: dict[str, dict[SampleKey, float]] = field(default_factory=dict)
    rank_loads: list[RankLoad] = field(default_factory=list)


def take_snapshot(metrics: ServerMetrics, rank_loads: list[RankLoad]) -> Snapshot:
    """This process's samples of every summed family, and its requests' rank loads."""
    families: dict[str, dict[SampleKey, float]] = {}
    for family in metrics.registry.collect():
        if family.name in SEEN_BY_EVERY_PROCESS:
            continue
        families[family.name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
        }
    return Snapshot(families, rank_loads)


def merge_loads(own: Sequence[RankLoad], others: Iterable[Snapshot]) -> list[RankLoad]:
    """Requests and tokens summed over the processes; KV-cache usage and prefix-cache
    counters from `own`."""
    merged = list(own)
    for snapshot in others:
        for load in snapshot.rank_loads:
            mine = merged[load.rank]
            merged[load.rank] = mine._replace(
                running=mine.running + load.running,
                waiting=mine.waiting + load.waiting,
                tokens=mine.tokens + load.tokens,
            )
    return merged


class _MergedView:
    """A registry-like collector: `metrics`' families with the others' samples added."""

    def __init__(self, metrics: ServerMetrics, others: Sequence[Snapshot]) -> None:
        self._metrics = metrics
        self._others = others

    def collect(self) -> Iterator[Metric]:
        for family in self._metrics.registry.collect():
            if family.name in SEEN_BY_EVERY_PROCESS:
                yield family
                continue
            values: dict[SampleKey, float] = {}
            for sample in family.samples:
                values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            for snapshot in self._others:
                for key, value in snapshot.families.get(family.name, {}).items():
                    values[key] = values.get(key, 0.0) + value
            merged = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples = [
                Sample(name, dict(labels), value) for (name, labels), value in values.items()
            ]
            yield merged


def merged_exposition(metrics: ServerMetrics, others: Sequence[Snapshot]) -> bytes:
    """The Prometheus text format of `metrics` with the other processes' snapshots summed in."""
    return bytes(prometheus_client.generate_latest(_MergedView(metrics, others)))
