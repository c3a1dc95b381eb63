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
    alert_windows: list[AlertWindow] = Field(
        default_factory=default_alert_windows, max_length=8,
        description="burn-rate alert pairs; when left out, the SRE workbook's pairs scaled to the window",
    )  # fmt: skip

    @model_validator(mode="after")
    def _fits_kind(self) -> SloCreate:
        if "alert_windows" not in self.model_fields_set:
            self.alert_windows = default_alert_windows(self.window)
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
