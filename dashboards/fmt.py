"""Numbers, percentages, shares and event kinds as people read them, for every page's tables and metrics.

One place, so every view says a number the same way: `78.1879` -> `78.2`, `945.0` -> `945`, `12345` -> `12,345`,
`None` or NaN -> an en dash (`DASH`), an objective `99.5` -> `99.5 %`. Tables keep their numbers as numbers (they sort
as numbers) and show them through `table`, which formats each numeric cell with `number`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd
import streamlit as st
from pandas.io.formats.style import Styler

DASH = "\u2013"  # what a missing figure reads as: an en dash, never None or NaN
# An outcome mix (`local 60%, queued_async 30%, overflow 10%`) gets the room to be read whole.
WIDE_OUTCOMES = {"outcomes": st.column_config.TextColumn("outcomes", width="large")}


def missing(value: Any) -> bool:
    """None, NaN or pandas' NA: a figure the API did not have."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # a list or a dict: present
        return False


def number(value: Any) -> str:
    """A figure for people: whole numbers without decimals (thousands separated, as is anything from 1000 up),
    others from 10 up with one decimal (78.2), from 1 up with two at most (2.56, 5.25, 1.5), small ones with two
    significant digits (0.87, 0.012); `DASH` for a missing one. Text passes through as it is."""
    if missing(value):
        return DASH
    if isinstance(value, bool):
        return str(value)
    if not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars
        except (TypeError, ValueError):
            return str(value)
    number_ = float(value) + 0.0  # -0.0 reads "0"
    if math.isinf(number_):
        return "∞" if number_ > 0 else "-∞"
    size = abs(number_)
    if number_.is_integer() or size >= 1000:
        return f"{number_:,.0f}"
    if size >= 10:
        return f"{number_:,.1f}".removesuffix(".0")
    if size >= 1:
        text = f"{number_:.2f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    digits = min(6, 1 - math.floor(math.log10(size)))  # two significant digits: 0.87, 0.012
    text = f"{number_:.{digits}f}"
    if abs(float(text)) >= 1:  # rounded up to 1 (0.99999): said as a number from 1 up
        return number(float(text))
    return text if float(text) != 0 else "0"


def percent(value: Any, digits: int = 2) -> str:
    """A number already in percent (an objective: 99.5 -> `99.5 %`): at most `digits` decimals, trailing zeros
    dropped, and never rounded up to 100 (99.9996 reads `99.9996 %`, not `100 %`)."""
    if missing(value):
        return DASH
    value = float(value)
    places = digits
    text = f"{value:.{places}f}"
    while float(text) == 100 and value < 100 and places < 8:  # 99.999 is not 100
        places += 1
        text = f"{value:.{places}f}"
    if abs(value) >= 100 and value != 100 and places == digits:  # an overspent budget: -589.7 %
        text = f"{value:.1f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{'0' if float(text) == 0 else text} %"  # -0.0001 % reads 0 %


def ratio_percent(value: Any, digits: int = 2) -> str:
    """A ratio (an SLI: 0.99512, a budget left: -5.897) in percent: `99.51 %`, `-589.7 %`."""
    return DASH if missing(value) else percent(float(value) * 100, digits)


def share(value: Any) -> str:
    """A share of a whole (0.953 of the requests) in whole percent, `<1%` for a small one that is not zero."""
    if missing(value):
        return DASH
    value = float(value)
    if 0 < value < 0.005:
        return "<1%"
    return f"{value:.0%}"


# Rule transitions in words; a dry-run rule's kinds say what it would have done (`rule.would_fire`), and the names
# stored before they were renamed (`rule.would_fired`) read the same.
RULE_WORDS = {
    "fired": "fired",
    "refired": "fired again",
    "stepped_down": "stepped down",
    "recovered": "recovered",
    "flapping": "latched (flapping)",
}
WOULD_WORDS = {
    "fire": "fire",
    "fired": "fire",
    "refire": "fire again",
    "refired": "fire again",
    "step_down": "step down",
    "stepped_down": "step down",
    "recover": "recover",
    "recovered": "recover",
    "flap": "latch (flapping)",
    "flapping": "latch (flapping)",
}


def event_kind(kind: Any) -> str:
    """An event kind in words: `rule.fired` -> `rule fired`, `rule.would_fire` -> `rule would fire (dry run)`,
    `api_key.created` -> `api key created`."""
    text = str(kind or "")
    subject, _, verb = text.partition(".")
    if subject == "rule" and verb.startswith("would_"):
        what = verb.removeprefix("would_")
        return f"rule would {WOULD_WORDS.get(what, what.replace('_', ' '))} (dry run)"
    if subject == "rule" and verb in RULE_WORDS:
        return f"rule {RULE_WORDS[verb]}"
    return text.replace(".", " ").replace("_", " ")


_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> int:
    """The API's durations (`5m`, `6h`, `28d`, `1h30m`) in seconds; 0 for text that is not one."""
    text = str(duration).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return 0
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


def duration(seconds: Any) -> str:
    """A span for people: `45 s`, `12 min`, `3.5 h`, `2.3 d`."""
    if missing(seconds):
        return DASH
    seconds = float(seconds)
    if seconds < 60:
        return f"{number(round(seconds))} s"
    if seconds < 3600:
        return f"{number(round(seconds / 60))} min"
    if seconds < 86400:
        return f"{number(round(seconds / 3600, 1))} h"
    return f"{number(round(seconds / 86400, 1))} d"


def cell(value: Any) -> Any:
    """A table cell as shown: numbers through `number`, missing ones `DASH`, anything else as it is."""
    if missing(value):
        return DASH
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return number(value)
    return value


def show(rows: Iterable[Mapping[str, Any]] | pd.DataFrame, columns: list[str] | None = None, **options: Any) -> None:
    """Draw rows as a table as `table` shows them, without the index, a missing figure as `DASH` (the grid's own
    placeholder for an empty cell: it draws those itself); `options` go to `st.dataframe` (`column_config`)."""
    st.dataframe(table(rows, columns), hide_index=True, placeholder=DASH, **options)


def table(rows: Iterable[Mapping[str, Any]] | pd.DataFrame, columns: list[str] | None = None) -> Styler:
    """Rows (or a frame) for `st.dataframe`: the numbers stay numbers underneath (a column sorts as numbers), each
    cell shows as `cell` says (`78.2`, `945`, `DASH`)."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows), columns=columns)
    return frame.style.format(cell, na_rep=DASH)
