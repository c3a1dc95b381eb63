"""An SLO's SLI as PromQL, over the metric names an agent's `GET /metrics` exposes (OpenTelemetry's Prometheus exporter;
an OTel Collector's `prometheus` exporter writes the same names from the agents' OTLP).

One place for the names, so that the generated Prometheus rules, the OpenSLO export (whose ratio metrics are these
queries) and the Grafana dashboard agree with each other and with the control plane's own evaluation
(`controlplane.slo.windows.SloSpec.counts`):

- `availability`: `spillway_requests_total`; good outcomes are `GOOD_OUTCOMES`.
- `latency`: `spillway_request_duration_seconds` of requests answered locally (`spillway_outcome="local"`); good
  ones are in the bucket whose `le` is the threshold.
- `ttft` / `tpot`: `gen_ai_server_time_to_first_token_seconds` / `gen_ai_server_time_per_output_token_seconds`,
  every stream; their model label is `gen_ai_request_model`.

A selector becomes label matchers: `model` -> `spillway_model` (`gen_ai_request_model` for ttft and tpot), `tenant`
-> `spillway_tenant` (`default` also matches series without the label, from agents before tenants), and each agent
label -> a label of the same name with every character Prometheus does not allow replaced by `_`: agents' labels
are resource attributes, which Prometheus sees as target labels (the scrape config's) or, through an OTel Collector,
with `resource_to_telemetry_conversion` enabled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.schemas.common import format_duration
from spillway.contract.names import GOOD_OUTCOMES, LOCAL
from spillway.contract.tenants import DEFAULT_TENANT

# SLI kind -> (histogram or counter base name, the model's label)
METRICS: dict[str, tuple[str, str]] = {
    "availability": ("spillway_requests_total", "spillway_model"),
    "latency": ("spillway_request_duration_seconds", "spillway_model"),
    "ttft": ("gen_ai_server_time_to_first_token_seconds", "gen_ai_request_model"),
    "tpot": ("gen_ai_server_time_per_output_token_seconds", "gen_ai_request_model"),
}
OUTCOME_LABEL = "spillway_outcome"
TENANT_LABEL = "spillway_tenant"
GOOD_OUTCOMES_REGEX = "|".join(sorted(GOOD_OUTCOMES))
_INVALID = re.compile(r"[^A-Za-z0-9_]")


def label_name(key: str) -> str:
    """An agent label's key as a Prometheus label name (what the OTel Prometheus exporter and Collector make of it)."""
    name = _INVALID.sub("_", key)
    return f"_{name}" if name[:1].isdigit() else name


def le_value(seconds: float) -> str:
    """A bucket boundary as the `le` label value prometheus_client (the agent's exporter) writes: Go's float format."""
    if seconds == float("inf"):
        return "+Inf"
    text = repr(float(seconds))
    return text if "e" in text or "." in text else f"{text}.0"


def quote(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def window(seconds: int) -> str:
    """A range selector's duration: '5m', '1h', '28d'."""
    return format_duration(int(seconds))


@dataclass(frozen=True)
class SliQuery:
    """The good and total event series of an SLO's SLI, as PromQL series selectors (no range, no rate)."""

    good: str
    total: str

    def rate(self, which: str, seconds: int) -> str:
        """Events per second over a window. The good rate is 0, not absent, where only bad events exist (an agent
        that has refused every request has no good series at all): else a total outage would burn nothing."""
        if which == "good":
            return f"(sum(rate({self.good}[{window(seconds)}])) or vector(0))"
        return f"sum(rate({self.total}[{window(seconds)}]))"

    def error_ratio(self, seconds: int) -> str:
        """Bad / total over a window; no value (not 0, not NaN) where there was no traffic: a window without events
        is neither good nor bad, as the control plane judges it."""
        return f"1 - ({self.rate('good', seconds)} / ({self.rate('total', seconds)} > 0))"


class UnexpressibleSelector(ValueError):
    """An SLO whose agent labels cannot be label matchers: a key that becomes one of the metrics' own labels (`le`,
    `spillway_*`, `gen_ai_*`, `__*`), or two keys that become the same label name."""


def _reserved(name: str) -> bool:
    return name == "le" or name.startswith(("spillway_", "gen_ai_", "__"))


def matchers(sli_kind: str, selector: Mapping[str, Any]) -> list[str]:
    """The label matchers of an SLO's selector (`model`, `tenant`, `labels`), sorted for a stable text.

    Raises:
        UnexpressibleSelector: an agent label whose Prometheus name is taken (see the class).
    """
    _, model_label = METRICS[sli_kind]
    found: list[str] = []
    named: dict[str, str] = {}
    for key, value in sorted((selector.get("labels") or {}).items()):
        name = label_name(str(key))
        if _reserved(name):
            raise UnexpressibleSelector(f"agent label '{key}' becomes the Prometheus label '{name}', which the "
                                        "metrics already carry: rename the agents' label")  # fmt: skip
        if name in named:
            raise UnexpressibleSelector(f"agent labels '{named[name]}' and '{key}' both become the Prometheus label "
                                        f"'{name}': rename one")  # fmt: skip
        named[name] = str(key)
        found.append(f"{name}={quote(str(value))}")
    if selector.get("model"):
        found.append(f"{model_label}={quote(str(selector['model']))}")
    tenant = selector.get("tenant")
    if tenant:
        tenant = str(tenant)
        found.append(f'{TENANT_LABEL}=~"{tenant}|"' if tenant == DEFAULT_TENANT else f"{TENANT_LABEL}={quote(tenant)}")
    return found


def sli_query(sli_kind: str, selector: Mapping[str, Any], threshold_ms: float | None = None) -> SliQuery:
    """The good and total series of an SLI (`sli_kind`, `selector`, `threshold_ms` as an SLO stores them)."""
    base, _ = METRICS[sli_kind]
    common = matchers(sli_kind, selector)

    def series(name: str, extra: list[str]) -> str:
        return f"{name}{{{', '.join([*common, *extra])}}}"

    if sli_kind == "availability":
        return SliQuery(good=series(base, [f'{OUTCOME_LABEL}=~"{GOOD_OUTCOMES_REGEX}"']), total=series(base, []))
    if threshold_ms is None:
        raise ValueError(f"a {sli_kind} SLI needs threshold_ms")
    local = [f'{OUTCOME_LABEL}="{LOCAL}"'] if sli_kind == "latency" else []
    return SliQuery(
        good=series(f"{base}_bucket", [*local, f'le="{le_value(threshold_ms / 1000)}"']),
        total=series(f"{base}_count", local),
    )


__all__ = [
    "GOOD_OUTCOMES_REGEX",
    "METRICS",
    "OUTCOME_LABEL",
    "TENANT_LABEL",
    "SliQuery",
    "UnexpressibleSelector",
    "label_name",
    "le_value",
    "matchers",
    "quote",
    "sli_query",
    "window",
]
