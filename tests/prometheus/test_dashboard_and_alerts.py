"""The Prometheus lane (marker `prometheus`): deploy/'s dashboard and alerts on a real Prometheus.

promtool checks the rules and the sample configuration and runs the alerts' unit tests
(tests/prometheus/data/alerts_test.yml: each alert fires past its threshold, and only there). Then a
simulated DP=2 server runs under load (successes on two endpoints, 429 refusals, 400s and 404s,
disconnects, then a killed rank and 503s); Debian's Prometheus scrapes it every second with the
job of deploy/prometheus/prometheus.yml and loads deploy/prometheus/alerts.yml, and:

- every panel query of the Grafana dashboard (its variables set to "All", `$__rate_interval`
  to two minutes) evaluates without error to finite values, with the labels its legend shows, and
  every variable query finds values;
- every alerting rule is healthy in Prometheus, each side of its comparison returns data with
  the labels its annotations print, and the failure alerts fire once a rank is killed and once
  the server is gone.

"Returns data" is required of every query, except that one may be empty when every metric it
reads that Prometheus has no series of is in `deploy_queries.NOT_YET_EXPORTED`, and that a
quantile of the KV-transfer histograms (which only prefill/decode servers observe) may be NaN on
this NORMAL server: a second test requires their values from a prefill/decode pair that moved KV.
Synchronisation is by polling Prometheus with a deadline for the samples the load must have
produced. Install Prometheus with scripts/install-prometheus.sh; without it the lane skips.
"""

from __future__ import annotations

import math
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from openai import Stream
from openai.types.chat import ChatCompletionChunk

from tests import deploy_queries
from tests.conftest import MODEL, NO_THINKING
from tests.lanes import require_disaggregation
from tests.paths import PD_SECRET_ARGS
from tests.prometheus.live import LivePrometheus, QueryError, binary
from tests.routers.fleet import wait_for
from tests.server import LiveServer

pytestmark = pytest.mark.prometheus

#: Two ranks of two sequences and no queue: admission capacity 4, so a fifth request is a 429.
#: The ranks speculate, so the speculative-decoding panels have drafts to show.
SERVER_ARGS = (
    "--ep", "2", "--dp", "2", "--max-num-seqs", "2", "--max-queued-requests", "0",
    "--sim-ttft-ms", "5", "--sim-itl-ms", "5", "--max-model-len", "4096",
    "--speculative-tokens", "2",
)  # fmt: skip
CAPACITY = 4
REFUSED_PER_BURST = 3
SCRAPE_TIMEOUT = 30.0
ALERT_TESTS = Path(__file__).parent / "data" / "alerts_test.yml"


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_check_rules_passes() -> None:
    result = run_promtool("check", "rules", str(deploy_queries.ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(deploy_queries.alert_rules())} rules found" in result.stdout


def test_promtool_check_config_passes_on_the_sample_config() -> None:
    """The sample configuration, with the rule file it names (alerts.yml beside it)."""
    result = run_promtool("check", "config", str(deploy_queries.PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_promtool_alert_tests_pass_and_cover_every_alert() -> None:
    """data/alerts_test.yml: every alert fires on synthetic series past its threshold, with its
    labels and rendered annotations, and not on a server below it."""
    result = run_promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    fired = {
        case["alertname"]
        for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == {rule.name for rule in deploy_queries.alert_rules()}


def lane_config(server: LiveServer) -> dict[str, Any]:
    """The sample configuration's job, aimed at `server` every second, with the alerts."""
    sample = yaml.safe_load(deploy_queries.PROMETHEUS_CONFIG.read_text())
    (job,) = [job for job in sample["scrape_configs"] if job["job_name"] == deploy_queries.JOB]
    job = {
        **job,
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}],
    }
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(deploy_queries.ALERTS)],
        "scrape_configs": [job],
    }


