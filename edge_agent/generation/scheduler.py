"""The iteration-level scheduler of a generative model: a synchronous core, stepped with an injected clock like the V2
scheduler, that decides at every step which sequences decode a token and which prompts (or chunks of them) are
prefilled, within a token budget, and that preempts when KV blocks run out.

One step, in order:
1. Running sequences decode first, one token each, highest priority first; each grows its blocks by one when its next
   token needs one. When no block is free, the lowest-priority, latest-arrived running sequence is preempted by
   recompute (its blocks freed; back to the front of its level's queue with a bounded boost), until the others fit.
2. Then partly prefilled sequences, and waiting ones in the queue policy's order, take prompt chunks, each at most
   `long_prefill_threshold` tokens, while the step's `max_num_batched_tokens`, `max_num_seqs` and the free blocks
   allow. Under a policy that ranks levels, a waiting sequence of a higher level than the lowest running one may
   preempt it when `max_num_seqs` is full.
A policy may lower `max_num_seqs` and the token budget between two steps (`limit`): sequences already running beyond
the new `max_num_seqs` finish as they would, and nobody joins (nor preempts its way in) until fewer run.

Queue policies (one small interface, `QueueOrder`: a sort key over waiting sequences, and the rank that picks a
preemption victim):
- `priority` (default): highest level first, FIFO within a level; with `aging_s`, a sequence that has waited that long
  goes before every level (oldest first), so a low level is never starved for ever;
- `fcfs`: arrival order whatever the level (vLLM's default); the victim of a preemption is the latest arrival;
- `shortest_prompt_first`: highest level first, then the fewest prompt tokens left to prefill (the seed's STF); aging
  as for `priority` bounds how long a long prompt can be passed over.
A preempted sequence goes before the others of its rank (a bounded boost).

Tenants share a level by weight with virtual token counters (VTC, Sheng et al. 2024), the same mechanism as the V2
scheduler's: each tenant has a counter per level (under `fcfs`, one for the whole queue); every step adds the tokens it
computed for a tenant's sequences (prefill chunks and decodes, running ones included) / the tenant's weight; waiting
sequences of a rank are taken from the tenant with the smallest counter (advanced by each one's prompt as the order is
built), in the policy's order within a tenant. A tenant with nothing waiting at a level that queues there again is
lifted to the smallest counter of those waiting there (nobody waiting: the counters are forgotten), so idle time is
never banked as credit. Boosted sequences still go first, and aged ones before every level (shared fairly too). With
one tenant waiting, the order is the policy's alone.

Admission at arrival predicts the time to the first token: the prefill tokens of the waiting sequences the policy
puts before this one (and what running sequences still have to prefill) plus its own, at the measured prefill rate,
plus a step; a request that cannot make its first-token deadline (its `timeout`, or its level's default timeout) is
refused before any token (the pipeline then overflows or refuses it). The prediction counts, of the waiting sequences
of other tenants at its rank, at most their weighted share of its own tenant's waiting prompt tokens and its own. The
time estimates come from a `Rates` the engine refines with every step it runs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from edge_agent.generation.blocks import BlockManager
from edge_agent.scheduling.core import LevelPolicy, Rejection, check_weights, fair_merge, resolve_level
from spillway.contract.tenants import DEFAULT_TENANT

__all__ = ["QUEUE_POLICIES", "GenerationConfig", "GenerationScheduler", "QueueOrder", "Rates", "Sequence", "StepPlan"]

QueuePolicyName = Literal["priority", "fcfs", "shortest_prompt_first"]
SHARE_ALPHA = 0.05  # weight of one step in the levels' token shares (about the last 20 steps)


@dataclass(frozen=True)
class GenerationConfig:
    max_num_seqs: int = 8  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens one step computes: decodes plus prefill chunks
    long_prefill_threshold: int = 128  # the largest prompt chunk one sequence takes in a step
    levels: int = 3  # priority levels, 1 the highest
    default_level: int = 2
    max_waiting: int = 1024  # sequences waiting, so that memory stays bounded
    max_boosts: int = 2  # how often a preempted sequence goes before its rank
    queue_policy: QueuePolicyName = "priority"
    aging_s: float | None = None  # a sequence waiting this long goes first (priority, shortest_prompt_first)
    # Per level (index 0 is level 1): a default first-token timeout, whether a request may shorten it, a queue cap.
    level_policies: tuple[LevelPolicy, ...] = ()

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.long_prefill_threshold, self.levels) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, long_prefill_threshold and levels must be >= 1")
        if not 1 <= self.default_level <= self.levels:
            raise ValueError(f"default_level must be within 1..{self.levels}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must hold at least one decode token per running sequence")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy {self.queue_policy!r} is not one of {sorted(QUEUE_POLICIES)}")
        if self.aging_s is not None and self.aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        if self.level_policies and len(self.level_policies) != self.levels:
            raise ValueError(f"level_policies has {len(self.level_policies)} entries for {self.levels} levels")

    def level_policy(self, level: int) -> LevelPolicy:
        return self.level_policies[level - 1] if self.level_policies else LevelPolicy()


@dataclass
class Rates:
    """What a step costs, measured: prefill tokens per second and seconds per decode step (EWMA of real steps)."""

    prefill_tokens_per_s: float = 2000.0
    step_s: float = 0.01
    alpha: float = 0.2

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if prefill_tokens > 0 and decodes == 0:
            rate = prefill_tokens / seconds
            self.prefill_tokens_per_s += self.alpha * (rate - self.prefill_tokens_per_s)
        elif decodes > 0 and prefill_tokens == 0:
            self.step_s += self.alpha * (seconds - self.step_s)


@dataclass(eq=False)
class Sequence:
    """One generation request as the scheduler holds it; `payload` is the engine's."""

    prompt: int  # prompt tokens
    max_tokens: int
    level: int
    arrival: float
    deadline: float | None = None  # of the first token
    payload: Any = None
    id: int = 0
    prefilled: int = 0  # tokens in the cache: prompt, then (after a preemption) generated ones too
    generated: int = 0
    state: Literal["waiting", "running", "finished"] = "waiting"
    preemptions: int = 0
    boosted: int = 0
    tenant: str = DEFAULT_TENANT  # whose request it is: tenants share a level by weight

    @property
    def to_prefill(self) -> int:
        """Tokens to run before its next decode: the prompt and, after a preemption, what it generated, but the last
        token, which the decode feeds (the cache holds every token before it)."""
        return self.prompt + max(self.generated - 1, 0) - self.prefilled

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


