"""Create and edit forms for SLOs, rules and backends: widgets in, an API request body out.

The dashboard does not re-implement the API's validation: it sends what the operator typed and shows the
API's per-field messages under the fields (`session.field_error`). It parses only what has no widget of its
own (a list typed as text) and reports those mistakes the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import streamlit as st

from dashboards.describe import LATENCY_METRICS, THRESHOLD_KINDS, labels_text
from dashboards.session import LocalFieldErrors, field_error, form_errors, form_summary

CONDITION_KINDS = ("burn_rate", "latency", "error_ratio", "gauge", "stale")
# The ladder, mildest first (the API's ACTION_LADDER); cap_max_tokens and limit_generation act on generative models.
ACTION_KINDS = ("tune_batching", "cap_max_tokens", "limit_generation", "overflow", "switch_variant", "shed", "fallback")
OVERFLOW_MODES = ("deadline", "fraction", "priority")
OVERFLOW_HELP = "requests predicted to miss their deadline always go to the cloud; a mode can add more"
OVERFLOW_MODE_LABELS = {
    "deadline": "deadline: only requests predicted to miss their deadline",
    "fraction": "fraction: those, and a share of the rest",
    "priority": "priority: those, and every request at a priority level or lower",
}
# What each overflow mode takes besides the predicted deadline misses: the form field it needs, and what to ask.
OVERFLOW_PARAMETERS = {
    "fraction": ("fraction", "mode fraction needs the share of the other requests to send: 0 < fraction ≤ 1"),
    "priority": ("priority_at_or_below", "mode priority needs the priority level to send, with every lower one"),
}
GAUGE_METRICS = ("queue_depth", "gpu_memory_free_bytes", "gpu_memory_free_ratio", "gpu_temperature_c",
                 "gpu_utilization", "kv_cache_use_ratio", "preemptions_per_minute", "active_streams")  # fmt: skip
LATENCY_METRIC_CHOICES = tuple(LATENCY_METRICS)
SLI_KINDS = ("latency", "availability", "ttft", "tpot")
OPS = (">", ">=", "<", "<=")


@dataclass
class Form:
    """One drawn form: its key, the messages of its last submission, and the fields it drew."""

    key: str
    disabled: bool
    errors: dict[str, str]
    paths: list[str]

    def field(self, path: str, draw: Callable[..., Any], label: str, *args: Any, **kw: Any) -> Any:
        """Draw one widget with a stable key and the API's message for `path` right under it."""
        value = draw(label, *args, key=f"{self.key}:{path}", disabled=self.disabled, **kw)
        self.paths.append(path)
        field_error(self.errors, path)
        return value


def open_form(key: str, disabled: bool) -> Form:
    return Form(key, disabled, form_errors(key), [])


def optional_number(value: Any) -> float | None:
    return None if value is None else float(value)


def selector(form: Form, current: dict[str, Any] | None) -> dict[str, Any]:
    current = current or {}
    labels = form.field("selector.labels", st.text_input, "Selector labels", value=labels_text(current.get("labels")),
                        help="key=value pairs, comma-separated; empty: every agent")  # fmt: skip
    model = form.field("selector.model", st.text_input, "Selector model", value=current.get("model") or "",
                       help="empty: every model")  # fmt: skip
    kept = {"tenant": current["tenant"]} if current.get("tenant") else {}  # an SLO's tenant: kept as it is
    return {"labels": labels.strip(), "model": model.strip() or None, **kept}


# -- SLOs ------------------------------------------------------------------------------------------------------


