"""The scheduler's decisions as a plain synchronous class: admission, priority queues and dynamic batching.

Nothing here sleeps, awaits or reads a clock: every method takes `now` (seconds, monotonic), so tests drive
it with an injected clock and the asyncio shell (`worker.py`) only moves requests in and results out.

A batch is the queued requests in priority order (FIFO within a level), whole and of one shape, up to the
max batch size. It leaves (first that holds):
  1. closed: it reached the max batch size, or the next queued request cannot join it (too big, other shape);
  2. a prefix of it is exactly a preferred batch size: that prefix leaves at once (Triton's rule);
  3. the tightest deadline in it has no slack left (deadline - now - predicted compute time <= 0);
  4. the batch window (max queue delay, from the oldest request in it) has ended;
  5. waiting is not expected to grow it: the arrivals measured while earlier batches waited, over what is
     left of the window, come to less than one request, or the current burst went quiet.
In cases 3-5 everything pending leaves. While every instance is busy nothing leaves; the queue itself is
then where the next batch forms, so under load batches are as large as the queue allows.

Within a level, the tenants that have requests queued there share it by weight, with virtual served-work counters
(VTC, Sheng et al. 2024): each tenant has a counter per level; a batch taken adds each request's rows / its tenant's
weight to its tenant's counter; the batch is filled from the tenant with the smallest counter (as the batch's rows
advance it), FIFO within a tenant. A tenant whose queue at a level was empty is lifted to the smallest counter of the
tenants queued there, so idle time is never banked as credit (and a level with nobody queued forgets its counters).
Over a busy period each backlogged tenant gets rows in proportion to its weight, however much more another sends.
When every request is one tenant's the order is FIFO, as before. Aged requests (`aging_s`) go before every level,
shared between their tenants the same way. Admission's prediction counts, at the request's level, its own tenant's
queued rows and, of each other tenant queued there, no more than its weighted share of as many.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, TypeVar

from spillway.contract.spec import DynamicBatching
from spillway.contract.tenants import DEFAULT_TENANT

T = TypeVar("T")


class Predictor(Protocol):
    """Predicted compute seconds for a batch of `rows` rows (a warm-up profile refined online)."""

    def predict(self, batch_size: int) -> float: ...


@dataclass(frozen=True)
class LevelPolicy:
    """One priority level's queue policy (Triton's ModelQueuePolicy)."""

    max_queue_size: int = 0  # requests; 0: bounded only by the scheduler's overall cap
    default_timeout_s: float = 0.0  # 0: no deadline unless the request brings one
    allow_timeout_override: bool = True
    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"

    def deadline(self, now: float, timeout_s: float | None) -> float | None:
        """A request's deadline from its `timeout` and this level's default (an override may only shorten it)."""
        default = self.default_timeout_s or None
        chosen: float | None
        if timeout_s is not None and timeout_s > 0 and self.allow_timeout_override:
            chosen = timeout_s if default is None else min(timeout_s, default)
        else:
            chosen = default
        return None if chosen is None else now + chosen


def level_policies(batching: DynamicBatching) -> tuple[LevelPolicy, ...]:
    """Triton's per-level queue policies (`priority_queue_policy`, else `default_queue_policy`), one per level."""
    return tuple(
        LevelPolicy(max_queue_size=policy.max_queue_size, default_timeout_s=policy.default_timeout_us / 1e6,
                    allow_timeout_override=policy.allow_timeout_override, timeout_action=policy.timeout_action)
        for level in range(1, max(1, batching.priority_levels) + 1)
        for policy in [batching.priority_queue_policy.get(level, batching.default_queue_policy)]
    )  # fmt: skip


