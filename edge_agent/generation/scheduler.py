"""The iteration-level scheduler of a generative model: a synchronous core, stepped with an injected clock like the V2
scheduler, that decides at every step which sequences decode a token and which prompts (or chunks of them) are
prefilled, within a token budget, and that preempts when KV blocks run out.

One step, in order:
1. Running sequences decode first, one token each, highest priority first; each grows its blocks by one when its next
   token needs one. When no block is free, the lowest-priority, latest-arrived running sequence is preempted by
   recompute (its blocks freed; back to the front of its level's queue with a bounded boost), until the others fit.
2. Then waiting and partly prefilled sequences take prompt chunks, highest level first and FIFO within one (a
   preempted sequence, boosted, goes before its level), each chunk at most `long_prefill_threshold` tokens, while
   the step's `max_num_batched_tokens`, `max_num_seqs` and the free blocks allow. A waiting sequence of a higher
   level than the lowest running one may preempt it when `max_num_seqs` is full.

Admission at arrival predicts the time to the first token: the prefill tokens queued at this level and above plus
its own, at the measured prefill rate, plus a step; a request that cannot make its first-token deadline is refused
before any token (the pipeline then overflows or refuses it). The time estimates come from a `Rates` the engine
refines with every step it runs.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from edge_agent.generation.blocks import BlockManager
from edge_agent.scheduling.core import Rejection

__all__ = ["GenerationConfig", "GenerationScheduler", "Rates", "Sequence", "StepPlan"]


@dataclass(frozen=True)
class GenerationConfig:
    max_num_seqs: int = 8  # sequences running at once
    max_num_batched_tokens: int = 512  # tokens one step computes: decodes plus prefill chunks
    long_prefill_threshold: int = 128  # the largest prompt chunk one sequence takes in a step
    levels: int = 3  # priority levels, 1 the highest
    default_level: int = 2
    max_waiting: int = 1024  # sequences waiting, so that memory stays bounded
    max_boosts: int = 2  # how often a preempted sequence goes before its level

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.long_prefill_threshold, self.levels) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, long_prefill_threshold and levels must be >= 1")
        if not 1 <= self.default_level <= self.levels:
            raise ValueError(f"default_level must be within 1..{self.levels}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must hold at least one decode token per running sequence")


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


@dataclass
class _Level:
    queue: deque[Sequence] = field(default_factory=deque)


class GenerationScheduler:
    def __init__(self, config: GenerationConfig, blocks: BlockManager, rates: Rates | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.rates = rates or Rates()
        self._levels = [_Level() for _ in range(config.levels)]
        self.running: list[Sequence] = []
        self._ids = itertools.count(1)
        self.preemptions = 0
        self._draining = False

    # ---- admission -------------------------------------------------------------------------------------------------

    def resolve_level(self, priority: int) -> int:
        if priority < 0:
            raise ValueError(f"priority must be >= 0, got {priority}")
        return self.config.default_level if priority == 0 or priority > self.config.levels else priority

    @property
    def waiting(self) -> int:
        return sum(len(lv.queue) for lv in self._levels)

    def predict_first_token_s(self, level: int, prompt: int) -> float:
        """Seconds from now to a new request's first token: the prefill queued at its level and above (and what
        running sequences still have to prefill), then its own, at the measured rate, plus one step."""
        ahead = sum(s.to_prefill for lv in self._levels[:level] for s in lv.queue)
        ahead += sum(s.to_prefill for s in self.running)
        return (ahead + prompt) / self.rates.prefill_tokens_per_s + self.rates.step_s

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
        if self.waiting >= self.config.max_waiting:
            return Rejection("queue_full", f"{self.waiting} sequences are waiting already", self._retry_after())
        if sequence.deadline is not None:
            predicted = self.predict_first_token_s(sequence.level, sequence.prompt)
            if now + predicted > sequence.deadline:
                budget_ms = (sequence.deadline - now) * 1e3
                return Rejection("deadline_unmeetable", f"predicted first token in {predicted * 1e3:.1f} ms exceeds "
                                 f"the {budget_ms:.1f} ms deadline", self._retry_after())  # fmt: skip
        sequence.id = next(self._ids)
        self._levels[sequence.level - 1].queue.append(sequence)
        return None

    def _retry_after(self) -> float:
        return max(1.0, math.ceil(self.predict_first_token_s(self.config.levels, 0)))

    # ---- a step ----------------------------------------------------------------------------------------------------

    def step(self) -> StepPlan:
        """Decide the next step (see the module's docstring). Blocks are taken here; the engine runs the plan and
        reports each sequence's new tokens with `advance`."""
        preempted: list[Sequence] = []
        decode: list[Sequence] = []
        self.running.sort(key=lambda s: (s.level, s.arrival, s.id))
        for sequence in list(self.running):
            if sequence not in self.running:  # preempted by this loop already
                continue
            if sequence.to_prefill > 0:  # still prefilling: takes chunks below
                continue
            while not self.blocks.grow(sequence, sequence.tokens):  # the token it feeds joins the cache
                victim = self._victim()  # the lowest priority, latest arrival: never one already decoding
                assert victim is not None and victim not in decode
                self._preempt(victim)
                preempted.append(victim)
                if victim is sequence:
                    break
            else:
                decode.append(sequence)
        budget = self.config.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Sequence, int]] = []
        for sequence in self._prefill_order():
            if budget <= 0:
                break
            if sequence.state == "waiting":
                if len(self.running) >= self.config.max_num_seqs:
                    victim = self._victim(below=sequence.level)
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
                self._levels[sequence.level - 1].queue.remove(sequence)
                sequence.state = "running"
                self.running.append(sequence)
            chunk = min(sequence.to_prefill, self.config.long_prefill_threshold, budget)
            prefill.append((sequence, chunk))
            budget -= chunk
        return StepPlan(tuple(decode), tuple(prefill), tuple(preempted))

    def _prefill_order(self) -> list[Sequence]:
        """Running sequences partly prefilled first (they hold blocks), then waiting ones by level: boosted
        (preempted) ones before the rest of their level, FIFO within."""
        partial = [s for s in self.running if s.to_prefill > 0]
        waiting: list[Sequence] = []
        for level in self._levels:
            waiting += sorted(level.queue, key=lambda s: (s.boosted == 0, s.arrival, s.id))
        return partial + waiting

    def _victim(self, below: int | None = None) -> Sequence | None:
        """The running sequence to preempt: lowest priority (highest level number), latest arrival; with `below`,
        only one of a lower priority than that level."""
        candidates = [s for s in self.running if below is None or s.level > below]
        return max(candidates, key=lambda s: (s.level, s.arrival, s.id)) if candidates else None

    def _preempt(self, sequence: Sequence) -> None:
        self.blocks.free(sequence)
        self.running.remove(sequence)
        sequence.state, sequence.prefilled = "waiting", 0
        sequence.preemptions += 1
        self.preemptions += 1
        sequence.boosted = int(sequence.preemptions <= self.config.max_boosts)  # bounded: then it queues as others
        self._levels[sequence.level - 1].queue.appendleft(sequence)

    def advance(self, plan: StepPlan, finished: set[Sequence] | frozenset[Sequence] = frozenset()) -> None:
        """After the engine ran `plan`: prefill chunks are in the caches, each decode (and each sequence whose
        prefill completed) produced a token; `finished` ended (EOS, a stop, max_tokens) and free their blocks."""
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
            self._levels[sequence.level - 1].queue.remove(sequence)
        sequence.state = "finished"

    def drain(self) -> None:
        self._draining = True

    @property
    def idle(self) -> bool:
        return not self.running and self.waiting == 0