def alert_windows_text(windows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{w['long']}/{w['short']}@{w['burn_rate']:g}:{w.get('severity', 'page')}" for w in windows)


def parse_alert_windows(text: str) -> list[dict[str, Any]] | None:
    """`1h/5m@14.4:page, 6h/30m@6` -> alert pairs; empty -> None (the API's default pairs)."""
    if not text.strip():
        return None
    pairs = []
    for item in text.split(","):
        spans, _, rest = item.strip().partition("@")
        long, _, short = spans.partition("/")
        rate, _, severity = rest.partition(":")
        if not (long.strip() and short.strip() and rate.strip()):
            raise LocalFieldErrors({"alert_windows": f"'{item.strip()}' is not long/short@burn_rate[:severity]"})
        try:
            burn = float(rate)
        except ValueError:
            raise LocalFieldErrors({"alert_windows": f"'{rate.strip()}' is not a number"}) from None
        pair: dict[str, Any] = {"long": long.strip(), "short": short.strip(), "burn_rate": burn}
        if severity.strip():
            pair["severity"] = severity.strip()
        pairs.append(pair)
    return pairs


Build = Callable[[], dict[str, Any]]


def slo_form(key: str, current: dict[str, Any] | None, disabled: bool) -> Build | None:
    """The SLO form; when submitted, returns what builds the request body (raising LocalFieldErrors)."""
    current = current or {}
    form = open_form(key, disabled)
    with st.form(key, border=True):
        form_summary(form.errors, ["name", "description", "sli_kind", "objective", "threshold_ms", "window",
                                   "selector.labels", "selector.model", "alert_windows"])  # fmt: skip
        left, right = st.columns(2)
        with left:
            name = form.field("name", st.text_input, "Name", value=current.get("name", ""))
            kind = current.get("sli_kind", "latency")
            sli_kind = form.field("sli_kind", st.selectbox, "SLI", SLI_KINDS,
                                  index=SLI_KINDS.index(kind) if kind in SLI_KINDS else 0,
                                  help="ttft: time to first token, tpot: time per output token (generative "
                                  "models)")  # fmt: skip
            objective = form.field("objective", st.number_input, "Objective (%)",
                                   value=float(current.get("objective", 99.0)), step=0.1, format="%.3f")  # fmt: skip
            threshold = form.field("threshold_ms", st.number_input, "Threshold (ms; latency, ttft and tpot SLIs)",
                                   value=optional_number(current.get("threshold_ms", 50.0)), step=1.0,
                                   help="a bucket boundary of the SLI's histogram")  # fmt: skip
        with right:
            window = form.field("window", st.text_input, "Window", value=str(current.get("window", "28d")))
            chosen = selector(form, current.get("selector"))
            alerts = form.field("alert_windows", st.text_input, "Alert window pairs",
                                value=alert_windows_text(current.get("alert_windows") or []),
                                help="long/short@rate[:page|ticket], comma-separated; empty: defaults")  # fmt: skip
        description = form.field("description", st.text_input, "Description", value=current.get("description", ""))
        submitted = st.form_submit_button("Save SLO" if current else "Create SLO", disabled=disabled, type="primary")
    if not submitted:
        return None

    def build() -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": name.strip(), "description": description, "sli_kind": sli_kind, "objective": objective,
            "window": window.strip(), "selector": chosen,
            "threshold_ms": threshold if sli_kind in THRESHOLD_KINDS else None,
        }  # fmt: skip
        windows = parse_alert_windows(alerts)
        if windows is not None:
            body["alert_windows"] = windows
        return body

    return build


# -- rules -----------------------------------------------------------------------------------------------------


def _kind_picker(form: Form, path: str, label: str, kinds: tuple[str, ...], current: str | None) -> str:
    """The condition or action kind, outside the form so that choosing one redraws the form's fields for it."""
    index = kinds.index(current) if current in kinds else 0
    return str(form.field(path, st.selectbox, label, kinds, index=index))


def whole_errors(form: Form, path: str, kind: str) -> None:
    """The API's messages about a condition or action as a whole (a check across its fields): it names them
    `action.overflow`, the union's tag and no field, so no field takes them."""
    for found, message in form.errors.items():
        if found in (path, f"{path}.{kind}"):
            st.error(message, icon=":material/error:")


