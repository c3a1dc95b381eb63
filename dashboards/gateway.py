"""The overflow gateway's live state (the `gateway` section of `GET /api/v1/status`) as rows and sentences.

Plain functions over the API's JSON, so they are tested on their own. A control plane from before the gateway has
no such section: `gateway_view` then says None and the page says so, rather than showing empty numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dashboards.describe import clock
from dashboards.fmt import DASH, number

NOT_LOADED = "not loaded yet (the gateway reloads its backends every few seconds)"


@dataclass(frozen=True)
class GatewayView:
    """What the replica that answered knows: each backend's state, and the gateway's own counts (when given)."""

    backends: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


def gateway_view(status: dict[str, Any]) -> GatewayView | None:
    """The status's gateway section, whether an object with `backends` or a bare list of backends; None: none."""
    section = status.get("gateway")
    if isinstance(section, list):
        return GatewayView([b for b in section if isinstance(b, dict)])
    if isinstance(section, dict):
        backends = section.get("backends")
        summary = {k: v for k, v in section.items() if k != "backends"}
        return GatewayView([b for b in backends or [] if isinstance(b, dict)], summary)
    return None


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def backend_state(backend: dict[str, Any], now: datetime) -> str:
    """healthy, unhealthy (with the models failing their readiness checks), ejected (until when), or both."""
    parts = []
    if backend.get("ejected"):
        until = parse_time(backend.get("ejected_until"))
        if until is None:
            parts.append("ejected")
        else:
            left = max(0.0, (until - now).total_seconds())
            parts.append(f"ejected until {clock(backend.get('ejected_until'))} ({left:.0f} s left)")
    if backend.get("healthy") is False:
        models = backend.get("unhealthy_models") or []
        parts.append(f"unhealthy ({', '.join(models)})" if models else "unhealthy")
    return "; ".join(parts) or "healthy"


def gateway_rows(view: GatewayView, configured: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    """One row per backend, by name: its live state where the gateway has loaded it (readiness: a V2 backend's
    model-ready checks, an openai one's `GET /v1/models`), a note where it has not yet (just added), and backends the
    gateway still holds though they are no longer configured (just deleted)."""
    live = {b.get("id") or b.get("name"): b for b in view.backends}
    rows = []
    for backend in configured:
        state = live.pop(backend["id"], None) or live.pop(backend["name"], None)
        protocol = backend.get("protocol") or "v2"
        rows.append({**_row(state, now), "protocol": protocol} if state is not None
                    else {"backend": backend["name"], "protocol": protocol, "state": NOT_LOADED})  # fmt: skip
    rows += [_row(state, now) for state in live.values()]
    return sorted(rows, key=lambda r: str(r["backend"]))


def _row(backend: dict[str, Any], now: datetime) -> dict[str, Any]:
    requests, errors = backend.get("requests"), backend.get("errors")
    rate = f"{errors / requests:.1%}" if isinstance(requests, int) and isinstance(errors, int) and requests else DASH
    return {
        "backend": backend.get("name") or backend.get("id"),
        "protocol": backend.get("protocol") or "v2",
        "state": backend_state(backend, now),
        "in flight / cap": f"{number(backend.get('outstanding'))} / {number(backend.get('max_concurrency'))}",
        "requests": requests,
        "errors": errors,
        "error rate": rate,
        "p50 ms": backend.get("p50_ms"),
        "p99 ms": backend.get("p99_ms"),
        "ejection multiplier": backend.get("times_ejected"),
        "last error": backend.get("last_error") or DASH,
    }


def gateway_summary(view: GatewayView) -> str:
    """The gateway's own counts in a sentence, from what the section gives."""
    s = view.summary
    parts = []
    if "active_requests" in s:
        parts.append(f"{number(s['active_requests'])} requests in flight")
    if "active_retries" in s:
        limit = f" of {number(s['retry_limit'])} allowed" if s.get("retry_limit") is not None else ""
        parts.append(f"{number(s['active_retries'])} retries in flight{limit}")
    if s.get("loaded_at"):
        parts.append(f"backends loaded {clock(s['loaded_at'])} UTC")
    counts = f"Gateway: {', '.join(parts)}. " if parts else ""
    return (f"{counts}As seen by the control-plane replica that answered: each replica checks readiness and "
            "ejects failing backends on its own, and counts requests since it started.")  # fmt: skip
