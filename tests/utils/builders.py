"""Valid request bodies for each resource, with overrides: `make_slo(objective=99.9)`."""

from __future__ import annotations

import itertools
from typing import Any

_seq = itertools.count(1)


def _name(prefix: str) -> str:
    return f"{prefix}-{next(_seq)}"


def make_slo(**over: Any) -> dict[str, Any]:
    body = {
        "name": _name("slo"),
        "selector": {"labels": {"tier": "edge"}, "model": "mlp"},
        "sli_kind": "latency",
        "threshold_ms": 50,
        "objective": 99.5,
        "window": "28d",
    }
    return {**body, **over}


def make_rule(**over: Any) -> dict[str, Any]:
    body = {
        "name": _name("rule"),
        "selector": {"labels": "tier=edge", "model": "mlp"},
        "condition": {"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 64},
        "action": {"kind": "shed", "priority_at_or_below": 3},
        "hysteresis": {"for": "30s", "recover_after": "2m"},
    }
    return {**body, **over}


def make_backend(**over: Any) -> dict[str, Any]:
    body = {
        "name": _name("backend"),
        "url": "http://127.0.0.1:9",
        "models": ["mlp"],
        "weight": 2,
        "max_concurrency": 8,
        "timeout_ms": 1500,
        "binary_tensors": False,
        "auth_header": "Bearer backend-secret-value",
    }
    return {**body, **over}


def make_agent(**over: Any) -> dict[str, Any]:
    body = {"name": _name("agent"), "labels": {"site": "berlin", "tier": "edge"}, "device_class": "jetson"}
    return {**body, **over}


def make_tenant(**over: Any) -> dict[str, Any]:
    body = {"name": _name("tenant"), "selector": {"labels": {"site": "berlin"}}, "weight": 2, "max_in_flight": 16,
            "rate_rps": 100.0}  # fmt: skip
    return {**body, **over}


BUILDERS = {"slos": make_slo, "rules": make_rule, "backends": make_backend, "agents": make_agent,
            "tenants": make_tenant}  # fmt: skip