class Load:
    """Drives requests of every outcome through the official client; counts what it caused."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.client = openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        )
        self.caused: Counter[str] = Counter()

    def stream(self, max_tokens: int) -> Stream[ChatCompletionChunk]:
        """A chat stream that has started (admitted, first chunk read)."""
        stream = self.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "again"}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True, **NO_THINKING},
        )
        next(iter(stream))
        return stream

    def burst(self) -> None:
        held = [self.stream(max_tokens=3000) for _ in range(CAPACITY)]
        for _ in range(REFUSED_PER_BURST):
            with pytest.raises(openai.RateLimitError):
                self.stream(max_tokens=8)
            self.caused["429"] += 1
        for stream in held:
            stream.close()
        wait_for(self._idle, "every held stream's slot released", 30)
        for max_tokens in (4, 64):
            self.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=max_tokens,
                extra_body=NO_THINKING,
            )
            self.caused["success"] += 1
        self.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16)
        self.caused["success"] += 1
        with pytest.raises(openai.NotFoundError):
            self.client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        self.caused["404"] += 1
        with pytest.raises(openai.BadRequestError):
            self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
            )
        self.caused["400"] += 1

    def _idle(self) -> bool:
        return bool(httpx.get(f"{self.server.base_url}/get_load", timeout=5).json()["load"] == 0)

    def refused_by_failed_service(self) -> None:
        with pytest.raises(openai.InternalServerError) as refused:
            self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert refused.value.status_code == 503
        self.caused["503"] += 1


def scraped(prometheus: LivePrometheus, load: Load) -> bool:
    """Prometheus holds every request the load caused (as Prometheus sees the counters now)."""
    seen = {
        "success": "sum(deepinfer:request_success_total)",
        "429": 'sum(deepinfer:request_failure_total{status="429"})',
        "400": 'sum(deepinfer:request_failure_total{status="400"})',
        "404": 'sum(deepinfer:request_failure_total{status="404"})',
        "503": 'sum(deepinfer:request_failure_total{status="503"})',
    }
    return all(prometheus.value(seen[outcome]) >= n for outcome, n in load.caused.items())


def nowhere(series: dict[str, str]) -> bool:
    return False


def everywhere(series: dict[str, str]) -> bool:
    return True


def problems_with(
    prometheus: LivePrometheus,
    where: str,
    expr: str,
    labels: set[str],
    nan_allowed: Callable[[dict[str, str]], bool] = nowhere,
) -> list[str]:
    """What is wrong with the answer to `expr`: an error, no data, a non-finite value (NaN is
    allowed on the series `nan_allowed` accepts: where nothing was observed), or a series
    without one of `labels`."""
    try:
        result = prometheus.query(expr)
    except QueryError as error:
        return [f"{where}: {error}\n    {expr}"]
    if not result:
        unscraped = {
            name
            for name in deploy_queries.metric_names(expr)
            if not prometheus.query(f'count({{__name__="{name}"}})')
        }
        if unscraped and unscraped <= deploy_queries.NOT_YET_EXPORTED.keys():
            return []  # empty only for want of metrics the server does not export yet
        return [f"{where}: no data (no series of {sorted(unscraped)})\n    {expr}"]
    found = []
    for series in result:
        value = float(series["value"][1])
        if not math.isfinite(value) and not (math.isnan(value) and nan_allowed(series["metric"])):
            found.append(f"{where}: {value} for {series['metric']}\n    {expr}")
        if missing := labels - series["metric"].keys():
            found.append(f"{where}: series {series['metric']} lacks {sorted(missing)}")
    return found


def reads_only_disaggregation_series(expr: str) -> bool:
    return deploy_queries.metric_names(expr) <= deploy_queries.OBSERVED_ONLY_WITH_DISAGGREGATION


def dashboard_problems(prometheus: LivePrometheus) -> list[str]:
    """On a NORMAL server: a query reading only histograms that only prefill/decode servers
    observe may be NaN (test_disaggregation_panels_return_data_from_a_prefill_decode_pair
    requires their values)."""
    variables = deploy_queries.dashboard_variable_names()
    found = []
    for panel in deploy_queries.panel_queries():
        expr = deploy_queries.substitute(panel.expr, variables)
        where = f"panel {panel.panel!r} {panel.ref_id}"
        nan_allowed = everywhere if reads_only_disaggregation_series(expr) else nowhere
        found += problems_with(prometheus, where, expr, panel.legend_labels, nan_allowed)
    for variable in deploy_queries.variable_queries():
        selector = deploy_queries.substitute(variable.selector, variables)
        values = prometheus.api(f"label/{variable.label}/values", **{"match[]": selector})
        if not values:
            found.append(f"variable {variable.name}: no values of {variable.label} in {selector}")
    return found


def rule_problems(prometheus: LivePrometheus) -> list[str]:
    """As `dashboard_problems`, for each alerting rule's operands."""
    found = []
    for rule in deploy_queries.alert_rules():
        for index, operand in enumerate(deploy_queries.operands(rule.expr)):
            # The alert's labels are those of its first operand.
            labels = rule.template_labels if index == 0 else set()
            nan_allowed = everywhere if reads_only_disaggregation_series(operand) else nowhere
            found += problems_with(prometheus, f"alert {rule.name}", operand, labels, nan_allowed)
    return found


