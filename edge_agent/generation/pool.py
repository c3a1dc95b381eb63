"""A generative model's instances (Triton's `instance_group` count in its config): one `GenerationEngine` each,
with its own thread, onnxruntime session and share of the KV budget. A request goes to the instance that predicts
the earliest first token for it (ties: the one with fewer sequences), so that one busy instance does not hold a
request another could start now. The pool answers for the model as one engine does: the serving code, the
telemetry and the status see one model, with the instances' states added up and listed under `per_instance`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from edge_agent.generation.engine import GenerationEngine, GenerationListener, GenerationRequest, Stream, Timing
from edge_agent.scheduling.worker import Refused
from spillway.contract.tenants import DEFAULT_TENANT

__all__ = ["EnginePool"]


class EnginePool:
    def __init__(self, engines: list[GenerationEngine], *, default_max_tokens: int | None = None,
                 fallback_text: str | None = None) -> None:  # fmt: skip
        if not engines:
            raise ValueError("a generative model needs at least one instance")
        self.instances = engines
        self.default_max_tokens = default_max_tokens  # of a chat request that sets none (None: the API's default)
        self.fallback_text = fallback_text  # the fallback `default` answer where the policy gives no default_text
        first = engines[0]
        self.name, self.version, self.context, self.text = first.name, first.version, first.context, first.text

    # ---- limits (a policy lowers them live) ----------------------------------------------------------------------

    @property
    def configured_max_num_seqs(self) -> int:
        return self.instances[0].scheduler.configured.max_num_seqs

    @property
    def configured_max_num_batched_tokens(self) -> int:
        return self.instances[0].scheduler.configured.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        """Each instance's effective limit (the configured one, or lower under a policy)."""
        return self.instances[0].scheduler.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.instances[0].scheduler.config.max_num_batched_tokens

    def limit(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Every instance's scheduler limits from its next step (None: as configured; never above it; see
        GenerationScheduler.limit). Safe from the event loop while the engines run."""
        for engine in self.instances:
            engine.limit(max_num_seqs, max_num_batched_tokens)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights for fair share within a level, on every instance from its next step (a tenant left
        out has weight 1). Safe from the event loop while the engines run; ValueError for a weight that is not > 0."""
        for engine in self.instances:
            engine.set_weights(weights)

    @property
    def active(self) -> int:
        """Sequences admitted and not yet ended, over the instances."""
        return sum(engine.active for engine in self.instances)

    @property
    def listener(self) -> GenerationListener | None:
        return self.instances[0].listener

    @listener.setter
    def listener(self, listener: GenerationListener | None) -> None:
        for engine in self.instances:
            engine.listener = listener

    def submit(self, request: GenerationRequest, *, count_refusal: bool = True) -> Stream:
        """Admit on the instance that predicts the earliest first token (see GenerationEngine.submit); when its queue
        is full, on the next one that has room. A refusal is counted once, or not at all with `count_refusal` False
        (the caller counts one outcome per request, which may still be an overflow or a fallback)."""
        order = self.instances
        if len(order) > 1:
            # A priority no level takes raises ValueError: the first instance refuses it as it would alone.
            with contextlib.suppress(ValueError):
                order = sorted(order, key=lambda e: (e.broken is not None, e.predict_first_token_s(request), e.load))
        for engine in order[:-1]:
            try:
                return engine.submit(request, count_refusal=False)
            except Refused as exc:
                if exc.rejection.reason != "queue_full":
                    if count_refusal:
                        engine.refused(engine.scheduler.resolve_level(request.priority), request.tenant)
                    raise
        return order[-1].submit(request, count_refusal=count_refusal)

    def refused(self, level: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        self.instances[0].refused(level, tenant)

    async def drain(self) -> None:
        await asyncio.gather(*(engine.drain() for engine in self.instances))

    def close(self) -> None:
        for engine in self.instances:
            engine.close()

    def waiting_by_level(self) -> list[int]:
        per_instance = [engine.waiting_by_level() for engine in self.instances]
        return [sum(levels) for levels in zip(*per_instance, strict=True)]

    def json(self) -> dict[str, Any]:
        states = [engine.json() for engine in self.instances]
        if len(states) == 1:
            return {**states[0], "instances": 1}
        total: dict[str, Any] = {key: sum(s[key] for s in states) for key in states[0] if _countable(states[0][key])}
        kv = [s["kv_blocks"] for s in states]
        total["kv_blocks"] = {**{k: sum(b[k] for b in kv) for k in ("total", "used", "free", "sequences")},
                              "block_size": kv[0]["block_size"]}  # fmt: skip
        total["timing"] = Timing(total["steps"], sum(s["timing"]["step_s"] for s in states),
                                 sum(s["timing"]["model_s"] for s in states)).json()  # fmt: skip
        total["instances"] = len(states)
        total["per_instance"] = states
        return total


def _countable(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
