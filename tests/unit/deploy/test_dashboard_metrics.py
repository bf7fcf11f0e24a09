"""deploy/grafana and deploy/prometheus against the server's own /metrics, without Prometheus.

A renamed metric or label fails here at once: every `deepinfer:` name and every label that the
dashboard and the alerting rules select or group by must be in the exposition of a server that
has seen one request of each kind, unless it is one of `NOT_YET_EXPORTED`.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer_server.ipc.messages import AbortReason, EngineCounters
from deepinfer_server.metrics import RankLoad, RequestRecord, ServerMetrics
from tests import deploy_queries
from tests.deploy_queries import NOT_YET_EXPORTED

#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS = {"job", "instance"}


def exposition_labels() -> dict[str, set[str]]:
    """Sample name -> its label names, in the /metrics text of a server that has seen a
    successful request, a refused one, an abort, a step on each of two ranks, speculative
    decoding's drafts on one and a queued background response."""
    metrics = ServerMetrics("deepseek-flash")
    metrics.watch_ranks(
        lambda: [RankLoad(0, 1, 0, 40, 0.25), RankLoad(1, 0, 1, 30, 0.0)], lambda: True
    )
    record = RequestRecord(arrival=0.0, prompt_tokens=30, admitted_at=0.001)
    record.on_tokens(0.05, 1, 0.01)
    record.on_tokens(0.06, 1, 0.01)
    record.finish_reason = "stop"
    metrics.observe_engine_request(record)
    metrics.observe_success(record, 0.07)
    metrics.observe_failure(429)
    metrics.watch_background(lambda: {"queued": 1, "in_progress": 0})
    metrics.watch_batches(lambda: 2)
    metrics.observe_abort(AbortReason.RANK_FAILURE)
    for rank in (0, 1):
        metrics.observe_step(rank, 0.01)
    # A speculating rank's drafts (the per-position series exist once a draft was verified).
    metrics.observe_counters(
        0,
        EngineCounters(
            0,
            spec_drafts=2,
            spec_draft_tokens=4,
            spec_accepted_tokens=3,
            spec_accepted_per_position=[2, 1],
        ),
    )
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def every_query() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, variable query and alerting rule."""
    return [
        *((f"panel {q.panel!r} {q.ref_id}", q.expr) for q in deploy_queries.panel_queries()),
        *((f"variable {v.name}", v.selector) for v in deploy_queries.variable_queries()),
        *((f"alert {rule.name}", rule.expr) for rule in deploy_queries.alert_rules()),
    ]


def test_every_metric_name_is_in_the_exposition() -> None:
    exported = exposition_labels()
    missing = [
        f"{where}: {name}"
        for where, expr in every_query()
        for name in sorted(deploy_queries.metric_names(expr))
        if name not in exported and name not in NOT_YET_EXPORTED
    ]
    assert not missing, "not in /metrics:\n" + "\n".join(missing)


def test_every_selected_and_grouped_label_is_on_its_metrics() -> None:
    labels = {**exposition_labels(), **NOT_YET_EXPORTED}
    wrong = []
    for where, expr in every_query():
        names = deploy_queries.metric_names(expr) & labels.keys()  # the others fail the names test
        for name, selected in deploy_queries.selector_labels(expr).items():
            if name in names:
                wrong += [
                    f"{where}: {name}{{{label}}}"
                    for label in selected - labels[name] - TARGET_LABELS
                ]
        available = TARGET_LABELS.union(*(labels[name] for name in names))
        grouped = deploy_queries.grouping_labels(expr)
        wrong += [f"{where}: by {label}" for label in grouped - available]
    assert not wrong, "labels the metrics do not have:\n" + "\n".join(wrong)


def test_not_yet_exported_names_are_still_missing_and_used() -> None:
    """The allowance ends the day the server exports the metric: then remove it from the list."""
    exported = exposition_labels()
    assert not NOT_YET_EXPORTED.keys() & exported.keys(), "exported now: remove it from the list"
    used = set().union(*(deploy_queries.metric_names(expr) for _, expr in every_query()))
    assert used >= NOT_YET_EXPORTED.keys(), "no longer on the dashboard: remove it from the list"


def test_every_panel_reads_the_datasource_variable() -> None:
    (datasource,) = [
        v for v in deploy_queries.dashboard()["templating"]["list"] if v["name"] == "datasource"
    ]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    panels = deploy_queries.panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_the_dashboard_covers_the_operators_questions() -> None:
    """Each of an operator's questions keeps its metric on the dashboard: traffic and failures,
    tokens, latency quantiles, the queue, KV and prefix-cache use, health and refusals (429)."""
    exprs = " ".join(q.expr for q in deploy_queries.panel_queries())
    for name in [
        "deepinfer:request_success_total",
        "deepinfer:request_failure_total",
        "deepinfer:prompt_tokens_total",
        "deepinfer:generation_tokens_total",
        "deepinfer:time_to_first_token_seconds_bucket",
        "deepinfer:inter_token_latency_seconds_bucket",
        "deepinfer:e2e_request_latency_seconds_bucket",
        "deepinfer:num_requests_waiting",
        "deepinfer:num_requests_running",
        "deepinfer:kv_cache_usage_perc",
        "deepinfer:healthy",
        "deepinfer:prefix_cache_hits_total",
    ]:
        assert name in exprs, name
    assert 'status="429"' in exprs
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, " in exprs


def test_the_disaggregation_row_shows_the_transfer_metrics() -> None:
    """Prefill/decode: bytes/s, transfer time p50/p99, KV wait p99, failures by reason and
    prompt tokens computed per server, in one row; an alert on transfer failures."""
    panels = deploy_queries.panels()
    rows = [p for p in panels if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"] == "Disaggregation"]
    below = [
        q
        for q in deploy_queries.panel_queries()
        for p in panels
        if p["title"] == q.panel and p["type"] != "row" and p["gridPos"]["y"] > row["gridPos"]["y"]
    ]
    exprs = " ".join(q.expr for q in below)
    assert "rate(deepinfer:kv_transfer_bytes_total{" in exprs
    assert "rate(deepinfer:prompt_tokens_computed_total{" in exprs
    transfer_time = "sum by (le) (rate(deepinfer:kv_transfer_seconds_bucket{"
    for quantile in ("0.5", "0.99"):
        assert f"histogram_quantile({quantile}, {transfer_time}" in exprs
    assert (
        "histogram_quantile(0.99, sum by (le) (rate(deepinfer:kv_transfer_wait_seconds_bucket{"
        in exprs
    )
    (failures,) = [q for q in below if "kv_transfer_failures_total" in q.expr]
    assert "by (reason)" in failures.expr and failures.legend_labels == {"reason"}
    alerted = " ".join(rule.expr for rule in deploy_queries.alert_rules())
    assert "deepinfer:kv_transfer_failures_total" in alerted


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("up == 0", ["up"]),
        ("sum(a) / sum(b or c)\n  > 0.05", ["sum(a) / sum(b or c)"]),
        ('x{s=~"5.."} > bool y and z < 1e3', ['x{s=~"5.."}', "y", "z"]),
        ("histogram_quantile(0.9, sum by (le) (rate(b[5m])))", [
            "histogram_quantile(0.9, sum by (le) (rate(b[5m])))"
        ]),
    ],
)  # fmt: skip
def test_operands_split_only_top_level_comparisons(expr: str, expected: list[str]) -> None:
    assert deploy_queries.operands(expr) == expected
