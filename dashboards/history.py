"""Readings over time, sampled by the dashboard session itself.

The API answers with current values only (a window's summary, an SLO's burn rates now). To draw them over
time, each refresh appends what it read to a bounded log kept in the browser session; a reload starts afresh.
"""

from __future__ import annotations

from collections import deque
from datetime import datetime, timezone
from typing import Any

import pandas as pd

MAX_SAMPLES = 360  # an hour at the default 10 s refresh


class SampleLog:
    """Timestamped rows of named numbers, oldest dropped beyond `maxlen`."""

    def __init__(self, maxlen: int = MAX_SAMPLES) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def add(self, values: dict[str, float | None], at: datetime | None = None) -> None:
        self._rows.append({"time": at or datetime.now(timezone.utc), **values})

    def __len__(self) -> int:
        return len(self._rows)

    def long(self, series: str = "series", value: str = "value") -> pd.DataFrame:
        """One row per (time, series) with a number, the shape Altair draws one line per series from."""
        rows = [{"time": row["time"], series: name, value: v}
                for row in self._rows for name, v in row.items() if name != "time" and v is not None]  # fmt: skip
        return pd.DataFrame(rows, columns=["time", series, value])


def sample_log(state: Any, key: str) -> SampleLog:
    """The session's log under `key` (Streamlit's session_state, or any mutable mapping)."""
    log = state.get(f"_samples_{key}")
    if not isinstance(log, SampleLog):
        log = SampleLog()
        state[f"_samples_{key}"] = log
    return log