def evaluated_rules(prometheus: LivePrometheus) -> list[dict[str, Any]] | None:
    """Every alerting rule as Prometheus reports it, once each has been evaluated."""
    rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
    return rules if all(rule["health"] != "unknown" for rule in rules) else None


def firing(prometheus: LivePrometheus, alert: str) -> list[dict[str, Any]]:
    (rule,) = [rule for rule in deploy_queries.alert_rules() if rule.name == alert]
    return prometheus.query(rule.expr)


def test_every_panel_and_rule_returns_data_from_a_server_under_load(tmp_path: Path) -> None:
    binary("prometheus")  # skip before starting anything
    with (
        LiveServer(*SERVER_ARGS) as server,
        LivePrometheus(lane_config(server), tmp_path) as prometheus,
    ):
        up = f'up{{job="{deploy_queries.JOB}"}}'
        wait_for(lambda: prometheus.value(up) == 1, "Prometheus scraping the server", 30)
        load = Load(server)
        # Two bursts with a scrape between them: every counter and histogram series exists at an
        # earlier scrape and grows after it, so rates are not 0 for want of a first sample.
        for _ in range(2):
            load.burst()
            wait_for(lambda: scraped(prometheus, load), f"Prometheus seeing {load.caused}", 30)
        assert prometheus.value('sum(deepinfer:request_failure_total{status="429"})') == 6
        assert prometheus.value("sum(rate(deepinfer:generation_tokens_total[1m]))") > 0

        # A rank dies under requests: the service fails, the requests on it are lost, and
        # what comes next is refused with 503 (twice, with a scrape between, as above).
        held = [load.stream(max_tokens=3000) for _ in range(CAPACITY)]
        server.rank_processes()[1].kill()
        for stream in held:
            with pytest.raises(openai.APIError):
                for _ in stream:
                    pass
        # The lost streams count as 503s too and may reach the same scrape as the first
        # refusal: wait for each refusal's own increase, so the 5xx series has two samples.
        refused = 'sum(deepinfer:request_failure_total{status="503"})'
        for _ in range(2):
            before = prometheus.value(refused)
            load.refused_by_failed_service()
            wait_for(
                lambda before=before: prometheus.value(refused) > before,
                f"Prometheus seeing the 503 after {before:g}",
                30,
            )
            wait_for(lambda: scraped(prometheus, load), f"Prometheus seeing {load.caused}", 30)
        wait_for(
            lambda: prometheus.value("min(deepinfer:healthy)") == 0 and evaluated_rules(prometheus),
            "Prometheus seeing the failed service and evaluating every rule",
            SCRAPE_TIMEOUT,
        )
        # The two minutes that $__rate_interval spans holds both phases: the 5xx panels need the
        # second.
        problems = dashboard_problems(prometheus)
        assert not problems, "dashboard queries:\n" + "\n".join(problems)
        rules = evaluated_rules(prometheus)
        assert rules is not None
        unhealthy = [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] != "ok"]
        assert not unhealthy, "rules Prometheus cannot evaluate:\n" + "\n".join(unhealthy)
        assert len(rules) == len(deploy_queries.alert_rules())
        problems = rule_problems(prometheus)
        assert not problems, "alerting rules:\n" + "\n".join(problems)
        for alert in ("DeepinferServerFailed", "DeepinferRankFailure"):
            (fired,) = firing(prometheus, alert)
            assert fired["metric"]["instance"] == f"127.0.0.1:{server.port}", alert

        server.kill_tree()
        wait_for(
            lambda: firing(prometheus, "DeepinferServerDown"),
            "DeepinferServerDown's condition once the server is gone",
            SCRAPE_TIMEOUT,
        )


