"""The Grafana dashboard queries metrics that exist: the agents' OpenTelemetry instruments (the V2 models', and the
generative models' OTel GenAI histograms, KV-cache, preemption and stream gauges) under the names an OTLP collector
gives them in Prometheus, the control plane's own /metrics as a running one serves them, and the SLO recording rules
and alerts the control plane generates (`controlplane.slo.prometheus_rules`, read from a generated rule file, not a
list kept here); its label matchers, groupings and legends name labels those series carry (the agents' attributes,
dots to underscores; the rules' labels); and no query or colour step hard-codes an SLO's objective or burn rate."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from controlplane.app import create_app
from controlplane.schemas.slos import SloRead
from controlplane.settings import Settings
from controlplane.slo.prometheus_rules import rule_file
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from edge_agent.telemetry.probes import GPU_GAUGES
from spillway.contract import names
from tests.conftest import make_keys
from tests.utils.server import serving

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "spillway.json"
# The collector's Prometheus naming (OTel's Prometheus compatibility spec): dots to underscores, a unit suffix,
# `_total` for counters, `_ratio` for gauges of unit 1, and annotations such as `{request}` dropped.
UNITS = {"s": "seconds", "By": "bytes", "Cel": "celsius"}
NAME = re.compile(r"\b((?:spillway|hw|system|gen_ai)_[a-z0-9_]+)\b")
LABELS = re.compile(r"\{[^}]*\}|\bby \([^)]*\)|, \w+\)$")  # matchers, groupings, label_values' label: not metrics
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without) \(([^)]*)\)")
LEGEND = re.compile(r"\{\{(\w+)\}\}")
LABEL_VALUES = re.compile(r"label_values\([^,]*, (\w+)\)")
# Labels every scraped series has (the collector's `instance` is the agent id), histograms' `le`, and the GPU probes'.
COMMON_LABELS = {"instance", "job", "le", "hw_id", "hw_type"}
RULE_NAME = re.compile(r"\bslo:[a-z0-9_:]+")  # recording rules (Sloth's `slo:` names)
NAME_REGEX = re.compile(r'__name__=~"([^"]*)"')
ALERT_NAME = re.compile(r'\bALERTS\{[^}]*alertname="(\w+)"')
RELABELLED = re.compile(r'"(\w+)", "[^"]*", "", ""\)')  # label_replace(..., "dst", "value", "", "") in alert exprs
# A number compared against, `vector(<number>)`, or arithmetic on an objective: a threshold the SLOs should give.
HARD_CODED = re.compile(r"(?:[<>]=?|==|!=)\s*(?:bool\s+)?[\d.]|\bvector\(\s*[\d.]|\(1 - \$|\$objective")
NEUTRAL_STEPS = {
    None,
    0,
    1,
}  # colour steps allowed: the base colour, overspent (< 0), burning faster than allowed (> 1)


def _slo(ident: str, **fields: Any) -> SloRead:
    return SloRead.model_validate({"id": ident, "version": 1, "created_at": "2026-01-01T00:00:00Z",
                                   "updated_at": "2026-01-01T00:00:00Z", **fields})  # fmt: skip


def rule_series(labels: set[str] | None = None) -> tuple[set[str], set[str]]:
    """(recorded series names, alert names) of a rule file the control plane generates for SLOs of every kind; the
    labels of the recorded series and of the alerts (Prometheus' ALERTS series) are added to `labels`."""
    slos = [_slo("s1", name="avail", sli_kind="availability", objective=99.5, selector={"model": "mlp"}),
            _slo("s2", name="lat", sli_kind="latency", threshold_ms=50, objective=99, window="7d"),
            _slo("s3", name="ttft", sli_kind="ttft", threshold_ms=500, objective=95),
            _slo("s4", name="tpot", sli_kind="tpot", threshold_ms=100, objective=99.9, window="1d")]  # fmt: skip
    rules = [rule for group in yaml.safe_load(rule_file(slos))["groups"] for rule in group["rules"]]
    found = labels if labels is not None else set()
    for rule in rules:
        found |= set(rule.get("labels", {}))
        if "alert" in rule:
            found |= {"alertname", "alertstate"} | set(RELABELLED.findall(rule["expr"]))
    return {rule["record"] for rule in rules if "record" in rule}, {rule["alert"] for rule in rules if "alert" in rule}


def prometheus_name(name: str, unit: str, kind: str) -> str:
    base = name.replace(".", "_")
    suffix = UNITS.get(unit) or ("ratio" if unit == "1" and kind == "gauge" else "")
    if suffix and not base.endswith(suffix):
        base = f"{base}_{suffix}"
    return f"{base}_total" if kind == "counter" else base


def agent_series(labels: set[str] | None = None) -> set[str]:
    """Every series name the agent's instruments give in Prometheus (GPU gauges from the probes' own table); the
    labels their points carry are added to `labels`."""
    reader = InMemoryMetricReader()
    settings = TelemetrySettings(agent_id="a1", control_plane=None, agent_token=None)
    telemetry = AgentTelemetry(settings, readers=[reader], probes=False)
    recorder = telemetry.recorder("mlp", 1)
    recorder.outcome(1, "local")
    recorder.durations(1, "local", 0.001, 0.002, 0.003)
    recorder.batch(4, 0.002, ok=True)
    telemetry.policy_refusals.add(1)
    telemetry.watch_queue(lambda: [({names.ATTR_MODEL: "mlp", names.ATTR_VERSION: "1", names.ATTR_PRIORITY: 1}, 3)])
    telemetry.watch_policy(lambda: (2, "control_plane"))
    generation = telemetry.generation("tiny-lm")
    generation.finished(1, "local", operation="chat", prompt_tokens=12, completion_tokens=8, ttft_s=0.05,
                        duration_s=0.4)  # fmt: skip
    engine = {"kv_blocks": {"used": 3, "total": 64}, "preemptions": 1, "active": 2}  # the gauges' keys of engine.json()
    telemetry.watch_engines(lambda: [("tiny-lm", engine)])
    series = set()
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                kind = type(metric.data).__name__.lower()  # sum, histogram, gauge
                if kind == "histogram":
                    base = prometheus_name(metric.name, metric.unit, kind)
                    series |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
                else:
                    series.add(prometheus_name(metric.name, metric.unit, "counter" if kind == "sum" else kind))
                for point in metric.data.data_points:
                    (labels if labels is not None else set()).update(
                        re.sub(r"[^a-zA-Z0-9_]", "_", key) for key in point.attributes or {}
                    )
    telemetry.shutdown()
    series |= {prometheus_name(name, unit, "gauge") for name, unit in GPU_GAUGES.items()}
    return series


def control_plane_series(tmp_path: Path, labels: set[str] | None = None) -> set[str]:
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    viewer = make_keys(url)["viewer"]
    headers = {"Authorization": f"Bearer {viewer}"}
    with serving(create_app(Settings(database_url=url, control_loop_interval_s=0))) as base:
        httpx.get(f"{base}/api/v1/status", headers=headers, timeout=10).raise_for_status()  # a labelled series
        text = httpx.get(f"{base}/metrics", headers=headers, timeout=10).text
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    (labels if labels is not None else set()).update(key for line in lines for key in re.findall(r'(\w+)="', line))
    return {line.split("{")[0].split(" ")[0] for line in lines}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_every_query_names_a_metric_that_exists(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = agent_series() | control_plane_series(tmp_path)
    assert {"spillway_requests_total", "spillway_request_duration_seconds_bucket", "hw_temperature_celsius",
            "spillway_http_requests_total", "spillway_agents"} <= known  # fmt: skip
    generative = {"gen_ai_server_time_to_first_token_seconds_bucket", "gen_ai_client_token_usage_sum",
                  "gen_ai_server_time_per_output_token_seconds_bucket", "spillway_kv_blocks_used",
                  "spillway_kv_blocks_limit", "spillway_generation_preemptions_total",
                  "spillway_generation_streams_active"}  # fmt: skip
    assert generative <= known
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(exprs) > 20
    used = {name for expr in exprs for name in NAME.findall(LABELS.sub("", expr))}
    assert used - known == set()
    assert generative <= used  # the generative panels: TTFT, TPOT, tokens/s, KV cache, preemptions, streams
    recorded, alerts = rule_series()
    used_rules = {name for expr in exprs for name in RULE_NAME.findall(LABELS.sub("", expr))}
    assert used_rules - recorded == set()
    assert {"slo:objective:ratio", "slo:burn_rate:ratio", "slo:alert_burn_rate_threshold:ratio",
            "slo:period_error_budget_remaining:ratio", "slo:current_burn_rate:ratio"} <= used_rules  # fmt: skip
    for pattern in (p for expr in exprs for p in NAME_REGEX.findall(expr)):
        assert any(re.fullmatch(pattern, name) for name in recorded), pattern
    assert {name for expr in exprs for name in ALERT_NAME.findall(expr)} == alerts
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_every_label_a_query_names_is_one_the_series_carry(tmp_path: Path) -> None:
    """Matchers, groupings, legends and label_values name labels that exist: the agents' point attributes as the
    collector turns them into labels (`spillway.model` -> `spillway_model`), the control plane's, the common ones."""
    dashboard = json.loads(DASHBOARD.read_text())
    known = set(COMMON_LABELS) | {"__name__"}
    agent_series(known)
    control_plane_series(tmp_path, known)
    rule_series(known)
    assert {"spillway_model", "spillway_priority", "spillway_outcome", "spillway_policy_source"} <= known
    targets = [t for p in panels(dashboard) for t in p.get("targets", [])]
    definitions = [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used: set[str] = set()
    for expr in [t["expr"] for t in targets] + definitions:
        used |= set(MATCHER.findall(expr)) | set(LABEL_VALUES.findall(expr))
        used |= {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
    used |= {label for t in targets for label in LEGEND.findall(t.get("legendFormat", ""))}
    assert {"spillway_model", "spillway_outcome", "spillway_priority", "spillway_slo", "spillway_window"} <= used
    assert used - known == set()


def test_nothing_is_a_hard_coded_threshold() -> None:
    """Objectives and burn-rate thresholds come from the SLOs' recorded rules (`slo:objective:ratio`,
    `slo:alert_burn_rate_threshold:ratio`), never from a number in a query or a colour step of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert [expr for expr in exprs if HARD_CODED.search(expr)] == []
    for panel in panels(dashboard):
        steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
        assert {step["value"] for step in steps} <= NEUTRAL_STEPS, panel["title"]
    assert "objective" not in {v["name"] for v in dashboard["templating"]["list"]}


def test_panels_are_laid_out_without_overlap_and_use_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    taken: set[tuple[int, int]] = set()
    ids = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert pos["x"] + pos["w"] <= 24 and not cells & taken, panel["title"]
        taken |= cells
        ids.add(panel["id"])
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert len(ids) == len(list(panels(dashboard)))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard["panels"]))) - {"__rate_interval", "__all"}
    assert used <= variables
