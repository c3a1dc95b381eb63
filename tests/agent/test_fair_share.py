"""Weighted fair share between tenants within a priority level (virtual served-work counters), driven directly on the
two scheduler cores with a fake clock: the V2 batch scheduler (rows) and the generative one (tokens of each step).

Tolerances. VTC serves next the backlogged tenant with the smallest counter, and a counter advances by the work served
/ the tenant's weight, so the counters of two tenants that stay backlogged keep within about the largest single
charge of each other: V2, one request's rows / weight (1 row here); generative, one sequence's work (prompt +
max_tokens, at most 16 + 32 = 48 tokens here), since a sequence once admitted decodes for its tenant until it ends
(VTC never preempts it). Over a measured window each tenant's work / weight may then differ by about that: V2, 2 rows
(asserted) in ~160 per unit of weight, the shares within 0.4 % (asserted: 1 %); generative, 48 tokens in ~640 per unit
of weight, the shares within 1.5 % (asserted: 2 %). One FIFO (no tenants) misses them by far, asserted too, so that
these tests can fail.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import pytest

from edge_agent.generation.blocks import BlockManager
from edge_agent.generation.scheduler import GenerationConfig, GenerationScheduler, Rates, Sequence
from edge_agent.scheduling.core import LevelPolicy, Pending, Scheduler, SchedulerConfig, fair_merge
from spillway.contract.tenants import DEFAULT_TENANT

TICK = 0.01  # V2: one batch of up to 8 rows runs in one tick; generative: one step
WEIGHTS = {"heavy": 1.0, "light": 3.0}  # the heavy sender has the smaller weight
LENGTHS = {"heavy": 32, "light": 8}  # generative: max_tokens per tenant

Arrivals = Callable[[int], dict[str, int]]


class Fixed:
    """Compute time of a batch, whatever its size: one tick."""

    def predict(self, batch_size: int) -> float:
        return TICK


class Linear:
    def predict(self, batch_size: int) -> float:
        return 0.002 + 0.001 * batch_size


# ---- V2: rows ------------------------------------------------------------------------------------------------------


class V2Run:
    """The V2 core under a fake clock: each tick, the batch running ends, the tick's requests arrive (each with a
    `timeout`, so admission bounds each queue), and the next batch leaves."""

    def __init__(self, arrivals: Arrivals, ticks: int, *, tenants: bool = True, timeout: float | None = 1.0) -> None:
        self.scheduler = s = Scheduler(SchedulerConfig(max_batch_size=8, levels=(LevelPolicy(),)), Fixed())
        s.set_weights(WEIGHTS)
        self.served: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.waits: defaultdict[str, list[float]] = defaultdict(list)
        self.batches: list[Counter[str]] = []
        running = None
        for tick in range(ticks):
            now = tick * TICK
            if running is not None:
                s.complete(running.id, now)
                running = None
            for name, count in arrivals(tick).items():
                for _ in range(count):
                    request = Pending(rows=1, level=1, arrival=now, payload=name,
                                      deadline=None if timeout is None else now + timeout,
                                      tenant=name if tenants else DEFAULT_TENANT)  # fmt: skip
                    if s.admit(request, now) is not None:
                        self.refused[name] += 1
            for batch in s.step(now).dispatch:
                running = batch
                self.batches.append(Counter(r.payload for r in batch.requests))  # one row each
                for r in batch.requests:
                    self.served[r.payload] += r.rows
                    self.waits[r.payload].append(now - r.arrival)


def share(served: Counter[str], name: str) -> float:
    return served[name] / sum(served.values())


def test_v2_rows_converge_to_the_weights_when_the_heavier_sender_has_the_smaller_weight() -> None:
    # The heavy tenant sends 10x; both send more than their share (light: 7 rows a tick for a share of 6).
    flood = V2Run(lambda tick: {"heavy": 70, "light": 7}, 100)
    measured = sum(flood.batches[20:], Counter())  # past the first queues' build-up
    assert sum(measured.values()) == 80 * 8  # saturated: every batch full
    assert abs(measured["heavy"] / WEIGHTS["heavy"] - measured["light"] / WEIGHTS["light"]) <= 2  # see the top
    assert share(measured, "light") == pytest.approx(0.75, abs=0.01)
    assert flood.refused["light"] == 0  # its predicted wait counts its share, not the heavy queue
    assert flood.refused["heavy"] > 0  # the heavy one's own queue grows until its deadlines cannot be met
    fifo = V2Run(lambda tick: {"heavy": 70, "light": 7}, 100, tenants=False)
    assert share(sum(fifo.batches[20:], Counter()), "light") < 0.2  # one FIFO: the heavy sender takes most


def test_v2_a_quiet_tenants_queueing_delay_does_not_grow_when_another_floods() -> None:
    def quiet(heavy: int) -> Arrivals:
        return lambda tick: {"heavy": heavy, "light": 1 if tick % 5 == 2 else 0}

    calm, flooded = V2Run(quiet(2), 200), V2Run(quiet(40), 200)
    assert flooded.refused["heavy"] > 1000 and flooded.refused["light"] == 0
    assert len(flooded.waits["light"]) == len(calm.waits["light"]) == 40
    assert max(flooded.waits["light"]) <= max(calm.waits["light"]) + TICK  # at most the batch already running
    fifo = V2Run(quiet(40), 200, tenants=False)  # the same flood in one FIFO: behind the whole heavy queue
    assert fifo.refused["light"] > 0 and max(fifo.waits["light"]) > 20 * TICK


def test_v2_a_late_tenant_is_served_at_once_at_its_share_without_banked_credit() -> None:
    run = V2Run(lambda tick: {"heavy": 10, "light": 0 if tick < 100 else 10}, 130, timeout=None)
    assert all(batch == {"heavy": 8} for batch in run.batches[:100])  # alone: all of it
    # From its first tick on, the late tenant gets its 3/4 of every batch, no more: it was idle, it banked nothing
    # (were its counter left at 0, it would take every row until it caught up with 100 batches of the other's).
    assert all(batch == {"heavy": 2, "light": 6} for batch in run.batches[100:])


def test_v2_prediction_counts_a_weighted_share_of_the_other_tenants_queues() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=8, levels=(LevelPolicy(), LevelPolicy())), Linear())
    s.set_weights(WEIGHTS)
    for _ in range(80):
        assert s.admit(Pending(rows=1, level=2, arrival=0.0, deadline=None, tenant="heavy"), 0.0) is None
    p = Linear().predict
    assert s.predict_completion(2, 1, 0.0, "heavy") == pytest.approx(10 * p(8) + p(1))  # its own 80 rows first
    # The light tenant waits for ceil(1 * 1/3) = 1 row of the heavy queue, not 80.
    assert s.predict_completion(2, 1, 0.0, "light") == pytest.approx(p(2))
    for _ in range(9):
        s.admit(Pending(rows=1, level=2, arrival=0.0, deadline=None, tenant="light"), 0.0)
    # Its 9 queued rows, and of the heavy ones (9 + 1) * 1/3, rounded up: 13 rows ahead, then its own.
    assert s.predict_completion(2, 1, 0.0, "light") == pytest.approx(p(8) + p(6))
    # A tenant with nothing queued (weight 1): (0 + 1) * w / 1 of each: 1 heavy row and 3 light ones.
    assert s.predict_completion(2, 1, 0.0, "other") == pytest.approx(p(5))
    s.admit(Pending(rows=4, level=1, arrival=0.0, deadline=None, tenant="heavy"), 0.0)
    assert s.predict_completion(2, 1, 0.0, "light") == pytest.approx(2 * p(8) + p(2))  # a higher level: all of it
    # Admission decides with it: a tight deadline the light tenant can make, the heavy one cannot.
    assert s.admit(Pending(rows=1, level=2, arrival=0.0, deadline=0.05, tenant="light"), 0.0) is None
    late = s.admit(Pending(rows=1, level=2, arrival=0.0, deadline=0.05, tenant="heavy"), 0.0)
    assert late is not None and late.reason == "deadline_unmeetable"
    assert s.tenant_depth() == {"heavy": 81, "light": 10}


def test_v2_one_tenant_is_served_fifo_and_weights_are_checked() -> None:
    s = Scheduler(SchedulerConfig(max_batch_size=4, levels=(LevelPolicy(),)), Fixed())
    s.set_weights({DEFAULT_TENANT: 5.0})
    for i in range(6):
        s.admit(Pending(rows=1, level=1, arrival=0.0, deadline=None, payload=i), 0.0)
    assert [r.payload for r in s.step(0.0).dispatch[0].requests] == [0, 1, 2, 3]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight"):
            s.set_weights({"a": bad})


def test_fair_merge_follows_the_counters_and_breaks_ties_by_age() -> None:
    items = fair_merge([(0.0, 1.0, ["a1", "a2", "a3"]), (0.0, 2.0, ["b1", "b2", "b3", "b4"]), (5.0, 1.0, ["c1"])],
                       cost=lambda _: 1.0, tiebreak=lambda item: int(item[1]))  # fmt: skip
    # a: 0, 1, 2 ...; b: 0, 0.5, 1, 1.5; c: 5. Ties go to the smaller tie-break (the older request).
    assert list(items) == ["a1", "b1", "b2", "a2", "b3", "b4", "a3", "c1"]


def test_v2_delay_and_aging_still_work_with_several_tenants() -> None:
    levels = (LevelPolicy(), LevelPolicy(default_timeout_s=0.1, timeout_action="DELAY"))
    s = Scheduler(SchedulerConfig(max_batch_size=1, levels=levels, aging_s=1.0), Fixed())
    s.admit(Pending(rows=1, level=2, arrival=0.0, deadline=0.1, payload="delayed", tenant="x"), 0.0)
    for i in range(3):
        s.admit(Pending(rows=1, level=2, arrival=0.2, deadline=None, payload=f"y{i}", tenant="y"), 0.2)
    step = s.step(0.2)  # past its deadline: still served (DELAY); y was lifted to x's counter, x's request is older
    assert step.expired == () and [r.payload for r in step.dispatch[0].requests] == ["delayed"]
    s.complete(step.dispatch[0].id, 0.2)
    s.admit(Pending(rows=1, level=1, arrival=0.3, deadline=None, payload="top", tenant="x"), 0.3)
    step = s.step(1.5)  # y0 waited 1.3 s >= aging_s: before level 1
    assert [r.payload for r in step.dispatch[0].requests] == ["y0"]


# ---- generative: tokens --------------------------------------------------------------------------------------------


class GenerationRun:
    """The generative core under a fake clock: each step, the step's requests arrive (prompt 16, `max_tokens` of their
    tenant, a first-token deadline), the plan runs (every decode and prefill token counted for its tenant), then
    advances."""

    def __init__(self, arrivals: Arrivals, steps: int, *, tenants: bool = True, policy: str = "priority",
                 timeout: float = 0.5, max_tokens: dict[str, int] | None = None) -> None:  # fmt: skip
        config = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_threshold=32,
                                  queue_policy=policy)  # type: ignore[arg-type]  # fmt: skip
        self.scheduler = s = GenerationScheduler(config, BlockManager(256, 16), Rates(1600.0, TICK))
        s.set_weights(WEIGHTS)
        self.steps: list[Counter[str]] = []
        self.busy: list[int] = []  # sequences each step ran
        self.refused: Counter[str] = Counter()
        self.ttft: defaultdict[str, list[float]] = defaultdict(list)
        for i in range(steps):
            now = i * TICK
            for name, count in arrivals(i).items():
                for _ in range(count):
                    sequence = Sequence(prompt=16, max_tokens=(max_tokens or {}).get(name, 16), level=2, arrival=now,
                                        deadline=now + timeout,
                                        payload=name, tenant=name if tenants else DEFAULT_TENANT)  # fmt: skip
                    if s.admit(sequence, now, context=512) is not None:
                        self.refused[name] += 1
            plan = s.step(now)
            tokens: Counter[str] = Counter()
            for sequence in plan.decode:
                tokens[sequence.payload] += 1
            for sequence, chunk in plan.prefill:
                tokens[sequence.payload] += chunk
                if sequence.prefilled + chunk == sequence.prompt and sequence.generated == 0:
                    self.ttft[sequence.payload].append(now + TICK - sequence.arrival)
            self.steps.append(tokens)
            self.busy.append(len(plan.decode) + len(plan.prefill))
            s.advance(plan)


@pytest.mark.parametrize("policy", ["priority", "fcfs", "shortest_prompt_first"])
def test_generative_token_shares_converge_to_the_weights_under_saturation(policy: str) -> None:
    # The heavy tenant sends 5x the requests, each generating 4x the tokens: its running sequences' decodes count.
    run = GenerationRun(lambda i: {"heavy": 5, "light": 1}, 200, policy=policy, max_tokens=LENGTHS, timeout=0.3)
    measured = sum(run.steps[60:], Counter())  # once the first sequences admitted have ended
    assert min(run.busy[60:]) == 8  # saturated: every place taken in every step
    assert abs(measured["heavy"] / WEIGHTS["heavy"] - measured["light"] / WEIGHTS["light"]) <= 48  # see the top
    assert share(measured, "light") == pytest.approx(0.75, abs=0.02)
    assert run.refused["light"] < run.refused["heavy"] / 5  # each is refused as its own queue outgrows its deadline
    if policy == "priority":
        fifo = GenerationRun(lambda i: {"heavy": 5, "light": 1}, 200, tenants=False, max_tokens=LENGTHS, timeout=0.3)
        assert share(sum(fifo.steps[60:], Counter()), "light") < 0.25  # one FIFO: the heavy sender takes most


def test_generative_a_quiet_tenant_gets_its_first_token_once_a_place_frees() -> None:
    def quiet(heavy: int) -> Arrivals:
        return lambda i: {"heavy": heavy if i % 2 else 0, "light": 1 if i % 20 == 7 else 0}

    calm, flooded = GenerationRun(quiet(0), 200), GenerationRun(quiet(6), 200)
    assert flooded.refused["heavy"] > 300 and flooded.refused["light"] == 0
    assert len(flooded.ttft["light"]) == len(calm.ttft["light"]) == 10
    # Running sequences are not preempted for it (same level): it waits for the first place to free, at most one
    # sequence's 16 steps, never for the heavy tenant's queue.
    assert max(flooded.ttft["light"]) <= max(calm.ttft["light"]) + 16 * TICK
    fifo = GenerationRun(quiet(6), 200, tenants=False)
    assert fifo.refused["light"] >= 5  # behind the heavy queue: a first token past its deadline


def test_generative_prediction_counts_a_weighted_share_and_a_late_tenant_is_not_starved() -> None:
    run = GenerationRun(lambda i: {"heavy": 3}, 60, timeout=10.0)  # alone for 60 steps: a long queue of its own
    s = run.scheduler
    assert s.tenant_depth()["heavy"] > 100
    heavy, light = s.predict_first_token_s(2, 16, 0.6, "heavy"), s.predict_first_token_s(2, 16, 0.6, "light")
    assert heavy > 10 * light  # the light one waits for a place and ~1/3 of a prompt of the heavy queue
    late = [Sequence(prompt=16, max_tokens=16, level=2, arrival=0.6, payload="light", tenant="light")
            for _ in range(40)]  # fmt: skip
    for sequence in late:
        assert s.admit(sequence, 0.6, context=512) is None
    tokens: Counter[str] = Counter()
    for i in range(60, 160):
        plan = s.step(i * TICK)
        for sequence in plan.decode:
            tokens[sequence.payload] += 1
        for sequence, chunk in plan.prefill:
            tokens[sequence.payload] += chunk
        s.advance(plan)
    # Lifted to the heavy tenant's counter on arrival: about its 3/4 from then on (the heavy sequences running when it
    # came count for the heavy one first), not everything until its counter caught up with 60 steps of the other's.
    assert 0.65 < share(tokens, "light") < 0.8


def test_several_requests_of_one_tenant_expiring_in_one_step_leave_the_scheduler_consistent() -> None:
    """Two (or more) requests of one tenant whose deadlines pass in the same step all expire, once each; the queue is
    empty and idle after, and the next request is served (a bug once left the counts behind and wedged the model)."""
    scheduler = Scheduler(SchedulerConfig(max_batch_size=4, instances=1), Fixed())
    busy = Pending(rows=1, level=1, arrival=0.0, deadline=None, tenant="a")
    assert scheduler.admit(busy, 0.0) is None
    (batch,) = scheduler.step(0.0).dispatch  # the one instance is busy: what comes next waits
    for tenant in ("a", "a", "b", "a"):
        assert scheduler.admit(Pending(rows=1, level=1, arrival=0.0, deadline=1.0, tenant=tenant), 0.0) is None
    step = scheduler.step(2.0)
    assert len(step.expired) == 4 and step.dispatch == ()
    assert scheduler.depth() == [0] and scheduler.tenant_depth() == {}
    scheduler.complete(batch.id, 2.0)
    assert scheduler.idle
    assert scheduler.admit(Pending(rows=1, level=1, arrival=3.0, deadline=None, tenant="a"), 3.0) is None
    assert len(scheduler.step(3.0).dispatch) == 1