def condition_fields(form: Form, kind: str, current: dict[str, Any], slo_names: list[str]) -> dict[str, Any]:
    c = current if current.get("kind") == kind else {}
    body: dict[str, Any] = {"kind": kind}
    if kind == "burn_rate":
        names = slo_names or [""]
        body["slo"] = form.field("condition.slo", st.selectbox, "SLO", names,
                                 index=names.index(c["slo"]) if c.get("slo") in names else 0)  # fmt: skip
        body["long_window"] = form.field("condition.long_window", st.text_input, "Long window",
                                         value=str(c.get("long_window", "1h")))  # fmt: skip
        body["short_window"] = form.field("condition.short_window", st.text_input, "Short window",
                                          value=str(c.get("short_window", "5m")))  # fmt: skip
        body["threshold"] = form.field("condition.threshold", st.number_input, "Burn-rate threshold",
                                       value=float(c.get("threshold", 14.4)))  # fmt: skip
    elif kind == "latency":
        metric = c.get("metric") or "request"
        body["metric"] = form.field("condition.metric", st.selectbox, "Of", LATENCY_METRIC_CHOICES,
                                    index=LATENCY_METRIC_CHOICES.index(metric) if metric in LATENCY_METRIC_CHOICES
                                    else 0, format_func=LATENCY_METRICS.get,
                                    help="ttft and tpot: generative models' GenAI histograms")  # fmt: skip
        body["quantile"] = form.field("condition.quantile", st.number_input, "Quantile (0.99: p99)",
                                      value=float(c.get("quantile", 0.99)), step=0.01, format="%.3f")  # fmt: skip
        body["threshold_ms"] = form.field("condition.threshold_ms", st.number_input, "Threshold (ms)",
                                          value=float(c.get("threshold_ms", 100.0)))  # fmt: skip
        body["window"] = form.field("condition.window", st.text_input, "Window", value=str(c.get("window", "5m")))
    elif kind == "error_ratio":
        body["threshold"] = form.field("condition.threshold", st.number_input, "Error ratio threshold (0..1)",
                                       value=float(c.get("threshold", 0.05)), step=0.01, format="%.3f")  # fmt: skip
        body["window"] = form.field("condition.window", st.text_input, "Window", value=str(c.get("window", "5m")))
    elif kind == "gauge":
        metric = c.get("metric", GAUGE_METRICS[0])
        body["metric"] = form.field("condition.metric", st.selectbox, "Gauge", GAUGE_METRICS,
                                    index=GAUGE_METRICS.index(metric) if metric in GAUGE_METRICS else 0)  # fmt: skip
        body["op"] = form.field("condition.op", st.selectbox, "Comparison", OPS,
                                index=OPS.index(c["op"]) if c.get("op") in OPS else 0)  # fmt: skip
        body["threshold"] = form.field("condition.threshold", st.number_input, "Threshold",
                                       value=float(c.get("threshold", 64.0)))  # fmt: skip
    elif kind == "stale":
        after = form.field("condition.after", st.text_input, "Silent for (empty: SPILLWAY_STALE_AFTER_S)",
                           value=str(c.get("after") or ""))  # fmt: skip
        body["after"] = after.strip() or None
    if kind in ("burn_rate", "latency", "error_ratio"):
        body["min_requests"] = form.field("condition.min_requests", st.number_input, "Min requests",
                                          value=int(c.get("min_requests", 20)), step=1)  # fmt: skip
    return body


def parse_sizes(text: str) -> list[int] | None:
    if not text.strip():
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise LocalFieldErrors({"action.preferred_batch_sizes": "write whole numbers, comma-separated"}) from None