@dataclass(frozen=True)
class StepPlan:
    """What to run now: one token for each of `decode`, the chunks of `prefill` (sequence, tokens), and the
    sequences preempted by this step (their caches to drop)."""

    decode: tuple[Sequence, ...] = ()
    prefill: tuple[tuple[Sequence, int], ...] = ()
    preempted: tuple[Sequence, ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class QueueOrder:
    """A queue policy: the order of waiting sequences (a sort key, smallest first) and the rank of running ones
    for preemption (the largest is preempted first). `priority`: level, then arrival."""

    ranks_levels = True  # a waiting sequence of a higher level may preempt a running one of a lower level

    def __init__(self, aging_s: float | None = None) -> None:
        self.aging_s = aging_s

    def level(self, sequence: Sequence, now: float | None) -> int:
        """Its level, or 0 (before every level) once it has waited `aging_s`."""
        aged = self.aging_s is not None and now is not None and now - sequence.arrival >= self.aging_s
        return 0 if aged else sequence.level

    def key(self, sequence: Sequence, now: float | None) -> tuple[float, ...]:
        return (self.level(sequence, now), sequence.boosted == 0, sequence.arrival, sequence.id)

    def victim_rank(self, sequence: Sequence) -> tuple[float, ...]:
        return (sequence.level, sequence.arrival, sequence.id)


class _FirstComeFirstServed(QueueOrder):
    ranks_levels = False

    def key(self, sequence: Sequence, now: float | None) -> tuple[float, ...]:
        return (sequence.boosted == 0, sequence.arrival, sequence.id)

    def victim_rank(self, sequence: Sequence) -> tuple[float, ...]:
        return (sequence.arrival, sequence.id)


class _ShortestPromptFirst(QueueOrder):
    def key(self, sequence: Sequence, now: float | None) -> tuple[float, ...]:
        level = self.level(sequence, now)
        if level == 0:  # aged: oldest first, whatever its length
            return (0, sequence.boosted == 0, 0, sequence.arrival, sequence.id)
        return (level, sequence.boosted == 0, sequence.to_prefill, sequence.arrival, sequence.id)


QUEUE_POLICIES: dict[str, type[QueueOrder]] = {
    "priority": QueueOrder,
    "fcfs": _FirstComeFirstServed,
    "shortest_prompt_first": _ShortestPromptFirst,
}


class GenerationScheduler:
    def __init__(self, config: GenerationConfig, blocks: BlockManager, rates: Rates | None = None) -> None:
        self.config = config
        self.configured = config  # `limit` never goes above it, and reverting comes back to it
        self.blocks = blocks
        self.rates = rates or Rates()
        self.order = QUEUE_POLICIES[config.queue_policy](config.aging_s)
        self._waiting: list[Sequence] = []  # admitted, holding no blocks; ordered by `order` at each step
        self._per_level = [0] * config.levels
        self._level_share = [0.0] * config.levels  # EWMA of each level's share of the tokens a step computes
        self.running: list[Sequence] = []
        self._ids = itertools.count(1)
        self.preemptions = 0
        self._draining = False
        # Fair share: per bucket (a level, or 0 for the one queue of a policy that does not rank levels) each tenant's
        # virtual token counter, and how many sequences each tenant has waiting there (the backlogged tenants).
        self._weights: dict[str, float] = {}  # a tenant not in it has weight 1
        self._served: list[dict[str, float]] = [{} for _ in range(config.levels + 1)]
        self._backlog: list[dict[str, int]] = [{} for _ in range(config.levels + 1)]

    # ---- fair share ------------------------------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights from now on (a tenant left out has weight 1). The engine calls this under its lock."""
        self._weights = check_weights(weights)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def tenant_depth(self) -> dict[str, int]:
        """Sequences waiting per tenant (the tenants with none are left out)."""
        depth: dict[str, int] = {}
        for backlog in self._backlog:
            for tenant, count in backlog.items():
                depth[tenant] = depth.get(tenant, 0) + count
        return depth

    def _bucket(self, sequence: Sequence) -> int:
        return sequence.level if self.order.ranks_levels else 0

    def _charge(self, sequence: Sequence, tokens: int) -> None:
        served = self._served[self._bucket(sequence)]
        served[sequence.tenant] = served.get(sequence.tenant, 0.0) + tokens / self.weight(sequence.tenant)

    # ---- limits ----------------------------------------------------------------------------------------------------

    def limit(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Lower `max_num_seqs` and the token budget for the next steps (None: as configured); never above the
        configured ones, and the sequences never above the budget (a decode token each). Running sequences beyond a
        lowered `max_num_seqs` finish as they would; no sequence joins (nor preempts its way in) until fewer run.
        The engine calls this under its lock, between two steps."""
        configured = self.configured
        tokens = min(max_num_batched_tokens or configured.max_num_batched_tokens, configured.max_num_batched_tokens)
        seqs = min(max_num_seqs or configured.max_num_seqs, configured.max_num_seqs, tokens)
        self.config = replace(self.config, max_num_seqs=seqs, max_num_batched_tokens=tokens)

    # ---- admission -------------------------------------------------------------------------------------------------

    def resolve_level(self, priority: int) -> int:
        return resolve_level(priority, self.config.levels, self.config.default_level)

    def deadline_for(self, level: int, now: float, timeout_s: float | None) -> float | None:
        """The first token's deadline from the request's `timeout` and its level's default timeout."""
        return self.config.level_policy(level).deadline(now, timeout_s)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_at(self, level: int) -> int:
        """Sequences waiting at one level (1 the highest): the queue depth per level."""
        return self._per_level[level - 1]

    def predict_first_token_s(self, level: int, prompt: int, now: float | None = None,
                              tenant: str = DEFAULT_TENANT) -> float:  # fmt: skip
        """Seconds from `now` to a new request's first token. Two things hold it back:
        - the prefill of the waiting sequences the policy puts before it, and what running ones still have to
          prefill, at the measured prefill rate (of other tenants' waiting at its rank, those within their weighted
          share of its own tenant's prompt tokens before it and its own: fair share takes them before it);
        - a free place among `max_num_seqs`: running sequences it cannot preempt keep theirs until they end (taken
          as their `max_tokens`, so EOS can only make it earlier), and the waiting ones before it take places first.
        The two add up (the prefill ahead runs in the steps it waits through); under a policy that ranks levels the
        sum is stretched by the share of recent steps' tokens that higher levels took (they will go before it as
        they arrive: a wait that is 40 % theirs lasts 1 / 0.6 as long). Then its own prefill and a step. Sequences
        that will age past it are not foreseen."""
        probe = Sequence(prompt=prompt, max_tokens=1, level=level, arrival=math.inf if now is None else now,
                         id=1 << 62, tenant=tenant)  # fmt: skip
        mine = self.order.key(probe, now)
        if any(t != tenant for t in self._backlog[self._bucket(probe)]):
            keyed = self._shared_ahead(probe, mine, now)
        else:  # no other tenant waits at its rank (the usual case): the policy's order alone
            keyed = sorted((key, s.id, s) for s in self._waiting if (key := self.order.key(s, now)) < mine)
        ahead = [s for _, _, s in keyed]  # in the order they will be served: each key computed once
        prefill_ahead = sum(s.to_prefill for s in ahead) + sum(s.to_prefill for s in self.running)
        rates, chunk = self.rates, self.config.long_prefill_threshold
        mine_level = self.order.level(probe, now)
        holding = [s for s in self.running
                   if not (self.order.ranks_levels and self.order.level(s, now) > mine_level)]  # fmt: skip
        places = sorted(self._steps_left(s, chunk) for s in holding)
        # More running than places (a lowered max_num_seqs): the first place frees when enough of them have ended.
        places = places[max(len(places) - self.config.max_num_seqs, 0) :]
        places += [0] * (self.config.max_num_seqs - len(places))
        heapq.heapify(places)
        for sequence in ahead:  # each takes the first place to free, for as long as it will run
            heapq.heapreplace(places, places[0] + self._steps_left(sequence, chunk))
        wait_s = prefill_ahead / rates.prefill_tokens_per_s + places[0] * rates.step_s
        if self.order.ranks_levels and mine_level > 1:  # higher levels arriving meanwhile go first: their share of
            wait_s /= max(1.0 - sum(self._level_share[: mine_level - 1]), 0.1)  # the steps stretches the wait
        return wait_s + prompt / rates.prefill_tokens_per_s + rates.step_s

    def _shared_ahead(
        self, probe: Sequence, mine: tuple[float, ...], now: float | None
    ) -> list[tuple[Any, int, Sequence]]:
        """The waiting sequences served before `probe` under fair share, keyed and sorted: those the policy puts
        before its rank, and at its rank, its own tenant's before it and, of each other tenant's (in the policy's
        order), those that start within its weighted share: (own prompt tokens before it + its own) * w_other / w_own.
        """
        group = self._group(probe, now)
        keyed: list[tuple[Any, int, Sequence]] = []
        others: dict[str, list[tuple[Any, int, Sequence]]] = {}
        own = 0
        for s in self._waiting:
            key = self.order.key(s, now)
            if s.tenant != probe.tenant and not s.boosted and self._group(s, now) == group:
                others.setdefault(s.tenant, []).append((key, s.id, s))
            elif key < mine:
                keyed.append((key, s.id, s))
                if s.tenant == probe.tenant and not s.boosted and self._group(s, now) == group:
                    own += s.to_prefill
        share = (own + probe.prompt) / self.weight(probe.tenant)
        for tenant, theirs in others.items():
            cap, taken = share * self.weight(tenant), 0
            for entry in sorted(theirs):
                if taken >= cap:
                    break
                keyed.append(entry)
                taken += max(entry[2].to_prefill, 1)
        keyed.sort()
        return keyed

    def _one_tenant_per_rank(self) -> bool:
        """Whether no rank has sequences of two tenants waiting: one tenant in all, or one per level without aging
        (aged sequences of several levels make one rank)."""
        if all(len(backlog) < 2 for backlog in self._backlog) and self.config.aging_s is None:
            return True
        return len(set().union(*self._backlog)) < 2

    def _group(self, sequence: Sequence, now: float | None) -> int:
        """The rank fair share works within: its level (0 once aged), or one for all under a policy without levels."""
        return self.order.level(sequence, now) if self.order.ranks_levels else 0

    @staticmethod
    def _steps_left(sequence: Sequence, chunk: int) -> int:
        """Steps a sequence still holds its place for, at most: its prompt's chunks, then a token a step."""
        return -(-sequence.to_prefill // chunk) + max(sequence.max_tokens - sequence.generated, 0)

    def admit(self, sequence: Sequence, now: float, *, context: int) -> Rejection | None:
        """Queue a new sequence, or say at once why not (before any token)."""
        if self._draining:
            return Rejection("draining", "the agent is shutting down", 1.0)
        if sequence.prompt < 1 or sequence.prompt + sequence.max_tokens > context:
            raise ValueError(f"a prompt of {sequence.prompt} tokens and max_tokens {sequence.max_tokens} do not fit "
                             f"the {context}-token context")  # fmt: skip
        if self.blocks.blocks_for(sequence.prompt + sequence.max_tokens) > self.blocks.total:
            raise ValueError(f"{sequence.prompt + sequence.max_tokens} tokens need more KV blocks than the budget "
                             f"holds ({self.blocks.total} of {self.blocks.block_size} tokens)")  # fmt: skip
        tenant = sequence.tenant
        if self.waiting >= self.config.max_waiting:
            return Rejection("queue_full", f"{self.waiting} sequences are waiting already",
                             self._retry_after(now, tenant))  # fmt: skip
        cap = self.config.level_policy(sequence.level).max_queue_size
        if cap and self._per_level[sequence.level - 1] >= cap:
            return Rejection("queue_full", f"{cap} sequences are waiting at level {sequence.level} already",
                             self._retry_after(now, tenant))  # fmt: skip
        if sequence.deadline is not None and self.config.level_policy(sequence.level).timeout_action == "REJECT":
            predicted = self.predict_first_token_s(sequence.level, sequence.prompt, now, tenant)
            if now + predicted > sequence.deadline:
                budget_ms = (sequence.deadline - now) * 1e3
                return Rejection("deadline_unmeetable", f"predicted first token in {predicted * 1e3:.1f} ms exceeds "
                                 f"the {budget_ms:.1f} ms deadline", self._retry_after(now, tenant))  # fmt: skip
        sequence.id = next(self._ids)
        self._enqueue(sequence)
        return None

    def _retry_after(self, now: float, tenant: str) -> float:
        return max(1.0, math.ceil(self.predict_first_token_s(self.config.levels, 0, now, tenant)))

    def _enqueue(self, sequence: Sequence) -> None:
        self._waiting.append(sequence)
        self._per_level[sequence.level - 1] += 1
        bucket, tenant = self._bucket(sequence), sequence.tenant
        backlog = self._backlog[bucket]
        waiting = backlog.get(tenant, 0)
        if not waiting:  # it was not waiting here: lifted to the smallest counter of those waiting (no banked credit)
            served = self._served[bucket]
            if backlog:
                floor = min(served.get(t, 0.0) for t in backlog)
                served[tenant] = max(served.get(tenant, 0.0), floor)
            else:  # nobody waits here: the counters are forgotten
                served.clear()
                served[tenant] = 0.0
        backlog[tenant] = waiting + 1

    def _dequeue(self, sequence: Sequence) -> None:
        self._waiting.remove(sequence)
        self._per_level[sequence.level - 1] -= 1
        backlog = self._backlog[self._bucket(sequence)]
        backlog[sequence.tenant] -= 1
        if not backlog[sequence.tenant]:
            del backlog[sequence.tenant]

    # ---- a step ----------------------------------------------------------------------------------------------------

    def step(self, now: float | None = None) -> StepPlan:
        """Decide the next step (see the module's docstring) at `now` (for aging; None: no sequence ages). Blocks
        are taken here; the engine runs the plan and reports each sequence's new tokens with `advance`."""
        preempted: list[Sequence] = []
        decode: list[Sequence] = []
        self.running.sort(key=lambda s: self._rank(s, now))  # the victims of a preemption come last
        for sequence in list(self.running):
            if sequence not in self.running:  # preempted by this loop already
                continue
            if sequence.to_prefill > 0:  # still prefilling: takes chunks below
                continue
            while not self.blocks.grow(sequence, sequence.tokens):  # the token it feeds joins the cache
                victim = self._victim(now=now)  # the lowest rank: never one already decoding (sorted above)
                assert victim is not None and victim not in decode
                self._preempt(victim)
                preempted.append(victim)
                if victim is sequence:
                    break
            else:
                decode.append(sequence)
        budget = self.config.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Sequence, int]] = []
        for sequence in self._prefill_order(now):
            if budget <= 0:
                break
            if sequence.state == "waiting":
                if len(self.running) >= self.config.max_num_seqs:
                    if not self.order.ranks_levels or len(self.running) > self.config.max_num_seqs:
                        # Arrival order: nobody waiting outranks a running sequence. Above a lowered max_num_seqs:
                        # the running ones finish first; a preemption would only swap one for another.
                        break
                    victim = self._victim(below=sequence.level, now=now)
                    needed = self.blocks.blocks_for(sequence.tokens)
                    if victim is None or self.blocks.free_blocks + len(self.blocks.blocks_of(victim)) < needed:
                        continue  # nobody to preempt, or preempting would not make room: nobody loses a cache
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim in decode:
                        decode.remove(victim)
                        budget += 1
                    for entry in [e for e in prefill if e[0] is victim]:
                        prefill.remove(entry)
                        budget += entry[1]
                if not self.blocks.allocate(sequence, sequence.tokens):
                    break  # its blocks are not free: it waits, and so does everyone after it (no overtaking)
                self._dequeue(sequence)
                sequence.state = "running"
                self.running.append(sequence)
            chunk = min(sequence.to_prefill, self.config.long_prefill_threshold, budget)
            prefill.append((sequence, chunk))
            budget -= chunk
        return StepPlan(tuple(decode), tuple(prefill), tuple(preempted))

    def _prefill_order(self, now: float | None = None) -> list[Sequence]:
        """Running sequences partly prefilled first (they hold blocks), then waiting ones in the policy's order
        (boosted, preempted ones before the rest of their rank)."""
        partial = [s for s in self.running if s.to_prefill > 0]
        ordered = sorted(self._waiting, key=lambda s: self.order.key(s, now))
        if self._one_tenant_per_rank():  # the policy's order alone (the usual case)
            return partial + ordered
        fair: list[Sequence] = []
        for _, same in itertools.groupby(ordered, key=lambda s: self._group(s, now)):
            rank = list(same)
            tenants: dict[str, list[Sequence]] = {}
            for sequence in rank:
                if sequence.boosted:  # the key puts them first in their rank: they stay first
                    fair.append(sequence)
                else:
                    tenants.setdefault(sequence.tenant, []).append(sequence)
            if len(tenants) < 2:
                fair.extend(s for s in rank if not s.boosted)
                continue
            streams = [(self._served[self._bucket(queued[0])].get(t, 0.0), self.weight(t), queued)
                       for t, queued in tenants.items()]  # fmt: skip
            fair.extend(fair_merge(streams, _prompt_cost, _admitted))
        return partial + fair

    def _victim(self, below: int | None = None, now: float | None = None) -> Sequence | None:
        """The running sequence to preempt: the lowest rank (by default the lowest priority, latest arrival; one that
        aging let in ranks above every other, so that it is not pushed out again). With `below` (a waiting sequence
        of that level wants a place): only one of a lower priority than that level, and never an aged one."""
        candidates = [s for s in self.running
                      if below is None or (s.level > below and self.order.level(s, now) != 0)]  # fmt: skip
        return max(candidates, key=lambda s: self._rank(s, now)) if candidates else None

    def _rank(self, sequence: Sequence, now: float | None) -> tuple[float, ...]:
        return (self.order.level(sequence, now) != 0, *self.order.victim_rank(sequence))

    def _preempt(self, sequence: Sequence) -> None:
        self.blocks.free(sequence)
        self.running.remove(sequence)
        sequence.state, sequence.prefilled = "waiting", 0
        sequence.preemptions += 1
        self.preemptions += 1
        sequence.boosted = int(sequence.preemptions <= self.config.max_boosts)  # bounded: then it queues as others
        self._enqueue(sequence)

    def advance(self, plan: StepPlan, finished: set[Sequence] | frozenset[Sequence] = frozenset()) -> None:
        """After the engine ran `plan`: prefill chunks are in the caches, each decode (and each sequence whose
        prefill completed) produced a token; `finished` ended (EOS, a stop, max_tokens) and free their blocks."""
        if plan.tokens:
            tokens = [0] * self.config.levels
            for sequence in plan.decode:
                tokens[sequence.level - 1] += 1
                self._charge(sequence, 1)
            for sequence, chunk in plan.prefill:
                tokens[sequence.level - 1] += chunk
                self._charge(sequence, chunk)
            for i, count in enumerate(tokens):
                self._level_share[i] += SHARE_ALPHA * (count / plan.tokens - self._level_share[i])
        for sequence, chunk in plan.prefill:
            sequence.prefilled += chunk
            if sequence.to_prefill == 0 and sequence.generated == 0:
                sequence.generated = 1  # the prompt's last logits give the first token
        for sequence in plan.decode:
            sequence.generated += 1
            sequence.prefilled = sequence.tokens - 1  # the token fed in is in the cache now, the new one is not
        for sequence in list(self.running):
            if sequence in finished or sequence.generated >= sequence.max_tokens:
                self.finish(sequence)

    def finish(self, sequence: Sequence) -> None:
        """End a sequence now (finished, cancelled, its client gone): its blocks are free for the next step."""
        self.blocks.free(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence.state == "waiting":
            self._dequeue(sequence)
        sequence.state = "finished"

    def drain(self) -> None:
        self._draining = True

    @property
    def idle(self) -> bool:
        return not self.running and self.waiting == 0


def _prompt_cost(sequence: Sequence) -> float:
    return max(sequence.to_prefill, 1)


def _admitted(sequence: Sequence) -> float:
    return sequence.id
