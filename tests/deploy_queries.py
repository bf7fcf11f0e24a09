"""The PromQL that deploy/ ships: the Grafana dashboard's panel and variable queries and the
alerting rules, read from the files as Grafana and Prometheus read them.

`NOT_YET_EXPORTED` is the one list of metric names the dashboard may use before the server
exports them: in the Prometheus lane a query may come back empty only when the metrics it reads
that Prometheus has no series of are all on the list; every other query must return data. The
names check fails as soon as the server exports one of them (so the entry is removed the day the
metric exists).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import yaml

from tests.paths import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "deepinfer-server.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
#: The scrape job alerts.yml selects `up` by.
JOB = "deepinfer-server"

#: Metrics shown on the dashboard before the server exports them, with the labels they are to
#: have. Keep this short: remove a name the day the server exports it.
NOT_YET_EXPORTED: Mapping[str, frozenset[str]] = MappingProxyType({})

#: Series every server exports but only prefill/decode servers move (a KV transfer happens only
#: between them): on a NORMAL server a quantile or a ratio of them is NaN (Grafana's "No data";
#: an alert comparing NaN does not fire), so the Prometheus lane checks the queries that read
#: only these on a prefill/decode pair.
OBSERVED_ONLY_WITH_DISAGGREGATION = frozenset(
    {
        "deepinfer:kv_transfer_seconds_bucket",
        "deepinfer:kv_transfer_seconds_count",
        "deepinfer:kv_transfer_wait_seconds_bucket",
        "deepinfer:kv_transfer_failures_total",
    }
)

#: What Grafana puts in place of its own variables, for a dashboard showing the last few minutes
#: of a Prometheus that scrapes every second. `$__rate_interval` must span the lane's load (it
#: takes well under a minute).
GRAFANA_VARIABLES = {
    "$__rate_interval": "2m",
    "$__interval": "15s",
    "$__range": "5m",
}
#: A dashboard variable with "All" selected (`allValue`).
ALL = ".+"

METRIC_NAME = re.compile(r"\bdeepinfer:[A-Za-z0-9_:]+")
_SELECTOR = re.compile(r"(\b[A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_TEMPLATE_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$")


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel."""

    panel: str
    ref_id: str
    expr: str
    legend: str

    @property
    def legend_labels(self) -> set[str]:
        """The labels the legend shows (`{{dp_rank}}`): every result series must carry them."""
        return set(_LEGEND_LABEL.findall(self.legend))


@dataclass(frozen=True)
class VariableQuery:
    """A dashboard variable's `label_values(selector, label)`."""

    name: str
    selector: str
    label: str


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    annotations: dict[str, str]

    @property
    def template_labels(self) -> set[str]:
        """The labels the annotations print (`$labels.instance`)."""
        return {
            label for text in self.annotations.values() for label in _TEMPLATE_LABEL.findall(text)
        }


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _panels(container: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those inside (collapsed) rows."""
    found = []
    for panel in container.get("panels", []):
        found.append(panel)
        found.extend(_panels(panel))
    return found


def panels() -> list[dict[str, Any]]:
    return _panels(dashboard())


def panel_queries() -> list[PanelQuery]:
    return [
        PanelQuery(panel["title"], target["refId"], target["expr"], target.get("legendFormat", ""))
        for panel in panels()
        for target in panel.get("targets", [])
    ]


def variable_queries() -> list[VariableQuery]:
    found = []
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text.strip())
        assert match, f"variable {variable['name']}: not a label_values(selector, label): {text}"
        found.append(VariableQuery(variable["name"], match.group(1), match.group(2)))
    return found


def alert_rules() -> list[AlertRule]:
    document = yaml.safe_load(ALERTS.read_text())
    return [
        AlertRule(rule["alert"], rule["expr"], rule.get("annotations", {}))
        for group in document["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def substitute(expr: str, dashboard_variables: set[str]) -> str:
    """`expr` as Grafana sends it: its own variables replaced, every dashboard variable "All"."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    for name in sorted(dashboard_variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", ALL).replace("$" + name, ALL)
    assert "$" not in expr, f"a variable the test does not know is left in {expr}"
    return expr


def dashboard_variable_names() -> set[str]:
    return {variable["name"] for variable in dashboard()["templating"]["list"]}


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def selector_labels(expr: str) -> dict[str, set[str]]:
    """Metric name -> the label names its selectors match on, in `expr`."""
    found: dict[str, set[str]] = {}
    for name, matchers in _SELECTOR.findall(expr):
        found.setdefault(name, set()).update(_MATCHER.findall(matchers))
    return found


def grouping_labels(expr: str) -> set[str]:
    """The labels of every `by (...)` and `without (...)` in `expr`."""
    return {
        label.strip()
        for group in _GROUPING.findall(expr)
        for label in group.split(",")
        if label.strip()
    }


_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")
_SET_OPERATOR = re.compile(r"\b(?:and|or|unless)\b")
_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")


def operands(expr: str) -> list[str]:
    """The query operands of `expr`'s top-level comparisons and set operators.

    `sum(rate(x[5m])) / sum(rate(y[5m])) > 0.05` -> [`sum(rate(x[5m])) / sum(rate(y[5m]))`]:
    the part that must return data for the alert to be able to fire (the whole expression is
    empty while the alert is not firing). Number literals are left out; an expression without a
    top-level comparison is its own one operand.
    """
    parts: list[str] = []
    depth = 0
    quote: str | None = None
    start = 0
    i = 0
    while i < len(expr):
        char = expr[i]
        if quote:
            if char == "\\":
                i += 2
                continue
            if char == quote:
                quote = None
        elif char in "\"'`":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0:
            match = _COMPARISON.match(expr, i) or _SET_OPERATOR.match(expr, i)
            if match:
                parts.append(expr[start:i])
                i = start = match.end()
                if expr[i:].lstrip().startswith("bool"):
                    i = start = expr.index("bool", i) + len("bool")
                continue
        i += 1
    parts.append(expr[start:])
    return [part.strip() for part in parts if part.strip() and not _NUMBER.match(part.strip())]
