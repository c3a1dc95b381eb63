"""The overflow target's circuit breaker, on a fake clock: when it opens, how long it stays open, how it probes."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.overflow.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_breaker(**config: Any) -> tuple[CircuitBreaker, FakeClock, list[tuple[str, str, str]]]:
    clock = FakeClock()
    changes: list[tuple[str, str, str]] = []
    breaker = CircuitBreaker(BreakerConfig(**config), clock, lambda old, new, why: changes.append((old, new, why)))
    return breaker, clock, changes


def send(breaker: CircuitBreaker, ok: bool = True, rt_s: float = 0.01) -> bool:
    if not breaker.allow():
        return False
    breaker.record(ok, rt_s)
    return True


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.config.min_requests):
        send(breaker, ok=False)
    assert breaker.state == OPEN


def test_it_opens_when_the_error_ratio_exceeds_the_threshold() -> None:
    breaker, _, changes = make_breaker(error_ratio=0.5, min_requests=4)
    for ok in (True, False, True, False):  # 2/4 = 0.5: not above the threshold
        send(breaker, ok=ok)
    assert breaker.state == CLOSED
    send(breaker, ok=False)  # 3/5 = 0.6
    assert breaker.state == OPEN and not breaker.allow()
    assert changes == [(CLOSED, OPEN, "error ratio 0.60 > 0.5 (3/5 in 10s)")]
    assert breaker.json()["times_opened"] == 1


def test_it_opens_when_the_slow_ratio_exceeds_the_threshold_and_slow_means_strictly_slower() -> None:
    breaker, _, changes = make_breaker(slow_rt_ms=100, slow_ratio=0.5, min_requests=4)
    for rt in (0.1, 0.1, 0.2, 0.01):  # exactly slow_rt_ms is not slow: 1/4
        send(breaker, rt_s=rt)
    assert breaker.state == CLOSED
    send(breaker, rt_s=0.3)
    send(breaker, rt_s=0.3)  # 3/6
    assert breaker.state == CLOSED
    send(breaker, rt_s=0.3)  # 4/7
    assert breaker.state == OPEN
    assert changes[-1][2].startswith("slow ratio 0.57 > 0.5 (4/7 over 100 ms")


def test_nothing_is_judged_below_min_requests() -> None:
    breaker, _, changes = make_breaker(min_requests=5)
    for _ in range(4):
        send(breaker, ok=False, rt_s=5.0)
    assert breaker.state == CLOSED and changes == []
    send(breaker, ok=False)
    assert breaker.state == OPEN


def test_a_ratio_of_one_opens_only_when_every_request_failed_and_none_switches_a_strategy_off() -> None:
    breaker, _, _ = make_breaker(error_ratio=1.0, slow_ratio=None, min_requests=3)
    send(breaker, ok=True, rt_s=60.0)
    for _ in range(10):
        send(breaker, ok=False, rt_s=60.0)
    assert breaker.state == CLOSED  # one success in the window, and slowness is not judged
    breaker, _, _ = make_breaker(error_ratio=1.0, min_requests=3)
    for _ in range(3):
        send(breaker, ok=False)
    assert breaker.state == OPEN


def test_it_stays_open_for_open_s_then_lets_exactly_one_probe_through() -> None:
    breaker, clock, changes = make_breaker(open_s=5.0)
    trip(breaker)
    clock.now += 4.999
    assert not breaker.allow() and breaker.state == OPEN
    clock.now += 0.001
    assert breaker.allow()  # the probe
    assert breaker.state == HALF_OPEN and breaker.json()["probe_out"]
    assert not breaker.allow() and not breaker.allow()  # everyone else waits for the probe's outcome
    assert changes[-1] == (OPEN, HALF_OPEN, "open for 5s: probing")


def test_a_successful_probe_closes_it_with_an_empty_window() -> None:
    breaker, clock, changes = make_breaker(min_requests=2)
    trip(breaker)
    clock.now += 5
    assert breaker.allow()
    breaker.record(True, 0.05)
    assert breaker.state == CLOSED and changes[-1] == (HALF_OPEN, CLOSED, "probe succeeded in 50 ms")
    status = breaker.json()
    assert status["requests"] == 0 and status["opened_at"] is None and status["open_until"] is None
    send(breaker, ok=False)  # the failures before it opened are forgotten: 1 failure is below min_requests
    assert breaker.state == CLOSED


@pytest.mark.parametrize(("ok", "rt_s", "reason"), [(False, 0.01, "probe failed"),
                                                    (True, 2.5, "probe slow: 2500 ms > 1000 ms")])  # fmt: skip
def test_a_failed_or_slow_probe_opens_it_for_another_open_s(ok: bool, rt_s: float, reason: str) -> None:
    breaker, clock, changes = make_breaker(open_s=5.0)
    trip(breaker)
    clock.now += 5
    assert breaker.allow()
    clock.now += rt_s
    breaker.record(ok, rt_s)
    assert breaker.state == OPEN and changes[-1] == (HALF_OPEN, OPEN, reason)
    assert breaker.json()["open_until"] == pytest.approx(clock.now + 5)
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow() and breaker.state == HALF_OPEN
    assert breaker.json()["times_opened"] == 2


def test_release_frees_the_probe_slot_without_judging() -> None:
    breaker, clock, changes = make_breaker()
    trip(breaker)
    clock.now += 5
    assert breaker.allow()
    breaker.release()  # the probe was cancelled before it was sent
    assert breaker.state == HALF_OPEN
    assert breaker.allow()  # the next request is the probe
    assert not breaker.allow()
    assert [new for _, new, _ in changes] == [OPEN, HALF_OPEN]


def test_release_while_closed_changes_nothing() -> None:
    breaker, _, changes = make_breaker()
    assert breaker.allow()
    breaker.release()
    assert breaker.state == CLOSED and breaker.json()["requests"] == 0 and changes == []


def test_old_outcomes_slide_out_of_the_window_one_bucket_at_a_time() -> None:
    breaker, clock, _ = make_breaker(min_requests=5, error_ratio=0.5, stat_interval_s=10.0, buckets=10)
    clock.now = 1000.0
    for _ in range(3):
        send(breaker, ok=False)
    clock.now = 1005.0
    send(breaker, ok=True)
    clock.now = 1009.999
    assert breaker.json()["requests"] == 4
    clock.now = 1010.0  # the bucket [1000, 1001) has left the window
    status = breaker.json()
    assert (status["requests"], status["errors"]) == (1, 0)
    for _ in range(4):  # 2 failures out of 5 in the window: not above 0.5
        send(breaker, ok=_ % 2 == 0)
    assert breaker.state == CLOSED and breaker.json()["errors"] == 2
    clock.now = 1100.0  # long after: everything is gone
    assert breaker.json()["requests"] == 0


def test_outcomes_recorded_while_open_are_dropped() -> None:
    breaker, clock, _ = make_breaker()
    assert breaker.allow()  # a request in flight when the breaker opens
    trip(breaker)
    breaker.record(False, 0.01)
    assert breaker.json()["requests"] == 5
    clock.now += 5
    assert breaker.state == OPEN and breaker.allow()  # still probing after open_s, not re-opened


def test_a_failing_on_change_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def explode(old: str, new: str, why: str) -> None:
        raise RuntimeError("exporter down")

    breaker = CircuitBreaker(BreakerConfig(min_requests=1), FakeClock(), explode)
    send(breaker, ok=False)
    assert breaker.state == OPEN and "on_change" in caplog.text


def test_json_reports_the_window_and_the_config() -> None:
    breaker, clock, _ = make_breaker(slow_rt_ms=100, min_requests=10)
    send(breaker, ok=False, rt_s=0.01)
    send(breaker, ok=True, rt_s=0.5)
    send(breaker, ok=True, rt_s=0.01)
    send(breaker, ok=True, rt_s=0.01)
    status = breaker.json()
    assert status == {"state": "closed", "requests": 4, "errors": 1, "slow": 1, "error_ratio": 0.25,
                      "slow_ratio": 0.25, "opened_at": None, "open_until": None, "probe_out": False,
                      "times_opened": 0, "config": status["config"]}  # fmt: skip
    assert status["config"]["slow_rt_ms"] == 100 and status["config"]["min_requests"] == 10
    trip(breaker)
    assert breaker.json()["opened_at"] == clock.now and breaker.json()["open_until"] == clock.now + 5


@pytest.mark.parametrize(
    ("field", "value"),
    [("slow_rt_ms", 0), ("slow_rt_ms", float("nan")), ("slow_ratio", 1.5), ("error_ratio", -0.1),
     ("min_requests", 0), ("stat_interval_s", 0), ("stat_interval_s", float("inf")), ("open_s", -1), ("buckets", 0)],
)  # fmt: skip
def test_config_refuses_nonsense_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        BreakerConfig(**{field: value})
