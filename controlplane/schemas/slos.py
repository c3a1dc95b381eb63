"""SLO schemas: selector + SLI kind + objective + rolling window + multiwindow burn-rate alerts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from controlplane.schemas.common import Name, PositiveDuration, Selector, Stored, Strict, partial


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


def default_alert_windows() -> list[AlertWindow]:
    """The Google SRE workbook's pairs for a 30-day window (2 %, 5 %, 10 % of budget)."""
    return [
        AlertWindow(long=3600, short=300, burn_rate=14.4, severity="page"),
        AlertWindow(long=6 * 3600, short=1800, burn_rate=6, severity="page"),
        AlertWindow(long=3 * 86400, short=6 * 3600, burn_rate=1, severity="ticket"),
    ]


class SloCreate(Strict):
    name: Name
    description: str = Field(default="", max_length=2000)
    selector: Selector = Field(default_factory=Selector)
    sli_kind: Literal["latency", "availability"]
    threshold_ms: float | None = Field(
        default=None, gt=0, le=3_600_000, description="latency SLOs: a good request is faster than this"
    )
    objective: float = Field(gt=0, lt=100, description="percent of good requests, e.g. 99.5")
    window: PositiveDuration = Field(default=28 * 86400, description="rolling window, e.g. '28d'")
    alert_windows: list[AlertWindow] = Field(default_factory=default_alert_windows, max_length=8)

    @model_validator(mode="after")
    def _fits_kind(self) -> SloCreate:
        if self.sli_kind == "latency" and self.threshold_ms is None:
            raise ValueError("threshold_ms is required for a latency SLO")
        if self.sli_kind == "availability" and self.threshold_ms is not None:
            raise ValueError("threshold_ms applies only to latency SLOs")
        for alert in self.alert_windows:
            if alert.long > self.window:
                raise ValueError("an alert's long window must not exceed the SLO window")
        return self


SloPatch = partial(SloCreate)


class SloRead(SloCreate, Stored):
    pass