def resolve_level(priority: int, levels: int, default_level: int) -> int:
    """Triton's meaning: 1..N are levels; 0, and anything above N, mean the model's default level."""
    if priority < 0:
        raise ValueError(f"priority must be >= 0, got {priority}")
    return default_level if priority == 0 or priority > levels else priority


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 1  # rows; 1 (or a model without batching) means one request per batch
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    levels: tuple[LevelPolicy, ...] = (LevelPolicy(),)  # index 0 is priority level 1, the highest
    default_level: int = 1
    instances: int = 1
    max_queued_requests: int = 4096  # overall cap, so that memory stays bounded whatever the config says
    aging_s: float | None = None  # a request waiting this long is served as if at the highest level
    merge: bool = True  # False: one request per batch (a model without dynamic batching, as in Triton)
    wait_gain_alpha: float = 0.2  # EWMA weight of the arrival rate measured while waiting
    probe_every: int = 200  # re-measure the arrival rate with one wait after this many dispatches without
    # An idle model whose compute estimate has met no real batch for this long admits the next request it would
    # refuse `deadline_unmeetable`, to check the estimate: one that only refuses is never corrected (0: never).
    recheck_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if not 1 <= self.default_level <= len(self.levels):
            raise ValueError(f"default_level must be within 1..{len(self.levels)}")
        if self.instances < 1:
            raise ValueError("instances must be >= 1")
        if self.recheck_after_s < 0:
            raise ValueError("recheck_after_s must be >= 0")


@dataclass(eq=False)
class Pending:
    """A request the scheduler holds: its rows, its level and deadline, and an opaque payload for the shell."""

    rows: int
    level: int
    arrival: float
    deadline: float | None
    payload: Any = None
    seq: int = 0
    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    shape: Hashable = None  # only requests of equal shape (beyond the batch dimension) share a batch
    tenant: str = DEFAULT_TENANT  # whose request it is: tenants share a level by weight


@dataclass(frozen=True)
class Rejection:
    reason: Literal["queue_full", "deadline_unmeetable", "draining", "timeout"]
    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Batch:
    id: int
    requests: tuple[Pending, ...]
    rows: int
    started: float
    predicted_s: float


@dataclass(frozen=True)
class Step:
    """What to do now: batches to run, requests whose deadline passed in the queue, and when to look again."""

    dispatch: tuple[Batch, ...] = ()
    expired: tuple[Pending, ...] = ()
    wake_at: float | None = None


def check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Tenants' weights as the schedulers keep them (a tenant left out has weight 1); ValueError for one that is not
    a finite number > 0."""
    checked: dict[str, float] = {}
    for tenant, weight in weights.items():
        value = float(weight)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"tenant {tenant!r}: weight must be a finite number > 0, got {weight!r}")
        checked[tenant] = value
    return checked


def fair_merge(
    streams: Iterable[tuple[float, float, Iterable[T]]], cost: Callable[[T], float], tiebreak: Callable[[T], float]
) -> Iterator[T]:
    """The items of several streams (one per tenant: its served-work counter, its weight, its items in its own
    order) in virtual served-work order: next, the head of the stream with the smallest counter (ties: the smaller
    `tiebreak`), whose counter then advances by cost / weight. Lazy: taking k items costs O(k log streams)."""
    heap: list[tuple[float, float, int, T, Iterator[T], float]] = []
    for i, (counter, weight, items) in enumerate(streams):
        rest = iter(items)
        for head in rest:
            heap.append((counter, tiebreak(head), i, head, rest, weight))
            break
    heapq.heapify(heap)
    while heap:
        counter, _, i, head, rest, weight = heap[0]
        yield head
        for following in rest:
            heapq.heapreplace(heap, (counter + cost(head) / weight, tiebreak(following), i, following, rest, weight))
            break
        else:
            heapq.heappop(heap)


class _Queue(deque[Pending]):
    """One tenant's queued requests at one level, FIFO, and their rows."""

    rows = 0


