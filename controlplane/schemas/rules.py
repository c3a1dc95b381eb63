"""Degradation rule schemas: selector + condition + action + hysteresis, each kind with its own parameters.

Conditions, actions and hysteresis are frozen: the API validates them from request bodies, and the control loop
and the SLO windows parse a stored rule once (`RuleSpec.of`) and then pass these values around, matching on
their class instead of a `kind` string.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Annotated, Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from controlplane.schemas.common import Duration, Name, PositiveDuration, Selector, Stored, Strict, partial
from controlplane.schemas.slos import genai_threshold_problem

log = logging.getLogger("spillway.controlplane.rules")


class Frozen(Strict):
    """A Strict schema whose values cannot change once validated (and so can be shared and compared)."""

    model_config = ConfigDict(frozen=True)


# ---- conditions -------------------------------------------------------------------------------


class BurnRateCondition(Frozen):
    """An SLO burns its error budget faster than `threshold` over both windows."""

    kind: Literal["burn_rate"]
    slo: Name = Field(description="name of the SLO whose burn rate is watched")
    long_window: PositiveDuration = 3600
    short_window: PositiveDuration = 300
    threshold: float = Field(gt=0, le=1e6)
    min_requests: int = Field(default=20, ge=0, description="no firing on fewer requests than this (short window)")

    @model_validator(mode="after")
    def _short_inside_long(self) -> BurnRateCondition:
        if self.short_window >= self.long_window:
            raise ValueError("short_window must be shorter than long_window")
        return self


class LatencyCondition(Frozen):
    """A latency quantile over a window exceeds a threshold: of the whole request (`request`, the V2 models'
    `spillway.request.duration`), or of a generative model's time to first token (`ttft`) or mean time per output
    token (`tpot`), from the OTel GenAI histograms. The threshold sits on one of the metric's bucket boundaries."""

    kind: Literal["latency"]
    metric: Literal["request", "ttft", "tpot"] = Field(
        default="request", description="request: whole requests (V2 models); ttft, tpot: generative models' streams"
    )
    quantile: float = Field(gt=0, lt=1, description="e.g. 0.99 for p99")
    threshold_ms: float = Field(
        gt=0, le=3_600_000, description="a bucket boundary of the metric's histogram (ttft, tpot: the GenAI buckets)"
    )
    window: PositiveDuration = 300
    min_requests: int = Field(default=20, ge=0, description="no firing on fewer requests (streams) than this")

    @field_validator("threshold_ms")
    @classmethod
    def _on_a_genai_boundary(cls, value: float, info: ValidationInfo) -> float:
        """Judged here, on the field (the error names `threshold_ms`), as for a ttft/tpot SLO: the GenAI boundaries
        are fixed by the contract. A `request` threshold is judged against the configured latency buckets (settings)
        where the API stores the rule."""
        problem = genai_threshold_problem(str(info.data.get("metric")), value)  # no metric: refused already
        if problem is not None:
            raise ValueError(problem)
        return value


class ErrorRatioCondition(Frozen):
    """The share of requests with a bad outcome over a window exceeds a threshold."""

    kind: Literal["error_ratio"]
    threshold: float = Field(gt=0, le=1)
    window: PositiveDuration = 300
    min_requests: int = Field(default=20, ge=0)


GaugeMetric = Literal[
    "queue_depth", "gpu_memory_free_bytes", "gpu_memory_free_ratio", "gpu_temperature_c", "gpu_utilization",
    "kv_cache_use_ratio", "preemptions_per_minute", "active_streams",
]  # fmt: skip
"""`kv_cache_use_ratio`: KV blocks held / the budget's blocks (generative models); `preemptions_per_minute`: sequences
preempted in the last whole minute; `active_streams`: generative sequences admitted and not finished."""


class GaugeCondition(Frozen):
    """A device gauge crosses a threshold."""

    kind: Literal["gauge"]
    metric: GaugeMetric
    op: Literal[">", ">=", "<", "<="]
    threshold: float = Field(ge=-1e12, le=1e12)


class StaleCondition(Frozen):
    """The agent has not reported for `after` (default: the control plane's stale timeout)."""

    kind: Literal["stale"]
    after: PositiveDuration | None = None