#: Four KV blocks (128 tokens each) of prompt.
PD_QUESTION = "Tell me about the lighthouse keeper and the storm that night. " * 40


def pd_handoff(prefill: LiveServer, decode: LiveServer) -> None:
    """One request through both legs, as a PD gateway sends it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PD_QUESTION}]}
    leg = httpx.post(
        f"{prefill.base_url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30
    )
    assert leg.status_code == 200, leg.text
    params = leg.json()["kv_transfer_params"]
    answer = httpx.post(
        f"{decode.base_url}/v1/chat/completions",
        json={**body, "max_tokens": 8, "kv_transfer_params": params},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


@pytest.mark.disaggregation
def test_disaggregation_panels_return_data_from_a_prefill_decode_pair(tmp_path: Path) -> None:
    """The panel queries and alert operands over the KV-transfer series, which a NORMAL server
    never moves, return finite values from a prefill server and a decode server that moved KV."""
    binary("prometheus")
    require_disaggregation()
    common = ("--sim-ttft-ms", "5", "--sim-itl-ms", "2", "--max-model-len", "4096")
    with (
        LiveServer(*common, *PD_SECRET_ARGS, "--disaggregation-mode", "prefill",
                   "--disaggregation-bootstrap-port", "0") as prefill,
        LiveServer(*common, *PD_SECRET_ARGS, "--disaggregation-mode", "decode") as decode,
    ):  # fmt: skip
        config = lane_config(prefill)
        config["scrape_configs"][0]["static_configs"] = [
            {"targets": [f"127.0.0.1:{server.port}" for server in (prefill, decode)]}
        ]
        with LivePrometheus(config, tmp_path) as prometheus:
            waited = "sum(deepinfer:kv_transfer_wait_seconds_count)"
            # A first sample of every series before any transfer, so the rates see the growth.
            up = f'count(up{{job="{deploy_queries.JOB}"}} == 1)'
            wait_for(
                lambda: prometheus.value(up) == 2 and prometheus.query(waited),
                "Prometheus scraping both servers",
                30,
            )
            for _ in range(3):
                pd_handoff(prefill, decode)
            wait_for(lambda: prometheus.value(waited) == 3, "Prometheus seeing 3 transfers", 30)
            variables = deploy_queries.dashboard_variable_names()

            def on_prefill(series: dict[str, str]) -> bool:
                return series.get("instance") == f"127.0.0.1:{prefill.port}"

            checked, found = 0, []
            for panel in deploy_queries.panel_queries():
                expr = deploy_queries.substitute(panel.expr, variables)
                if reads_only_disaggregation_series(expr):
                    checked += 1
                    where = f"panel {panel.panel!r} {panel.ref_id}"
                    found += problems_with(prometheus, where, expr, panel.legend_labels)
            for rule in deploy_queries.alert_rules():
                for index, operand in enumerate(deploy_queries.operands(rule.expr)):
                    if reads_only_disaggregation_series(operand):
                        checked += 1
                        labels = rule.template_labels if index == 0 else set()
                        # Per server: the prefill server pulls no KV, so observes none.
                        found += problems_with(
                            prometheus, f"alert {rule.name}", operand, labels, on_prefill
                        )
    assert checked >= 6  # four panel queries, two alerts
    assert not found, "queries:\n" + "\n".join(found)
