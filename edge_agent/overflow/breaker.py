"""A circuit breaker on the overflow target: stop sending to it while it is slow or failing, probe it to come back.

The states and rules are Alibaba Sentinel's degrade rules (`CircuitBreaker`, `AbstractCircuitBreaker`,
`ResponseTimeCircuitBreaker`, `ExceptionCircuitBreaker`), both strategies in one breaker:

- CLOSED: every request goes. Each outcome lands in a sliding window of `stat_interval_s`. Once the window holds at
  least `min_requests` outcomes, the breaker opens when the share of slow requests (slower than `slow_rt_ms`)
  exceeds `slow_ratio`, or the share of failed requests exceeds `error_ratio`. A ratio of 1.0 opens only when
  every request in the window was slow (or failed), as in Sentinel; None switches that strategy off.
- OPEN for `open_s` (Sentinel's `timeWindow`): every `allow()` is refused.
- HALF_OPEN: the first `allow()` after `open_s` is the one probe; every other `allow()` is refused while it is
  out. A probe that succeeds within `slow_rt_ms` closes the breaker with an empty window; a failed or slow one
  opens it for another `open_s`.

Where this breaker differs from Sentinel's:

- One breaker judges both statistics; Sentinel keeps one breaker per rule. A probe here must be neither slow
  (when the slow strategy is on) nor failed (when the error strategy is on) to close the breaker.
- The window slides over `buckets` buckets (10 by default), like Sentinel's `LeapArray` for flow statistics.
  Sentinel's breakers use a one-bucket `LeapArray`, a window that tumbles every `statIntervalMs`.
- Closing resets the whole window; Sentinel's `resetStat()` resets only the current bucket.
- Outcomes recorded while OPEN (requests let through before it opened) are dropped; Sentinel counts them,
  and they would be reset on closing anyway.
- `release()` gives the probe slot back and the breaker stays HALF_OPEN, so the next `allow()` is the probe.
  Sentinel's hook for a probe blocked by a later rule goes back to OPEN with the retry time already past,
  which has the same effect with two more state changes.
- Like Sentinel, the breaker cannot tell the probe's outcome from a straggler's (a request let through while
  CLOSED that completes during HALF_OPEN): the first outcome or release while the probe is out counts as the
  probe's.

Contract: each `allow()` that returns True is followed by exactly one `record()` or `release()`; a leaked probe
keeps the breaker HALF_OPEN, refusing everything. Everything runs on one event loop, so nothing is locked.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerConfig:
    """When the breaker opens and for how long; see the module docstring for the rules."""

    slow_rt_ms: float = 1000.0  # a request that took longer than this is slow (Sentinel: the rule's `count`)
    slow_ratio: float | None = 0.5  # open above this share of slow requests; None: never open for slowness
    error_ratio: float | None = 0.5  # open above this share of failed requests; None: never open for errors
    min_requests: int = 5  # no judgement on fewer outcomes than this in the window (Sentinel: minRequestAmount)
    stat_interval_s: float = 10.0  # the sliding window's length (Sentinel: statIntervalMs)
    open_s: float = 5.0  # how long it stays open before a probe (Sentinel: timeWindow)
    buckets: int = 10  # the window's resolution: outcomes leave it one bucket at a time

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slow_rt_ms) and self.slow_rt_ms > 0):
            raise ValueError(f"slow_rt_ms must be a positive number of milliseconds, got {self.slow_rt_ms}")
        for name in ("slow_ratio", "error_ratio"):
            ratio = getattr(self, name)
            if ratio is not None and not 0.0 <= ratio <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1 (or None to switch it off), got {ratio}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, got {self.min_requests}")
        if not (math.isfinite(self.stat_interval_s) and self.stat_interval_s > 0):
            raise ValueError(f"stat_interval_s must be a positive number of seconds, got {self.stat_interval_s}")
        if not (math.isfinite(self.open_s) and self.open_s > 0):
            raise ValueError(f"open_s must be a positive number of seconds, got {self.open_s}")
        if self.buckets < 1:
            raise ValueError(f"buckets must be >= 1, got {self.buckets}")


def _exceeds(ratio: float, threshold: float | None) -> bool:
    # Sentinel's rule: strictly above the threshold, except that a threshold of 1.0 is met by a ratio of 1.0.
    return threshold is not None and (ratio > threshold or ratio == threshold == 1.0)


class _Window:
    """Counts of requests, failures and slow requests over the last `buckets` buckets; O(1) amortised per call.

    Bucket `e` covers [e * width, (e + 1) * width); the totals are kept as running sums, and a bucket's counts are
    subtracted when time moves past the window's far end (at most `buckets` of them per call).
    """

    __slots__ = ("_epoch", "_errors", "_n", "_requests", "_slow", "_width", "errors", "requests", "slow")

    def __init__(self, interval_s: float, buckets: int) -> None:
        self._n = buckets
        self._width = interval_s / buckets
        self._requests = [0] * buckets
        self._errors = [0] * buckets
        self._slow = [0] * buckets
        self._epoch = 0  # the newest bucket counted in the totals
        self.requests = self.errors = self.slow = 0

    def advance(self, now: float) -> int:
        """Slide the window to `now`; returns the current bucket's index."""
        epoch = math.floor(now / self._width)
        if epoch > self._epoch:
            if epoch - self._epoch >= self._n:
                self.reset()
            else:
                for e in range(self._epoch + 1, epoch + 1):  # the buckets that now start over
                    i = e % self._n
                    self.requests -= self._requests[i]
                    self.errors -= self._errors[i]
                    self.slow -= self._slow[i]
                    self._requests[i] = self._errors[i] = self._slow[i] = 0
            self._epoch = epoch
        # A clock that steps back lands in the newest bucket rather than in one that was already reused.
        return self._epoch % self._n

    def add(self, now: float, ok: bool, slow: bool) -> None:
        i = self.advance(now)
        self._requests[i] += 1
        self.requests += 1
        if not ok:
            self._errors[i] += 1
            self.errors += 1
        if slow:
            self._slow[i] += 1
            self.slow += 1

    def reset(self) -> None:
        for counts in (self._requests, self._errors, self._slow):
            counts[:] = [0] * self._n
        self.requests = self.errors = self.slow = 0