Condition = Annotated[
    BurnRateCondition | LatencyCondition | ErrorRatioCondition | GaugeCondition | StaleCondition,
    Field(discriminator="kind"),
]

# ---- actions, mildest first -------------------------------------------------------------------


class TuneBatchingAction(Frozen):
    kind: Literal["tune_batching"]
    max_queue_delay_us: int | None = Field(default=None, ge=0, le=10_000_000)
    preferred_batch_sizes: list[Annotated[int, Field(gt=0, le=65536)]] | None = Field(default=None, max_length=16)

    @model_validator(mode="after")
    def _something_to_tune(self) -> TuneBatchingAction:
        if self.max_queue_delay_us is None and not self.preferred_batch_sizes:
            raise ValueError("tune_batching needs max_queue_delay_us or preferred_batch_sizes")
        return self


MAX_TOKENS_LIMIT = 1_048_576
MAX_NUM_SEQS_LIMIT = 4096
MAX_BATCHED_TOKENS_LIMIT = 1_048_576
"""The largest values the policy document accepts (spillway/contract/policy.py `ModelPolicy`): a limit relaxed step by
step during recovery never goes past them."""


class CapMaxTokensAction(Frozen):
    """Generative models: a request asking for more than `max_tokens` (or for no limit) gets `max_tokens`, ends with
    `finish_reason: length` and a `Spillway-Max-Tokens-Cap` header. Recovery in steps doubles the cap each step."""

    kind: Literal["cap_max_tokens"]
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT, description="the most tokens a new request may generate")


class LimitGenerationAction(Frozen):
    """Generative models: lower the engine's `max_num_seqs` (sequences decoded at once) or its token budget per step
    (`max_num_batched_tokens`) for new steps; running sequences beyond the new limit finish first. Recovery in steps
    doubles both limits each step (the agent never goes above its configured limits)."""

    kind: Literal["limit_generation"]
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=MAX_NUM_SEQS_LIMIT, description="sequences decoded at once, at most"
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=MAX_BATCHED_TOKENS_LIMIT, description="tokens one engine step computes, at most"
    )

    @model_validator(mode="after")
    def _something_to_limit(self) -> LimitGenerationAction:
        if self.max_num_seqs is None and self.max_num_batched_tokens is None:
            raise ValueError("limit_generation needs max_num_seqs or max_num_batched_tokens")
        return self


class OverflowAction(Frozen):
    """Send to the cloud (the control plane's gateway) what the agent should not serve itself. `deadline`: only
    requests predicted to miss their deadline; `fraction`: that too, plus this share of the rest; `priority`: that
    too, plus every request at `priority_at_or_below` or a lower priority (a larger number)."""

    kind: Literal["overflow"]
    mode: Literal["deadline", "fraction", "priority"] = "deadline"
    fraction: float | None = Field(default=None, gt=0, le=1, description="mode fraction: the share sent")
    priority_at_or_below: int | None = Field(default=None, ge=1, le=64, description="mode priority: the level")

    @model_validator(mode="after")
    def _mode_has_its_parameter(self) -> OverflowAction:
        if self.mode == "fraction" and self.fraction is None:
            raise ValueError("overflow mode 'fraction' needs fraction (0 < fraction <= 1)")
        if self.mode == "priority" and self.priority_at_or_below is None:
            raise ValueError("overflow mode 'priority' needs priority_at_or_below")
        if self.mode != "fraction" and self.fraction is not None:
            raise ValueError(f"fraction is for mode 'fraction', not {self.mode!r}")
        if self.mode != "priority" and self.priority_at_or_below is not None:
            raise ValueError(f"priority_at_or_below is for mode 'priority', not {self.mode!r}")
        return self


class SwitchVariantAction(Frozen):
    kind: Literal["switch_variant"]
    version: int = Field(ge=1, description="the model version to serve instead, e.g. the lite one")


class ShedAction(Frozen):
    kind: Literal["shed"]
    priority_at_or_below: int = Field(ge=1, le=64, description="refuse this priority level and every lower one")
    retry_after_s: int = Field(default=5, ge=1, le=3600)


