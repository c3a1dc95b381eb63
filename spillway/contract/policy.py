"""The policy document: one per agent, versioned, written by the control plane and applied by the agent.

Defined once, here, and imported by both sides (the control plane may import the agent's modules; the agent
never imports the control plane's). Every field is validated on both sides: the control plane cannot publish
a document the agent would refuse, and an agent refuses a malformed one and keeps its last good policy.

A document says, per model (key `*`: every model the agent serves, overridden field by field by a model's own
entry), what to change from the model's configuration: batching parameters, the variant (version) to serve,
which priority levels to overflow to the control plane's gateway, shed or answer with a fallback, and for generative
models the engine's limits (a cap on max_tokens, max_num_seqs, the token budget). A field left out (null) means "as
configured".
"""

from __future__ import annotations

from datetime import datetime
from itertools import pairwise
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spillway.contract.tenants import MAX_TENANTS, Tenant, check_unique

ALL_MODELS = "*"
FORMAT: Literal[1] = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fallback(_Strict):
    """Requests at priority level `at_or_below` (the number) or any larger number get a fallback answer."""

    at_or_below: int = Field(ge=1, le=64)
    mode: Literal["cache", "default"] = Field(
        description=(
            "cache: the last answer to the same inputs (generative models: to the same greedy request), else refused; "
            "default: `default_outputs` (V2 models) or `default_text` (generative models)"
        )
    )
    default_outputs: list[dict[str, Any]] | None = Field(
        default=None, max_length=64, description="V2 output tensors (name, shape, datatype, data) for mode=default"
    )
    default_text: str | None = Field(
        default=None, min_length=1, max_length=65536, description="generative models' answer for mode=default"
    )

    @model_validator(mode="after")
    def _default_given(self) -> Fallback:
        if self.mode == "default" and not self.default_outputs and not self.default_text:
            raise ValueError("fallback mode 'default' needs default_outputs (V2 models) or default_text (generative)")
        return self


class Shed(_Strict):
    """Requests at priority level `at_or_below` (the number) or any larger number are refused at admission."""

    at_or_below: int = Field(ge=1, le=64)
    retry_after_s: int = Field(default=5, ge=1, le=3600)


class Overflow(_Strict):
    """Send to the control plane's gateway (the cloud) what the agent should not serve itself.

    Always: a request that admission predicts will miss its deadline (instead of refusing it). On top of that,
    `fraction` of the other requests, and every request at priority level `at_or_below` or any larger number.
    """

    fraction: float = Field(default=0.0, ge=0.0, le=1.0, description="share of the remaining traffic sent too")
    at_or_below: int | None = Field(default=None, ge=1, le=64, description="send every request at this level or lower")


class ModelPolicy(_Strict):
    variant: int | None = Field(default=None, ge=1, description="serve this version for the model's traffic")
    max_queue_delay_us: int | None = Field(default=None, ge=0, le=10_000_000)
    preferred_batch_sizes: list[Annotated[int, Field(gt=0, le=65536)]] | None = Field(default=None, max_length=16)
    overflow: Overflow | None = None
    shed: Shed | None = None
    fallback: Fallback | None = None
    # Generative models only (a V2 model ignores them): the engine's limits, applied live to new streams.
    max_tokens_cap: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="a request asking for more tokens (or for no limit) gets this many at most, finish_reason length",
    )  # fmt: skip
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096, description="sequences decoded at once, at most")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=1_048_576, description="tokens one engine step computes, at most (the token budget)"
    )

    def over(self, base: ModelPolicy) -> ModelPolicy:
        """This entry's fields where set, `base`'s elsewhere (a model's own entry over `*`)."""
        mine = self.model_dump(exclude_none=True)
        return ModelPolicy.model_validate({**base.model_dump(exclude_none=True), **mine})


class Cause(_Strict):
    """Why the document says what it says: one active rule and its action."""

    rule: str
    name: str
    action: str
    model: str = ALL_MODELS
    since: datetime | None = None


class PolicyDocument(_Strict):
    format: Literal[1] = FORMAT
    agent: str = Field(min_length=1, max_length=64)
    version: int = Field(ge=0, description="grows with every change; 0: nothing published yet")
    models: dict[str, ModelPolicy] = Field(default_factory=dict, max_length=1024)
    latency_buckets_ms: list[float] | None = Field(
        default=None, min_length=1, max_length=64, description="the duration histograms' boundaries (OTel views)"
    )
    export_interval_s: float | None = Field(default=None, ge=0.5, le=3600)
    poll_interval_s: float | None = Field(default=None, ge=0.5, le=3600)
    causes: list[Cause] = Field(default_factory=list, max_length=1024)
    tenants: list[Tenant] | None = Field(
        default=None, max_length=MAX_TENANTS,
        description="tenants over the agent config's: an entry replaces the configured tenant of its name, a new name "
        "is added (null: the config's alone)",
    )  # fmt: skip

    @field_validator("tenants")
    @classmethod
    def _tenants_unique(cls, value: list[Tenant] | None) -> list[Tenant] | None:
        return None if value is None else check_unique(value)

    @field_validator("latency_buckets_ms")
    @classmethod
    def _increasing(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (any(b <= 0 for b in value) or any(a >= b for a, b in pairwise(value))):
            raise ValueError("latency_buckets_ms must be positive and strictly increasing")
        return value

    def for_model(self, name: str) -> ModelPolicy:
        """What applies to one model: its own entry over the `*` entry."""
        base = self.models.get(ALL_MODELS, ModelPolicy())
        own = self.models.get(name)
        return base if own is None else own.over(base)


def parse(body: bytes | str) -> PolicyDocument:
    """A document from JSON; raises pydantic's ValidationError (a ValueError) naming what is wrong."""
    return PolicyDocument.model_validate_json(body)


__all__ = ["ALL_MODELS", "Cause", "Fallback", "ModelPolicy", "Overflow", "PolicyDocument", "Shed", "parse"]