class CircuitBreaker:
    """Sentinel-style breaker over one target's outcomes: `allow()` before a request, `record()` after it."""

    def __init__(
        self,
        config: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """Args:
        config: the thresholds.
        clock: seconds, monotonic.
        on_change: called as on_change(old_state, new_state, reason) after each transition; an exception
            from it is logged, never raised into the request path.
        """
        self.config = config
        self._clock = clock
        self._on_change = on_change
        self._slow_s = config.slow_rt_ms / 1000.0
        self._window = _Window(config.stat_interval_s, config.buckets)
        self._state = CLOSED
        self._probe_out = False
        self.opened_at: float | None = None
        self.open_until: float | None = None
        self.times_opened = 0

    @property
    def state(self) -> str:
        """One of CLOSED, OPEN, HALF_OPEN; an OPEN breaker whose `open_s` has passed turns HALF_OPEN at `allow()`."""
        return self._state

    def allow(self) -> bool:
        """Whether a request may go to the target now; in HALF_OPEN, True makes this request the probe."""
        if self._state == CLOSED:
            return True
        if self._state == OPEN:
            assert self.open_until is not None
            if self._clock() < self.open_until:
                return False
            self._transition(HALF_OPEN, f"open for {self.config.open_s:g}s: probing")
        if self._probe_out:
            return False
        self._probe_out = True
        return True

    def record(self, ok: bool, rt_s: float) -> None:
        """The outcome of a request that `allow()` let through: whether it succeeded, and how long it took."""
        slow = rt_s > self._slow_s
        if self._state == CLOSED:
            now = self._clock()
            window = self._window
            window.add(now, ok, slow)
            if window.requests < self.config.min_requests:
                return
            if _exceeds(ratio := window.errors / window.requests, self.config.error_ratio):
                self._open(now, f"error ratio {ratio:.2f} > {self.config.error_ratio} "
                                f"({window.errors}/{window.requests} in {self.config.stat_interval_s:g}s)")  # fmt: skip
            elif _exceeds(ratio := window.slow / window.requests, self.config.slow_ratio):
                self._open(now, f"slow ratio {ratio:.2f} > {self.config.slow_ratio} "
                                f"({window.slow}/{window.requests} over {self.config.slow_rt_ms:g} ms "
                                f"in {self.config.stat_interval_s:g}s)")  # fmt: skip
        elif self._state == HALF_OPEN and self._probe_out:
            self._probe_out = False
            if not ok and self.config.error_ratio is not None:
                self._open(self._clock(), "probe failed")
            elif slow and self.config.slow_ratio is not None:
                self._open(self._clock(), f"probe slow: {rt_s * 1000:.0f} ms > {self.config.slow_rt_ms:g} ms")
            else:
                self._window.reset()
                self.opened_at = self.open_until = None
                self._transition(CLOSED, f"probe succeeded in {rt_s * 1000:.0f} ms")

    def release(self) -> None:
        """A request that `allow()` let through but that was never sent: give back the probe slot, judge nothing."""
        if self._state == HALF_OPEN:
            self._probe_out = False

    def json(self) -> dict[str, Any]:
        """The state, the window's counts and ratios, and when it opened, for the agent's status."""
        window = self._window
        if self._state == CLOSED:
            window.advance(self._clock())
        total = window.requests
        return {
            "state": self._state,
            "requests": total,
            "errors": window.errors,
            "slow": window.slow,
            "error_ratio": window.errors / total if total else 0.0,
            "slow_ratio": window.slow / total if total else 0.0,
            "opened_at": self.opened_at,
            "open_until": self.open_until,
            "probe_out": self._probe_out,
            "times_opened": self.times_opened,
            "config": asdict(self.config),
        }

    def _open(self, now: float, reason: str) -> None:
        self.opened_at = now
        self.open_until = now + self.config.open_s
        self.times_opened += 1
        self._probe_out = False
        self._transition(OPEN, reason)

    def _transition(self, state: str, reason: str) -> None:
        old, self._state = self._state, state
        if self._on_change is None:
            return
        try:
            self._on_change(old, state, reason)
        except Exception:
            logger.exception("circuit breaker on_change(%s, %s) failed", old, state)
