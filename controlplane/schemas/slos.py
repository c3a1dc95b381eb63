"""SLO schemas: selector + SLI kind + objective + rolling window + multiwindow burn-rate alerts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from controlplane.schemas.common import Name, PositiveDuration, Selector, Stored, Strict, partial
from spillway.contract.names import GENAI_TPOT_BUCKETS, GENAI_TTFT_BUCKETS
from spillway.contract.tenants import NAME_PATTERN

SliKind = Literal["latency", "availability", "ttft", "tpot"]
"""`latency`: share of requests served within `threshold_ms` (spillway.request.duration); `availability`: share
with a good outcome; `ttft` / `tpot`: share of generative streams whose time to first token / mean time per output
token is within `threshold_ms` (the OTel GenAI histograms, every stream the agent answered with tokens)."""

# The GenAI histograms' bucket boundaries (the semantic conventions', fixed, unlike the latency buckets that a
# control plane configures), in ms: a ttft or tpot threshold must be one of them, else good/bad is not exact.
GENAI_THRESHOLDS_MS: dict[str, tuple[float, ...]] = {
    "ttft": tuple(round(b * 1000, 6) for b in GENAI_TTFT_BUCKETS),
    "tpot": tuple(round(b * 1000, 6) for b in GENAI_TPOT_BUCKETS),
}
THRESHOLD_KINDS = frozenset({"latency", *GENAI_THRESHOLDS_MS})  # the kinds that judge a time against threshold_ms


def genai_threshold_problem(kind: str, threshold_ms: float) -> str | None:
    """Why `threshold_ms` cannot be the threshold of a `ttft` or `tpot` SLI (or rule condition), or None: it must
    be one of that metric's bucket boundaries; the message lists them."""
    allowed = GENAI_THRESHOLDS_MS.get(kind)
    if allowed is None or any(abs(threshold_ms - b) <= 1e-9 * b for b in allowed):
        return None
    listed = ", ".join(f"{b:g}" for b in allowed)
    return f"{threshold_ms:g} is not a {kind} bucket boundary; use one of {listed} (ms)"


class AlertWindow(Strict):
    """A multiwindow burn-rate alert: fires when both windows burn faster than `burn_rate`."""

    long: PositiveDuration
    short: PositiveDuration
    burn_rate: float = Field(gt=0, le=1e6)
    severity: Literal["page", "ticket"] = "page"

    @model_validator(mode="after")
    def _short_inside_long(self) -> AlertWindow:
        if self.short >= self.long:
            raise ValueError("short window must be shorter than the long window")
        return self


WORKBOOK_WINDOW = 30 * 86400


def default_alert_windows(window: int = WORKBOOK_WINDOW) -> list[AlertWindow]:
    """The Google SRE workbook's pairs for a 30-day window (2 %, 5 %, 10 % of the budget), scaled to `window`:
    the windows shrink or grow with it (whole minutes, at least one), the burn rates stay, so each pair still
    fires on the same share of the budget."""

    def scaled(seconds: int) -> int:
        return max(60, round(seconds * window / WORKBOOK_WINDOW / 60) * 60)

    if window < 120:
        return []  # too short a window for a pair of windows inside it
    pairs: list[tuple[int, int, float, Literal["page", "ticket"]]] = [
        (3600, 300, 14.4, "page"), (6 * 3600, 1800, 6.0, "page"), (3 * 86400, 6 * 3600, 1.0, "ticket"),
    ]  # fmt: skip
    windows = []
    for long, short, rate, severity in pairs:
        long_s, short_s = scaled(long), scaled(short)
        if short_s >= long_s:  # a very short SLO window: keep the pair meaningful
            long_s = short_s + 60
        windows.append(AlertWindow(long=long_s, short=short_s, burn_rate=rate, severity=severity))
    return windows


class SloSelector(Selector):
    """Which agents (all of these labels), which model (any when absent) and which tenant (every one when absent) an
    SLO counts the requests of."""

    tenant: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=NAME_PATTERN,
        description="only this tenant's requests (streams), by the name the agents' telemetry gives it "
        "(`spillway.tenant`): a tenant's name, `default` (the operator's own token, and agents without tenants) or "
        "`other` (tenants an agent does not know)",
    )  # fmt: skip


class SloCreate(Strict):
    name: Name
    description: str = Field(default="", max_length=2000)
    selector: SloSelector = Field(default_factory=SloSelector)
    sli_kind: SliKind
    threshold_ms: float | None = Field(
        default=None, gt=0, le=3_600_000,
        description="latency, ttft and tpot SLOs: a good request (stream) takes at most this; ttft and tpot: one of "
        "the GenAI histogram's bucket boundaries",
    )  # fmt: skip
    objective: float = Field(gt=0, lt=100, description="percent of good requests, e.g. 99.5")
    window: PositiveDuration = Field(default=28 * 86400, description="rolling window, e.g. '28d'")
    alert_windows: list[AlertWindow] = Field(
        default_factory=default_alert_windows, max_length=8,
        description="burn-rate alert pairs; when left out, the SRE workbook's pairs scaled to the window",
    )  # fmt: skip

    @field_validator("threshold_ms")
    @classmethod
    def _on_genai_boundary(cls, value: float | None, info: ValidationInfo) -> float | None:
        """Judged here, on the field (so the error names `threshold_ms`): the GenAI boundaries are fixed. A latency
        threshold is judged against the configured latency buckets by the API."""
        problem = None if value is None else genai_threshold_problem(str(info.data.get("sli_kind")), value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _fits_kind(self) -> SloCreate:
        if "alert_windows" not in self.model_fields_set:
            self.alert_windows = default_alert_windows(self.window)
        if self.sli_kind in THRESHOLD_KINDS and self.threshold_ms is None:
            raise ValueError(f"threshold_ms is required for a {self.sli_kind} SLO")
        if self.sli_kind == "availability" and self.threshold_ms is not None:
            raise ValueError("threshold_ms applies only to latency, ttft and tpot SLOs")
        for alert in self.alert_windows:
            if alert.long > self.window:
                raise ValueError("an alert's long window must not exceed the SLO window")
        return self


SloPatch = partial(SloCreate)


class SloRead(SloCreate, Stored):
    pass


__all__ = [
    "GENAI_THRESHOLDS_MS",
    "THRESHOLD_KINDS",
    "AlertWindow",
    "SliKind",
    "SloCreate",
    "SloPatch",
    "SloRead",
    "SloSelector",
    "default_alert_windows",
    "genai_threshold_problem",
]