class FallbackAction(Frozen):
    kind: Literal["fallback"]
    priority_at_or_below: int = Field(ge=1, le=64)
    mode: Literal["cache", "default"] = Field(
        default="cache",
        description=(
            "cache: the last answer to the same inputs (generative: to the same greedy request); default: "
            "`default_outputs` (V2 models) or `default_text` (generative models)"
        ),
    )
    default_outputs: list[dict[str, Any]] | None = Field(
        default=None, max_length=64, description="V2 output tensors (name, shape, datatype, data) for mode=default"
    )
    default_text: str | None = Field(
        default=None, min_length=1, max_length=65536, description="generative models' answer for mode=default"
    )

    @model_validator(mode="after")
    def _default_given(self) -> FallbackAction:
        if self.mode == "default" and not self.default_outputs and not self.default_text:
            raise ValueError("fallback mode 'default' needs default_outputs (V2 models) or default_text (generative)")
        return self


Action = Annotated[
    TuneBatchingAction | CapMaxTokensAction | LimitGenerationAction | OverflowAction | SwitchVariantAction
    | ShedAction | FallbackAction,
    Field(discriminator="kind"),
]  # fmt: skip
ACTION_LADDER = (
    "tune_batching", "cap_max_tokens", "limit_generation", "overflow", "switch_variant", "shed", "fallback"
)  # fmt: skip
"""Actions from mildest to harshest: the order in which several rules on one agent compose."""


def unknown_kind(value: NoReturn) -> NoReturn:
    """The last case of a `match` over conditions or actions: mypy names a kind no case handles (Python 3.10's
    `typing.assert_never`)."""
    raise AssertionError(f"unhandled kind: {value!r}")


class Hysteresis(Frozen):
    for_: Duration = Field(default=0, alias="for", description="the condition holds this long before firing")
    recover_after: Duration = Field(default=0, description="clear this long before reverting")
    recovery_steps: int = Field(
        default=1, ge=1, le=64,
        description=(
            "revert in this many steps, each after recover_after clear (shed, fallback, overflow by priority: one "
            "level fewer per step; overflow by fraction: half the share per step; cap_max_tokens, "
            "limit_generation: twice the limit per step)"
        ),
    )  # fmt: skip
    max_flaps_per_hour: int = Field(
        default=4, ge=1, le=1000,
        description="a rule that fired and recovered this many times in an hour stays fired (and says so)",
    )  # fmt: skip


class RuleCreate(Strict):
    name: Name
    description: str = Field(default="", max_length=2000)
    selector: Selector = Field(default_factory=Selector)
    condition: Condition
    action: Action
    hysteresis: Hysteresis = Field(default_factory=Hysteresis)
    enabled: bool = True
    dry_run: bool = False


RulePatch = partial(RuleCreate)


class RuleRead(RuleCreate, Stored):
    pass


class RuleSelector(Selector, Frozen):
    """A stored rule's selector, frozen like the rest of a `RuleSpec`."""


class RuleSpec(BaseModel):
    """A stored rule as the control loop and the SLO windows evaluate it: its JSON columns (selector, condition,
    action, hysteresis) parsed once, where the row is read, into frozen typed values."""

    model_config = ConfigDict(frozen=True, from_attributes=True)

    id: str
    version: int
    name: str
    selector: RuleSelector = Field(default_factory=RuleSelector)
    condition: Condition
    action: Action
    hysteresis: Hysteresis = Field(default_factory=Hysteresis)
    dry_run: bool = False

    @field_validator("selector", "hysteresis", mode="before")
    @classmethod
    def _absent_is_default(cls, value: Any) -> Any:
        return {} if value is None else value

    @classmethod
    def of(cls, row: Any) -> RuleSpec:
        """From a `rules` row (anything with these attributes); raises ValidationError for one that does not parse."""
        return cls.model_validate(row, from_attributes=True)


def parse_rules(rows: Iterable[Any]) -> list[RuleSpec]:
    """The rules among `rows` that parse; one that does not (stored by a newer version, say) is left out, logged."""
    specs = []
    for row in rows:
        try:
            specs.append(RuleSpec.of(row))
        except ValidationError as exc:
            log.warning("rule %s (%s) left out: its stored definition does not parse: %s", row.name, row.id, exc)
    return specs