@dataclass
class _Level:
    policy: LevelPolicy
    # The queued requests per tenant; a tenant is here only while it has some (the backlogged ones).
    queues: dict[str, _Queue] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)  # the tenants' virtual served-work counters
    rows: int = 0
    count: int = 0

    def push(self, request: Pending) -> None:
        """Queue a request at the end of its tenant's queue."""
        queue = self.queues.get(request.tenant)
        if queue is None:
            queue = self._backlogged(request.tenant)
        queue.append(request)
        queue.rows += request.rows
        self.rows += request.rows
        self.count += 1

    def _backlogged(self, tenant: str) -> _Queue:
        """A tenant with nothing queued here gets a queue, its counter lifted to the smallest of those queued here
        (none: the level forgets its counters): idle time is never banked as credit."""
        served = self.served
        if self.queues:
            floor = min(served[t] for t in self.queues)
            served[tenant] = max(served.get(tenant, 0.0), floor)
        else:
            if served:
                served.clear()
            served[tenant] = 0.0
        queue = self.queues[tenant] = _Queue()
        return queue

    def forget(self, request: Pending, queue: _Queue) -> None:
        """Count a request out that left its tenant's `queue`."""
        queue.rows -= request.rows
        self.rows -= request.rows
        self.count -= 1
        if not queue:
            del self.queues[request.tenant]