def action_fields(form: Form, kind: str, current: dict[str, Any]) -> dict[str, Any]:
    a = current if current.get("kind") == kind else {}
    body: dict[str, Any] = {"kind": kind}
    if kind == "tune_batching":
        delay = a.get("max_queue_delay_us")
        body["max_queue_delay_us"] = form.field("action.max_queue_delay_us", st.number_input,
                                                "Max queue delay (µs; empty: as configured)",
                                                value=None if delay is None else int(delay), step=100)  # fmt: skip
        sizes = ",".join(str(s) for s in a.get("preferred_batch_sizes") or [])
        body["preferred_batch_sizes"] = form.field("action.preferred_batch_sizes", st.text_input,
                                                   "Preferred batch sizes (e.g. 4,8)", value=sizes)  # fmt: skip
    elif kind == "cap_max_tokens":
        body["max_tokens"] = form.field("action.max_tokens", st.number_input, "Cap max_tokens at",
                                        value=int(a.get("max_tokens", 256)), step=16,
                                        help="a request asking for more (or for no limit) gets this many tokens "
                                        "at most")  # fmt: skip
    elif kind == "limit_generation":
        for field, label in (
            ("max_num_seqs", "Max sequences at once (empty: as configured)"),
            ("max_num_batched_tokens", "Token budget per step (empty: as configured)"),
        ):
            limit = a.get(field)
            body[field] = form.field(f"action.{field}", st.number_input, label,
                                     value=None if limit is None else int(limit), step=1)  # fmt: skip
    elif kind == "overflow":
        mode = a.get("mode", "deadline")
        body["mode"] = form.field("action.mode", st.selectbox, "Send to the cloud", OVERFLOW_MODES,
                                  index=OVERFLOW_MODES.index(mode) if mode in OVERFLOW_MODES else 0,
                                  format_func=OVERFLOW_MODE_LABELS.get, help=OVERFLOW_HELP)  # fmt: skip
        body["fraction"] = form.field("action.fraction", st.number_input, "Share of the rest (mode fraction, 0-1)",
                                      value=optional_number(a.get("fraction")), step=0.05, format="%.3f")  # fmt: skip
        level = a.get("priority_at_or_below")
        body["priority_at_or_below"] = form.field("action.priority_at_or_below", st.number_input,
                                                  "Priority level and every lower one (mode priority)",
                                                  value=None if level is None else int(level), step=1)  # fmt: skip
    elif kind == "switch_variant":
        body["version"] = form.field("action.version", st.number_input, "Serve model version",
                                     value=int(a.get("version", 2)), step=1)  # fmt: skip
    elif kind in ("shed", "fallback"):
        body["priority_at_or_below"] = form.field("action.priority_at_or_below", st.number_input,
                                                  "Priority level and every lower one (larger number)",
                                                  value=int(a.get("priority_at_or_below", 3)), step=1)  # fmt: skip
        if kind == "shed":
            body["retry_after_s"] = form.field("action.retry_after_s", st.number_input, "Retry-After (s)",
                                               value=int(a.get("retry_after_s", 5)), step=1)  # fmt: skip
        else:
            modes = ["cache", "default"]
            body["mode"] = form.field("action.mode", st.selectbox, "Fallback", modes,
                                      index=modes.index(a.get("mode", "cache")))  # fmt: skip
            outputs = a.get("default_outputs")
            body["default_outputs"] = form.field("action.default_outputs", st.text_area,
                                                 "Default outputs (V2 output tensors as JSON; mode default)",
                                                 value=json.dumps(outputs) if outputs else "")  # fmt: skip
            body["default_text"] = form.field("action.default_text", st.text_area,
                                              "Default text (generative models; mode default)",
                                              value=a.get("default_text") or "")  # fmt: skip
    return body


def finish_action(body: dict[str, Any]) -> dict[str, Any]:
    """Turn the text fields of an action into JSON values. An overflow action sends only its mode's parameter
    (both fields are drawn, as the form cannot redraw itself on a choice); an empty one is this field's error."""
    if body["kind"] == "overflow":
        mode = body["mode"]
        for other, (path, _) in OVERFLOW_PARAMETERS.items():
            if other != mode:
                body.pop(path)
        needed = OVERFLOW_PARAMETERS.get(mode)
        if needed is not None and body[needed[0]] is None:
            raise LocalFieldErrors({f"action.{needed[0]}": needed[1]})
    if body["kind"] == "tune_batching":
        body["preferred_batch_sizes"] = parse_sizes(body["preferred_batch_sizes"])
    if body["kind"] == "fallback":
        text = body["default_outputs"].strip()
        try:
            body["default_outputs"] = json.loads(text) if text else None
        except ValueError as exc:
            raise LocalFieldErrors({"action.default_outputs": f"not JSON: {exc}"}) from None
        text = body.get("default_text") or ""
        body["default_text"] = text if text.strip() else None
    return body


