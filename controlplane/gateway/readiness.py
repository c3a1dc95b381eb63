"""Active readiness checks, the decisions: per (backend, model), `unhealthy_threshold` (2) failed checks in a row
make it unhealthy, `healthy_threshold` (1) passed check makes it healthy again.

A backend (or a model newly listed on it) counts healthy until its first check; if that first check fails it is
unhealthy at once: it never proved itself, and traffic should not wait two intervals to learn what one told.
A check of a model passes when both `GET /v2/health/ready` and `GET /v2/models/{m}/ready` answer 200 (for a `v2_grpc`
backend: when `ServerReady` and `ModelReady` both say ready).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.gateway.backend import BackendState, Transition


@dataclass(frozen=True)
class ReadinessPolicy:
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


def apply_checks(
    policy: ReadinessPolicy, state: BackendState, ready: Mapping[str, bool], error: str | None
) -> list[Transition]:
    """Fold one round of checks (model -> passed) into `state`; events for the models that changed."""
    failed: list[str] = []
    recovered: list[str] = []
    for model in state.spec.models:
        passed = ready.get(model, False)
        first = model not in state.checked
        state.checked.add(model)
        if passed:
            state.check_failures[model] = 0
            if model in state.unhealthy:
                state.check_passes[model] = state.check_passes.get(model, 0) + 1
                if state.check_passes[model] >= policy.healthy_threshold:
                    state.unhealthy.discard(model)
                    recovered.append(model)
        else:
            state.check_passes[model] = 0
            state.check_failures[model] = state.check_failures.get(model, 0) + 1
            if model not in state.unhealthy and (first or state.check_failures[model] >= policy.unhealthy_threshold):
                state.unhealthy.add(model)
                failed.append(model)
    transitions = []
    if failed:
        runs = max(state.check_failures[m] for m in failed)
        reason = "its first readiness check failed" if runs == 1 else f"{runs} readiness checks in a row failed"
        data = {"models": failed, "failures": runs, "error": error}
        transitions.append(Transition("backend.unhealthy", state.id, state.name, reason, data))
    if recovered:
        data = {"models": recovered, "passes": policy.healthy_threshold}
        transitions.append(Transition("backend.healthy", state.id, state.name, "readiness check passed", data))
    return transitions
