"""The gateway's decisions without a network: backend choice, ejections, readiness, the retry budget, the token
cache and the deadline, all with an injected clock and a seeded random generator."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from controlplane.api.auth import Principal
from controlplane.gateway import (
    BackendPool,
    BackendSpec,
    InvalidRequest,
    NoBackend,
    NoCapacity,
    NoHealthyBackend,
    OutlierPolicy,
    PowerOfTwoChoices,
    ReadinessPolicy,
    RetryBudget,
    TokenCache,
    infer_target,
    make_picker,
)
from controlplane.gateway.deadline import deadline_us, header_length, timeout_header_us, timeout_parameter_us


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec(ident: str, *, models: tuple[str, ...] = ("mlp",), weight: float = 1.0, cap: int = 64) -> BackendSpec:
    return BackendSpec(ident, f"b-{ident}", f"http://{ident}.example", models, weight=weight, max_concurrency=cap)


def make_pool(*specs: BackendSpec, seed: int = 7, **outlier: float) -> tuple[BackendPool, Clock]:
    clock = Clock()
    pool = BackendPool(OutlierPolicy(**outlier), ReadinessPolicy(), clock=clock, rng=random.Random(seed))  # type: ignore[arg-type]
    pool.replace(specs)
    return pool, clock


def fail(pool: BackendPool, ident: str, times: int, kind: str = "status_5xx") -> None:
    state = pool.states[ident]
    for _ in range(times):
        state.outstanding += 1  # as if acquired
        pool.release(state, failure=kind, error=f"injected {kind}")


# ---- choice ----------------------------------------------------------------------------------------


def test_power_of_two_prefers_the_backend_with_fewer_requests_in_flight() -> None:
    pool, _ = make_pool(spec("a"), spec("b"))
    pool.states["a"].outstanding = 30
    chosen = Counter(pool.acquire("mlp").id for _ in range(20))
    assert chosen == {"b": 20}  # b has fewer in flight than a all along (20 < 30)
    more = Counter(pool.acquire("mlp").id for _ in range(20))  # now they even out: b 40, a 30 -> 35 each
    assert pool.states["a"].outstanding - pool.states["b"].outstanding in (-1, 0, 1), more


def test_power_of_two_compares_load_per_unit_of_weight() -> None:
    pool, _ = make_pool(spec("a", weight=4), spec("b", weight=1))
    pool.states["a"].outstanding, pool.states["b"].outstanding = 6, 2  # a: 1.5 per weight, b: 2
    assert pool.acquire("mlp").id == "a"


def test_weights_share_the_traffic_when_load_is_equal() -> None:
    pool, _ = make_pool(spec("a", weight=3), spec("b", weight=1), spec("c", weight=1), seed=11)
    picked: Counter[str] = Counter()
    for _ in range(5000):
        state = pool.acquire("mlp")
        picked[state.id] += 1
        pool.release(state)  # nothing stays in flight: only the weights decide (ties go to the first drawn)
    share = picked["a"] / 5000
    # P(a drawn first) = 3/5; a wins every tie, so its share is 3/5 (+- 3 sigma of 5000 draws: 0.021)
    assert 0.58 <= share <= 0.62, picked
    assert abs(picked["b"] - picked["c"]) < 250, picked


def test_weighted_random_picker_follows_the_weights() -> None:
    picker = make_picker("random")
    rng = random.Random(3)
    pool, _ = make_pool(spec("a", weight=1), spec("b", weight=9))
    states = list(pool.states.values())
    picks = Counter(states[picker.pick(states, rng)].id for _ in range(4000))
    assert 0.88 <= picks["b"] / 4000 <= 0.92
    assert isinstance(make_picker("p2c"), PowerOfTwoChoices)
    with pytest.raises(ValueError, match="unknown backend picker 'fastest'"):
        make_picker("fastest")


def test_a_backend_at_its_cap_is_skipped_and_all_at_cap_is_no_capacity() -> None:
    pool, _ = make_pool(spec("a", cap=1), spec("b", cap=2))
    taken = [pool.acquire("mlp").id for _ in range(3)]
    assert sorted(taken) == ["a", "b", "b"]
    with pytest.raises(NoCapacity, match="max_concurrency"):
        pool.acquire("mlp")
    pool.release(pool.states["a"])
    assert pool.acquire("mlp").id == "a"


def test_unknown_model_unhealthy_and_excluded_backends() -> None:
    pool, _ = make_pool(spec("a"), spec("b", models=("mlp", "resnet")))
    with pytest.raises(NoBackend, match="'bert'"):
        pool.acquire("bert")
    assert pool.acquire("mlp", exclude={"a"}).id == "b"
    pool.checked("b", {"mlp": False, "resnet": True})  # its first check fails: unhealthy at once
    assert pool.acquire("resnet").id == "b"  # still serves the model that passed
    with pytest.raises(NoHealthyBackend):
        pool.acquire("mlp", exclude={"a"})


# ---- passive outlier detection -----------------------------------------------------------------------


def test_five_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    pool, clock = make_pool(*(spec(c) for c in "abcdefghij"))  # 10 backends: 10 % is one
    fail(pool, "a", 4)
    state = pool.states["a"]
    state.outstanding += 1
    pool.release(state)  # an answer that is not a 5xx
    fail(pool, "a", 4)
    assert not state.ejected(clock.now)
    fail(pool, "a", 1, kind="timeout")
    assert state.ejected(clock.now) and state.ejected_until == clock.now + 30
    [event] = pool.drain()
    assert event.kind == "backend.ejected" and event.backend == "b-a"
    assert event.data["consecutive_failures"] == 5 and event.data["ejection_s"] == 30
    assert event.data["last_error"] == "injected timeout"
    assert all(pool.acquire("mlp").id != "a" for _ in range(50))


def test_ejection_time_grows_with_each_ejection_up_to_the_cap_and_decays() -> None:
    pool, clock = make_pool(spec("a"), spec("b"), base_ejection_s=30, max_ejection_s=300, interval_s=10)
    state = pool.states["a"]
    lengths = []
    for _ in range(12):
        fail(pool, "a", 5)
        assert state.ejected_until is not None
        lengths.append(state.ejected_until - clock.now)
        clock.now = state.ejected_until  # back at once, fails again at once: no time to decay
        pool.sweep()
    assert lengths == [30, 60, 90, 120, 150, 180, 210, 240, 270, 300, 300, 300]
    kinds = Counter(t.kind for t in pool.drain())
    assert kinds == {"backend.ejected": 12, "backend.returned": 12}
    # Back in the pool: each 10 s (the outlier interval) in takes one off the multiplier (12 now).
    clock.now += 3 * 10 + 1
    pool.sweep()
    assert state.times_ejected == 9
    fail(pool, "a", 5)
    assert state.ejected_until == clock.now + 300  # 10 x 30 s, capped at 300 s
    clock.now = state.ejected_until
    pool.sweep()
    clock.now += 5 * 10
    pool.sweep()
    assert state.times_ejected == 5
    clock.now += 100 * 10
    pool.sweep()
    assert state.times_ejected == 0
    fail(pool, "a", 5)
    assert state.ejected_until == clock.now + 30  # a fresh start


def test_returned_event_when_the_ejection_is_over() -> None:
    pool, clock = make_pool(spec("a"), spec("b"))
    fail(pool, "a", 5)
    pool.drain()
    clock.now += 29.9
    pool.sweep()
    assert pool.drain() == []
    clock.now += 0.2
    assert pool.acquire("mlp", exclude={"b"}).id == "a"  # noticed lazily by a request, before any sweep
    [event] = pool.drain()
    assert event.kind == "backend.returned" and event.data == {"ejected_for_s": 30.0, "times_ejected": 1}


def test_max_ejection_percent_allows_one_and_then_holds_back() -> None:
    pool, clock = make_pool(spec("a"), spec("b"), spec("c"), max_ejection_percent=10)
    fail(pool, "a", 5)
    assert pool.states["a"].ejected(clock.now)  # 1 of 3 is 33 % > 10 %, but one may always go
    fail(pool, "b", 7)
    assert not pool.states["b"].ejected(clock.now)  # a second would be too many
    assert pool.acquire("mlp", exclude={"c"}).id == "b"
    clock.now += 31  # a is back: the next failure of b (already past the threshold) ejects it
    pool.sweep()
    fail(pool, "b", 1)
    assert pool.states["b"].ejected(clock.now)


def test_max_ejection_percent_counts_per_model() -> None:
    # Twenty backends serve mlp: 10 % is two. Only b and c serve resnet: one of them at most.
    specs = [spec("a", models=("mlp",))] + [spec(f"m{i}") for i in range(17)]
    specs += [spec("b", models=("mlp", "resnet")), spec("c", models=("mlp", "resnet"))]
    pool, clock = make_pool(*specs, max_ejection_percent=10)
    fail(pool, "b", 5)
    fail(pool, "c", 5)
    assert pool.states["b"].ejected(clock.now) and not pool.states["c"].ejected(clock.now)
    fail(pool, "a", 5)
    assert pool.states["a"].ejected(clock.now)  # 2 of the 20 mlp backends: 10 %, allowed


def test_max_ejection_percent_of_100_ejects_all() -> None:
    pool, _ = make_pool(spec("a"), spec("b"), max_ejection_percent=100)
    fail(pool, "a", 5)
    fail(pool, "b", 5)
    with pytest.raises(NoHealthyBackend):
        pool.acquire("mlp")


def test_state_survives_a_reload_for_the_same_id() -> None:
    pool, clock = make_pool(spec("a"), spec("b"))
    fail(pool, "a", 5)
    pool.states["b"].outstanding = 3
    removed = pool.replace([spec("a", weight=2), spec("c")])
    assert [s.id for s in removed] == ["b"]
    assert pool.states["a"].ejected(clock.now) and pool.states["a"].weight == 2
    assert pool.states["c"].outstanding == 0
    # A request in flight at a deleted backend finishes without touching the pool.
    pool.release(removed[0], failure="reset")
    assert removed[0].outstanding == 2 and "b" not in pool.states


def openai_spec(ident: str, models: tuple[str, ...] = ("mlp",), **model_map: str) -> BackendSpec:
    return BackendSpec(ident, f"b-{ident}", f"http://{ident}.example", models, protocol="openai",
                       model_map=model_map)  # fmt: skip


def test_each_protocol_has_its_own_backends_and_its_own_ejection_share() -> None:
    pool, clock = make_pool(spec("v"), openai_spec("o1"), openai_spec("o2"), max_ejection_percent=10)
    assert {pool.acquire("mlp", protocol="openai").id for _ in range(20)} == {"o1", "o2"}
    assert {pool.acquire("mlp").id for _ in range(5)} == {"v"}  # V2 requests never reach an openai backend
    with pytest.raises(NoBackend, match="no openai backend is registered for model 'bert'"):
        pool.acquire("bert", protocol="openai")
    assert pool.knows("mlp", "openai") and not pool.knows("bert", "openai")
    # The one V2 backend may go (one always may); of the two openai ones, one, never both.
    fail(pool, "v", 5)
    fail(pool, "o1", 5)
    fail(pool, "o2", 5)
    assert pool.states["v"].ejected(clock.now) and pool.states["o1"].ejected(clock.now)
    assert not pool.states["o2"].ejected(clock.now)
    row = next(r for r in pool.snapshot() if r["id"] == "o1")
    assert (row["protocol"], row["model_map"]) == ("openai", {})


def test_what_readiness_learnt_is_void_when_the_names_on_the_server_change() -> None:
    pool, _ = make_pool(openai_spec("o", ("lm",), lm="cloud-lm"))
    pool.checked("o", {"lm": False})
    assert pool.states["o"].unhealthy == {"lm"}
    pool.replace([openai_spec("o", ("lm",), lm="cloud-lm")])
    assert pool.states["o"].unhealthy == {"lm"}  # the same: kept
    pool.replace([openai_spec("o", ("lm",), lm="other-lm")])
    assert pool.states["o"].unhealthy == set()  # another name to look for: healthy until checked
    assert openai_spec("o", ("lm",), lm="x").cloud_model("lm") == "x" and spec("v").cloud_model("mlp") == "mlp"


# ---- active readiness checks ------------------------------------------------------------------------


def test_readiness_two_failures_unhealthy_one_success_healthy() -> None:
    pool, _ = make_pool(spec("a", models=("mlp", "resnet")), spec("b"))
    pool.checked("a", {"mlp": True, "resnet": True})
    pool.checked("a", {"mlp": False, "resnet": True}, "GET /v2/models/mlp/ready answered 503")
    assert pool.states["a"].unhealthy == set() and pool.drain() == []
    pool.checked("a", {"mlp": False, "resnet": True}, "GET /v2/models/mlp/ready answered 503")
    assert pool.states["a"].unhealthy == {"mlp"}
    [event] = pool.drain()
    assert event.kind == "backend.unhealthy"
    assert event.data == {"models": ["mlp"], "failures": 2, "error": "GET /v2/models/mlp/ready answered 503"}
    assert all(pool.acquire("mlp").id == "b" for _ in range(20))
    pool.checked("a", {"mlp": True, "resnet": True})
    assert pool.states["a"].unhealthy == set()
    assert [e.kind for e in pool.drain()] == ["backend.healthy"]


def test_a_new_backend_is_healthy_until_its_first_check_fails() -> None:
    pool, _ = make_pool(spec("a"))
    assert pool.acquire("mlp").id == "a"  # never checked yet: healthy
    pool.checked("a", {"mlp": False}, "GET /v2/health/ready: ClientConnectorError")
    assert pool.states["a"].unhealthy == {"mlp"}
    assert pool.drain()[0].reason == "its first readiness check failed"


def test_custom_readiness_thresholds() -> None:
    clock = Clock()
    pool = BackendPool(readiness=ReadinessPolicy(unhealthy_threshold=3, healthy_threshold=2), clock=clock)
    pool.replace([spec("a")])
    pool.checked("a", {"mlp": True})
    for expected in (False, False, True):
        pool.checked("a", {"mlp": False})
        assert ("mlp" in pool.states["a"].unhealthy) is expected
    pool.checked("a", {"mlp": True})
    assert "mlp" in pool.states["a"].unhealthy
    pool.checked("a", {"mlp": True})
    assert "mlp" not in pool.states["a"].unhealthy


# ---- retry budget ------------------------------------------------------------------------------------


def test_retry_budget_is_a_share_of_requests_in_flight_with_a_floor() -> None:
    budget = RetryBudget(budget_percent=20, min_retry_concurrency=3)
    budget.active_requests = 10  # 20 % is 2: the floor of 3 wins
    assert [budget.try_retry() for _ in range(4)] == [True, True, True, False]
    budget.active_requests = 40  # 20 % is 8
    assert sum(budget.try_retry() for _ in range(10)) == 5  # 3 already in flight, 5 more
    budget.retry_done()
    assert budget.active_retries == 7 and budget.try_retry()
    assert RetryBudget(0, 0).try_retry() is False


# ---- credentials, deadline, paths --------------------------------------------------------------------


def test_token_cache_forgets_after_its_ttl() -> None:
    clock = Clock()
    cache = TokenCache(30, clock=clock, max_entries=4)
    agent = Principal("agent", "a1", "edge-1")
    cache.put(b"k", agent)
    clock.now += 29.9
    assert cache.get(b"k") == agent
    clock.now += 0.2
    assert cache.get(b"k") is None
    for i in range(10):  # bounded: never more than max_entries
        cache.put(bytes([i]), agent)
    assert len(cache._entries) <= 4
    off = TokenCache(0, clock=clock)
    off.put(b"k", agent)
    assert off.get(b"k") is None


def test_deadline_is_the_tighter_of_header_and_parameter() -> None:
    parameter = timeout_parameter_us(b'{"parameters":{"timeout":100000}}')
    assert deadline_us(timeout_header_us(b"250000"), parameter) == 100000
    assert deadline_us(timeout_header_us(b"50000"), timeout_parameter_us(b'{"inputs":[]}')) == 50000
    assert deadline_us(None, timeout_parameter_us(b'{"parameters":{"timeout":0}}')) is None  # Triton: 0 is none
    for raw, named in ((b"{", "not valid JSON"), (b"[]", "must be an object"), (b'{"parameters":1}', "'parameters'"),
                       (b'{"parameters":{"timeout":-1}}', "'timeout'"),
                       (b'{"parameters":{"timeout":"soon"}}', "'timeout'")):  # fmt: skip
        with pytest.raises(InvalidRequest, match=named):
            timeout_parameter_us(raw)
    with pytest.raises(InvalidRequest, match="spillway-timeout-us"):
        timeout_header_us(b"-5")
    with pytest.raises(InvalidRequest, match="inference-header-content-length"):
        header_length(b"99", 10)
    assert header_length(b"10", 10) == 10 and header_length(None, 10) is None


def test_infer_paths() -> None:
    assert infer_target("/v2/models/mlp/infer") == ("mlp", None)
    assert infer_target("/v2/models/mlp/versions/2/infer") == ("mlp", "2")
    for path in ("/v2/models/infer", "/v2/models//infer", "/v2/models/a/b/infer", "/v2/models/mlp/ready",
                 "/v2/models/mlp/versions//infer", "/api/v1/v2/models/mlp/infer", "/v2/models/x/infer/x"):  # fmt: skip
        assert infer_target(path) is None, path


def test_settings_refuse_nonsense_naming_the_variable() -> None:
    from pydantic import ValidationError

    from controlplane.gateway import GatewayConfig
    from controlplane.settings import Settings

    with pytest.raises(ValidationError, match="SPILLWAY_GATEWAY_MAX_EJECTION_S must be at least"):
        Settings(gateway_base_ejection_s=60, gateway_max_ejection_s=30)
    for field, value in (("gateway_max_ejection_percent", 101), ("gateway_health_interval_s", 0),
                         ("gateway_consecutive_failures", 0), ("gateway_retry_budget_percent", -1)):  # fmt: skip
        with pytest.raises(ValidationError, match=field):
            Settings(**{field: value})  # type: ignore[arg-type]
    config = GatewayConfig.from_settings(Settings(gateway_base_ejection_s=1, gateway_outlier_interval_s=2))
    assert config.outlier.base_ejection_s == 1 and config.outlier.interval_s == 2
    assert config.outlier.consecutive_failures == 5 and config.readiness.unhealthy_threshold == 2