def rule_form(key: str, current: dict[str, Any] | None, disabled: bool, slo_names: list[str]) -> Build | None:
    """The rule form; when submitted, returns what builds the request body (raising LocalFieldErrors)."""
    current = current or {}
    form = open_form(key, disabled)
    pick_left, pick_right = st.columns(2)
    with pick_left:
        condition_kind = _kind_picker(form, "condition.kind", "Condition", CONDITION_KINDS,
                                      (current.get("condition") or {}).get("kind"))  # fmt: skip
    with pick_right:
        action_kind = _kind_picker(form, "action.kind", "Action", ACTION_KINDS,
                                   (current.get("action") or {}).get("kind"))  # fmt: skip
    with st.form(key, border=True):
        top_left, top_right = st.columns(2)
        with top_left:
            name = form.field("name", st.text_input, "Name", value=current.get("name", ""))
            chosen = selector(form, current.get("selector"))
        with top_right:
            description = form.field("description", st.text_input, "Description",
                                     value=current.get("description", ""))  # fmt: skip
            switches = {}
            if not current:  # an existing rule has its own switches, outside the form
                switches["enabled"] = form.field("enabled", st.checkbox, "Enabled", value=True)
                switches["dry_run"] = form.field("dry_run", st.checkbox, "Dry run (record what it would do, change "
                                                 "nothing)", value=False)  # fmt: skip
        cond_col, act_col, hyst_col = st.columns(3)
        with cond_col:
            st.markdown(f"**When** · `{condition_kind}`")
            whole_errors(form, "condition", condition_kind)
            condition = condition_fields(form, condition_kind, current.get("condition") or {}, slo_names)
        with act_col:
            st.markdown(f"**Then** · `{action_kind}`")
            whole_errors(form, "action", action_kind)
            action = action_fields(form, action_kind, current.get("action") or {})
        with hyst_col:
            st.markdown("**Hysteresis**")
            h = current.get("hysteresis") or {}
            hysteresis = {
                "for": form.field("hysteresis.for", st.text_input, "For", value=str(h.get("for", "30s"))),
                "recover_after": form.field("hysteresis.recover_after", st.text_input, "Recover after",
                                            value=str(h.get("recover_after", "2m"))),
                "recovery_steps": form.field("hysteresis.recovery_steps", st.number_input, "Recovery steps",
                                             value=int(h.get("recovery_steps", 1)), step=1),
                "max_flaps_per_hour": form.field("hysteresis.max_flaps_per_hour", st.number_input,
                                                 "Max flaps per hour", value=int(h.get("max_flaps_per_hour", 4)),
                                                 step=1),
            }  # fmt: skip
        form_summary(form.errors, [*form.paths, "condition", "action"])
        submitted = st.form_submit_button("Save rule" if current else "Create rule", disabled=disabled, type="primary")
    if not submitted:
        return None
    return lambda: {
        "name": name.strip(), "description": description, "selector": chosen, "condition": condition,
        "action": finish_action(action), "hysteresis": hysteresis, **switches,
    }  # fmt: skip


# -- backends --------------------------------------------------------------------------------------------------


BACKEND_PROTOCOLS = ("v2", "v2_grpc", "openai")
PROTOCOL_LABELS = {"v2": "v2: a KServe / Triton V2 inference server",
                   "v2_grpc": "v2_grpc: a KServe / Triton V2 gRPC server (grpc://host:port)",
                   "openai": "openai: an OpenAI-compatible server (vLLM, TGI, llama.cpp, ...)"}  # fmt: skip