class Scheduler:
    """Priority queues + deadline-aware admission + dynamic batching for one model version."""

    def __init__(self, config: SchedulerConfig, predictor: Predictor) -> None:
        self.config = config
        self.base_config = config  # as the model's configuration says; `retune` changes `config` relative to it
        self.predictor = predictor
        self._levels = [_Level(p) for p in config.levels]
        self._weights: dict[str, float] = {}  # a tenant not in it has weight 1
        self._queued = 0
        self._seq = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._running: dict[int, Batch] = {}
        self._draining = False
        self._preferred = frozenset(p for p in config.preferred_batch_sizes if p <= config.max_batch_size)
        # Arrival rate (requests/s) observed while a batch waited for more; starts optimistic.
        self._wait_rate: float | None = None
        self._waiting_since: float | None = None
        self._waiting_seen = 0
        self._last_arrival = 0.0
        self._since_probe = 0
        self._checked_at: float | None = None  # when the estimate last met a real batch (or a check was let in)

    # ---- admission ---------------------------------------------------------------------------

    def resolve_level(self, priority: int) -> int:
        return resolve_level(priority, len(self._levels), self.config.default_level)

    def deadline_for(self, level: int, now: float, timeout_s: float | None) -> float | None:
        """The request's deadline from its `timeout` and its level's policy (override only to shorten)."""
        return self._levels[level - 1].policy.deadline(now, timeout_s)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights from now on (a tenant left out has weight 1): the next batches share by them."""
        self._weights = check_weights(weights)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def predict_completion(self, level: int, rows: int, now: float, tenant: str = DEFAULT_TENANT) -> float:
        """Seconds from now until a new request of `tenant` at `level` would be answered, with what is queued and
        running: every row of the higher levels, and at its own level its tenant's queued rows and, of each other
        tenant queued there, at most its weighted share of as many (own queued + this) * w_other / w_own."""
        queues = self._levels[level - 1].queues
        if len(queues) < 2 and (tenant in queues or not queues):  # none queued, or only its tenant: FIFO
            ahead = sum(lv.rows for lv in self._levels[:level])
        else:
            ahead = sum(lv.rows for lv in self._levels[: level - 1]) + self._share_ahead(level, tenant, rows)
        busy = sorted(max(0.0, b.started + b.predicted_s - now) for b in self._running.values())
        free_at = 0.0 if len(busy) < self.config.instances else busy[0]
        size = self.config.max_batch_size
        full_batches, rest = divmod(ahead + rows, size)
        if rest == 0:
            full_batches, rest = full_batches - 1, size
        per_instance = full_batches / self.config.instances
        return free_at + per_instance * self.predictor.predict(size) + self.predictor.predict(rest)

    def admit(self, request: Pending, now: float) -> Rejection | None:
        """Queue the request, or say at once why not: draining, queue full, or a deadline it cannot meet."""
        if self._draining:
            return Rejection("draining", "the agent is shutting down", 1.0)
        if not 1 <= request.rows <= self.config.max_batch_size:
            raise ValueError(f"a request of {request.rows} rows does not fit a batch of {self.config.max_batch_size}")
        level = self._levels[request.level - 1]
        full_level = 0 < level.policy.max_queue_size <= level.count
        if full_level or self._queued >= self.config.max_queued_requests:
            return Rejection("queue_full", f"priority {request.level} queue is full",
                             self._retry_after(request.level, now, request.tenant))  # fmt: skip
        if request.deadline is not None and level.policy.timeout_action == "REJECT":
            predicted = self.predict_completion(request.level, request.rows, now, request.tenant)
            if now + predicted > request.deadline and not self._recheck(now):
                budget_ms = (request.deadline - now) * 1e3
                return Rejection(
                    "deadline_unmeetable",
                    f"predicted completion in {predicted * 1e3:.1f} ms exceeds the {budget_ms:.1f} ms deadline",
                    self._retry_after(request.level, now, request.tenant),
                )
        request.seq = next(self._seq)
        request.timeout_action = level.policy.timeout_action
        level.push(request)
        self._queued += 1
        if self._waiting_since is not None:
            self._waiting_seen += 1
            self._last_arrival = now
        return None

    def _recheck(self, now: float) -> bool:
        """Let one request through to check the estimate when the model is idle and its estimate is stale.

        The estimate is refined only by batches that run; a warm-up taken on a busy machine, or a slow spell
        that has passed, would otherwise refuse every request for ever, since nothing refused is measured. When
        idle, nobody waits behind the check: at worst one answer is late."""
        if self.config.recheck_after_s <= 0 or not self.idle:
            return False
        if self._checked_at is not None and now - self._checked_at < self.config.recheck_after_s:
            return False
        self._checked_at = now
        return True

    @property
    def utilisation(self) -> float:
        """Running batches plus queued requests counted in full batches, per instance (0: idle; 1: every instance
        busy and nothing waiting, or the equivalent)."""
        queued_batches = self._queued / self.config.max_batch_size
        return (len(self._running) + queued_batches) / self.config.instances

    def _retry_after(self, level: int, now: float, tenant: str) -> float:
        return max(1.0, math.ceil(self.predict_completion(level, 0, now, tenant)))

    def _share_ahead(self, at: int, tenant: str, rows: int) -> int:
        """Rows queued at level `at` that a new request of `tenant` (of `rows` rows) would wait for: its tenant's and,
        of each other tenant's, at most its weighted share of as many."""
        level = self._levels[at - 1]
        own = level.queues[tenant].rows if tenant in level.queues else 0
        share = (own + rows) / self.weight(tenant)
        others = sum(min(q.rows, share * self.weight(t)) for t, q in level.queues.items() if t != tenant)
        return own + math.ceil(others - 1e-9)

    # ---- batching ----------------------------------------------------------------------------

    def step(self, now: float) -> Step:
        """Decide what leaves the queues now."""
        expired = self._expire(now)
        dispatch: list[Batch] = []
        wake_at: float | None = None
        while len(self._running) < self.config.instances and self._queued:
            chosen, rows, closed = self._candidate(now)
            send, wake = self._ready(chosen, rows, closed, now)
            if send is None:
                wake_at = wake
                break
            dispatch.append(self._take(send, sum(r.rows for r in send), now))
        deadlines = [r.deadline for lv in self._levels for q in lv.queues.values() for r in q if r.deadline is not None]
        if deadlines:
            first = min(deadlines)
            wake_at = first if wake_at is None else min(wake_at, first)
        return Step(tuple(dispatch), tuple(expired), wake_at)

    def complete(self, batch_id: int, now: float) -> Batch:
        """A batch finished (well or not): its instance is free again, and its compute time was measured."""
        self._checked_at = now
        return self._running.pop(batch_id)

    def _expire(self, now: float) -> list[Pending]:
        expired: list[Pending] = []
        for level in self._levels:
            for queue in level.queues.values():
                if any(r.deadline is not None and r.deadline <= now for r in queue):
                    break
            else:
                continue  # nothing expired at this level (the usual case)
            for tenant, queue in list(level.queues.items()):
                if not any(r.deadline is not None and r.deadline <= now for r in queue):
                    continue
                keep = _Queue()
                delayed: list[Pending] = []
                gone: list[Pending] = []
                for req in queue:
                    if req.deadline is None or req.deadline > now:
                        keep.append(req)
                    elif req.timeout_action == "DELAY":
                        req.deadline = None  # Triton's DELAY: still served, after its tenant's live requests
                        delayed.append(req)
                    else:
                        gone.append(req)
                keep.extend(delayed)
                gone_rows = sum(r.rows for r in gone)
                keep.rows = queue.rows - gone_rows
                level.rows -= gone_rows
                level.count -= len(gone)
                if keep:
                    level.queues[tenant] = keep
                else:  # every request of this tenant at this level expired at once
                    del level.queues[tenant]
                self._queued -= len(gone)
                expired += gone
        return expired

    def _candidate(self, now: float) -> tuple[list[Pending], int, bool]:
        """Highest levels first, fair share between tenants within a level (FIFO within a tenant), whole requests of
        one shape, up to max batch rows.

        The flag says the batch is closed: the next queued request cannot join it, so waiting cannot grow it.
        """
        order: Iterable[Pending]
        if any(len(lv.queues) > 1 for lv in self._levels):
            order = itertools.chain.from_iterable(map(self._level_order, self._levels))
        else:  # one tenant queued per level (the usual case): FIFO
            order = (r for lv in self._levels for q in lv.queues.values() for r in q)
        aging = self.config.aging_s
        if aging is not None:
            aged = [r for lv in self._levels[1:] for q in lv.queues.values() for r in q if now - r.arrival >= aging]
            if aged:
                aged_ids = set(map(id, aged))
                order = itertools.chain(self._aged_order(aged), (r for r in order if id(r) not in aged_ids))
        chosen: list[Pending] = []
        rows = 0
        for req in order:
            if chosen and (rows + req.rows > self.config.max_batch_size or req.shape != chosen[0].shape):
                return chosen, rows, True  # as in Triton: the batch ends where the next request does not fit it
            chosen.append(req)
            rows += req.rows
            if rows == self.config.max_batch_size or not self.config.merge:
                return chosen, rows, True
        return chosen, rows, False

    def _level_order(self, level: _Level) -> Iterable[Pending]:
        """A level's requests in the order they are served: FIFO when one tenant is queued, else fair share."""
        if len(level.queues) < 2:
            return next(iter(level.queues.values()), ())
        streams = [(level.served[t], self.weight(t), queue) for t, queue in level.queues.items()]
        return fair_merge(streams, _rows, _seq)

    def _aged_order(self, aged: list[Pending]) -> Iterable[Pending]:
        """Aged requests (of any level but the first), oldest first, shared fairly when several tenants have some
        (each from its counter at the level of its oldest aged request)."""
        aged = sorted(aged, key=_seq)
        tenants: dict[str, list[Pending]] = {}
        for req in aged:
            tenants.setdefault(req.tenant, []).append(req)
        if len(tenants) == 1:
            return aged
        streams = [(self._levels[reqs[0].level - 1].served.get(t, 0.0), self.weight(t), reqs)
                   for t, reqs in tenants.items()]  # fmt: skip
        return fair_merge(streams, _rows, _seq)

    def _preferred_prefix(self, chosen: list[Pending]) -> int:
        """How many requests make the largest prefix whose rows are exactly a preferred batch size (0: none)."""
        best = total = 0
        for count, req in enumerate(chosen, 1):
            total += req.rows
            if total in self._preferred:
                best = count
        return best

    def _ready(
        self, chosen: list[Pending], rows: int, closed: bool, now: float
    ) -> tuple[list[Pending] | None, float | None]:
        """What to send now (None: wait, and when to look again)."""
        if closed or self.config.max_queue_delay_s <= 0:
            return chosen, None
        prefix = self._preferred_prefix(chosen)
        if prefix:
            return chosen[:prefix], None  # Triton: a preferred size is reached, send it at once
        predicted = self.predictor.predict(rows)
        slack_end = min((r.deadline - predicted for r in chosen if r.deadline is not None), default=math.inf)
        window_end = min(r.arrival for r in chosen) + self.config.max_queue_delay_s
        end = min(slack_end, window_end)
        if now >= end:
            return chosen, None  # the window or the slack ran out: send everything pending
        if self._waiting_since is None:
            if not self._worth_waiting(end - now):
                return chosen, None
            self._waiting_since, self._waiting_seen, self._last_arrival = now, 0, now
        # A burst has ended when no request came for twice the expected gap: stop waiting then.
        gap = 1.0 / self._wait_rate if self._wait_rate else self.config.max_queue_delay_s
        quiet_end = self._last_arrival + 2 * gap
        if now >= quiet_end:
            return chosen, None
        return None, min(end, quiet_end)

    def _worth_waiting(self, remaining: float) -> bool:
        """Wait only while the arrivals seen during earlier waits say another request is likely to come."""
        self._since_probe += 1
        if self._wait_rate is None or self._since_probe >= self.config.probe_every:
            self._since_probe = 0
            return True
        return self._wait_rate * remaining >= 1.0

    def _take(self, chosen: list[Pending], rows: int, now: float) -> Batch:
        if self._waiting_since is not None:
            waited = now - self._waiting_since
            if waited > 0:
                rate = self._waiting_seen / waited
                a = self.config.wait_gain_alpha
                self._wait_rate = rate if self._wait_rate is None else (1 - a) * self._wait_rate + a * rate
            self._waiting_since = None
        for req in chosen:  # each leaves its tenant's queue (at its head, but for aged and delayed ones)
            level = self._levels[req.level - 1]
            queue = level.queues[req.tenant]
            if queue[0] is req:
                queue.popleft()
            else:
                queue.remove(req)
            level.forget(req, queue)
            level.served[req.tenant] = level.served.get(req.tenant, 0.0) + req.rows / self.weight(req.tenant)
        self._queued -= len(chosen)
        batch = Batch(next(self._batch_ids), tuple(chosen), rows, now, self.predictor.predict(rows))
        self._running[batch.id] = batch
        return batch

    def retune(
        self, *, max_queue_delay_s: float | None = None, preferred_batch_sizes: tuple[int, ...] | None = None
    ) -> None:
        """Change the batching parameters live; None puts one back to the configured value. Queued requests stay,
        and the next `step` decides with the new values."""
        base = self.base_config
        self.config = replace(
            base,
            max_queue_delay_s=base.max_queue_delay_s if max_queue_delay_s is None else max_queue_delay_s,
            preferred_batch_sizes=base.preferred_batch_sizes
            if preferred_batch_sizes is None
            else preferred_batch_sizes,
        )
        self._preferred = frozenset(p for p in self.config.preferred_batch_sizes if p <= self.config.max_batch_size)

    # ---- lifecycle and introspection ---------------------------------------------------------

    def drain(self) -> None:
        """Stop admitting; what is queued still runs."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def idle(self) -> bool:
        return self._queued == 0 and not self._running

    def depth(self) -> list[int]:
        """Queued requests per level (index 0 = priority 1)."""
        return [lv.count for lv in self._levels]

    def tenant_depth(self) -> dict[str, int]:
        """Queued requests per tenant (the tenants with none are left out)."""
        depth: dict[str, int] = {}
        for level in self._levels:
            for tenant, queue in level.queues.items():
                depth[tenant] = depth.get(tenant, 0) + len(queue)
        return depth

    @property
    def wait_rate(self) -> float | None:
        return self._wait_rate


def _rows(request: Pending) -> float:
    return request.rows


def _seq(request: Pending) -> float:
    return request.seq