def model_map_text(model_map: dict[str, str] | None) -> str:
    return ", ".join(f"{edge}={cloud}" for edge, cloud in sorted((model_map or {}).items()))


def parse_model_map(text: str) -> dict[str, str]:
    """`tiny-lm=Qwen2.5-7B-Instruct, coder=...` -> {edge name: cloud name}; empty -> {} (the names are the same)."""
    found: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        edge, sep, cloud = item.partition("=")
        if not sep or not edge.strip() or not cloud.strip():
            raise LocalFieldErrors({"model_map": f"'{item.strip()}' is not edge_name=cloud_name"})
        if edge.strip() in found:
            raise LocalFieldErrors({"model_map": f"'{edge.strip()}' is mapped twice"})
        found[edge.strip()] = cloud.strip()
    return found


def backend_form(key: str, current: dict[str, Any] | None, disabled: bool) -> Build | None:
    """The backend form; when submitted, returns what builds the request body. `auth_header` is write-only: left
    empty on an edit it is not sent, so the stored one stays."""
    current = current or {}
    form = open_form(key, disabled)
    with st.form(key, border=True):
        form_summary(form.errors, ["name", "protocol", "url", "models", "model_map", "weight", "max_concurrency",
                                   "timeout_ms", "binary_tensors", "auth_header"])  # fmt: skip
        left, right = st.columns(2)
        with left:
            name = form.field("name", st.text_input, "Name", value=current.get("name", ""))
            protocol = current.get("protocol") or "v2"
            protocol = form.field("protocol", st.selectbox, "Protocol", BACKEND_PROTOCOLS,
                                  index=BACKEND_PROTOCOLS.index(protocol) if protocol in BACKEND_PROTOCOLS else 0,
                                  format_func=PROTOCOL_LABELS.get)  # fmt: skip
            url = form.field("url", st.text_input, "Base URL", value=current.get("url", ""),
                             help="v2: the server's root; v2_grpc: its gRPC address, grpc://host:port (Triton's "
                             "8001, a Spillway agent's grpc_port); openai: the root under which /v1/models and "
                             "/v1/chat/completions are served")  # fmt: skip
            models = form.field("models", st.text_input, "Models (comma-separated, the edge's names)",
                                value=",".join(current.get("models") or []))  # fmt: skip
            mapping = form.field("model_map", st.text_input, "Model names in the cloud (openai; optional)",
                                 value=model_map_text(current.get("model_map")),
                                 help="edge_name=cloud_name, comma-separated, e.g. tiny-lm=Qwen2.5-7B-Instruct; "
                                 "empty: the same names")  # fmt: skip
            hint = "set: leave empty to keep it" if current.get("auth_header_set") else "none set"
            auth = form.field("auth_header", st.text_input, f"Authorization header ({hint})", value="",
                              type="password")  # fmt: skip
        with right:
            weight = form.field("weight", st.number_input, "Weight", value=float(current.get("weight", 1.0)))
            concurrency = form.field("max_concurrency", st.number_input, "Max concurrency",
                                     value=int(current.get("max_concurrency", 64)), step=1)  # fmt: skip
            timeout = form.field("timeout_ms", st.number_input, "Timeout (ms)",
                                 value=int(current.get("timeout_ms", 10000)), step=100)  # fmt: skip
            binary = form.field("binary_tensors", st.checkbox, "Binary tensors (v2)",
                                value=bool(current.get("binary_tensors", True)))  # fmt: skip
        submitted = st.form_submit_button("Save backend" if current else "Add backend", disabled=disabled,
                                          type="primary")  # fmt: skip
    if not submitted:
        return None

    def build() -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": name.strip(), "protocol": protocol, "url": url.strip(),
            "models": [m.strip() for m in models.split(",") if m.strip()], "model_map": parse_model_map(mapping),
            "weight": weight, "max_concurrency": concurrency, "timeout_ms": timeout, "binary_tensors": binary,
        }  # fmt: skip
        if auth:
            body["auth_header"] = auth
        return body

    return build
