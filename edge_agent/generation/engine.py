"""The generative engine of one model instance: a thread that owns the decoder runner and steps the scheduler, and
an asyncio front end that admits requests at once and streams their tokens.

- `submit` runs on the event loop: it tokenizes nothing (the caller hands over prompt tokens), asks the scheduler to
  admit the sequence (a refusal is raised at once, before any token), and returns a `Stream`. The request's tenant
  goes with it: within a level the scheduler shares the steps between tenants by weight (`set_weights`).
- The engine thread loops: plan a step (under the lock the front end admits with), run it on the runner outside the
  lock (onnxruntime releases the GIL; the event loop never runs a model step), sample each sequence's next token,
  check EOS, stop strings and `max_tokens`, then hand each stream its new text with `call_soon_threadsafe`.
- A stream that is cancelled (its client left) ends at the next step; its blocks are free then.
- `drain` stops admitting and waits until every running stream has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from edge_agent.generation.runner import DecoderRunner
from edge_agent.generation.sampling import Sampler, SamplingParams
from edge_agent.generation.scheduler import GenerationScheduler, Sequence, StepPlan
from edge_agent.generation.text import IncrementalText, TextCodec
from edge_agent.scheduling.core import Rejection
from edge_agent.scheduling.worker import Refused
from spillway.contract import names
from spillway.contract.tenants import DEFAULT_TENANT

__all__ = ["Chunk", "GenerationEngine", "GenerationRequest", "Stream", "Timing"]

log = logging.getLogger("spillway.agent.generation")
FinishReason = Literal["stop", "length", "cancelled", "error", "draining"]
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]  # tokens
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    priority: int = 0  # 0: the model's default level
    timeout_s: float | None = None  # to the first token
    operation: str = "text_completion"  # gen_ai.operation.name: text_completion or chat
    ignore_eos: bool = False  # generate to max_tokens past EOS (vLLM's extra parameter; benchmarks use it)
    # False: its outcome is counted elsewhere (an async job, counted `queued_async` when it was accepted); the GenAI
    # histograms still record its run.
    counted: bool = True
    tenant: str = DEFAULT_TENANT  # whose request it is: tenants share a level by weight (the scheduler's fair share)


@dataclass(frozen=True)
class Chunk:
    """What a stream receives: new text (and its tokens); the last one has `finish_reason`."""

    text: str
    tokens: int  # output tokens in this chunk
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    stream: Stream
    sampler: Sampler
    text: IncrementalText
    tokens: list[int]  # prompt + generated
    level: int = 0
    arrived: float = 0.0  # time.monotonic()
    first_token_at: float | None = None
    sent: int = 0  # characters of `text.text` handed to the stream
    cancelled: bool = False
    ended: bool = False  # its final chunk is out: nothing more is delivered


class Stream:
    """One request's chunks, in order, ending with one that has a `finish_reason`."""

    def __init__(self, engine: GenerationEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self.job: _Job | None = None

    def _put(self, chunk: Chunk) -> None:  # on the event loop
        self._queue.put_nowait(chunk)

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            chunk = await self._queue.get()
            yield chunk
            if chunk.finish_reason is not None:
                return

    def cancel(self) -> None:
        """The client left: the sequence ends at the next step (nothing happens once it has ended)."""
        if self.job is not None and not self.job.ended:
            self.job.cancelled = True
            self._engine._wake.set()


@dataclass
class Timing:
    """Where the engine thread's time goes: whole steps (planning, the model, sampling, text, handing chunks over)
    and, of that, the model's own session calls; the rest is the scheduler's overhead."""

    steps: int = 0
    step_s: float = 0.0
    model_s: float = 0.0

    def json(self) -> dict[str, float | int]:
        overhead = self.step_s - self.model_s
        return {"steps": self.steps, "step_s": round(self.step_s, 6), "model_s": round(self.model_s, 6),
                "overhead_share": round(overhead / self.step_s, 4) if self.step_s > 0 else 0.0}  # fmt: skip


class GenerationListener(Protocol):
    """What the telemetry hears of a generative model (GenerationRecorder)."""

    def outcome(self, priority: int, outcome: str, tenant: str = DEFAULT_TENANT) -> None: ...

    def step(self, tokens: int) -> None: ...

    def finished(self, priority: int, outcome: str | None, *, operation: str, prompt_tokens: int,
                 completion_tokens: int, ttft_s: float | None, duration_s: float,
                 tenant: str = DEFAULT_TENANT) -> None: ...  # fmt: skip


class GenerationEngine:
    def __init__(self, name: str, runner: DecoderRunner, text: TextCodec, scheduler: GenerationScheduler, *,
                 context: int, eos: int | tuple[int, ...] | None = None, version: str = "1") -> None:  # fmt: skip
        self.name = name
        self.version = version
        self.runner = runner
        self.text = text
        self.scheduler = scheduler
        self.context = context
        if eos is None:
            eos = () if text.eos_id is None else text.eos_id
        self.eos_ids = (eos,) if isinstance(eos, int) else tuple(eos)  # any of them ends a sequence
        self.eos = self.eos_ids[0] if self.eos_ids else None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.broken: str | None = None  # why the engine thread stopped on an error of ours (it refuses then)
        self._dead = False  # the engine thread has ended (broken or closed): nothing admitted would ever run
        # Final chunks of the step being run, handed over once the step's sequences have freed their blocks.
        self._finals: list[tuple[_Job, Chunk]] | None = None
        self.timing = Timing()
        self.counts: dict[str, int] = {"admitted": 0, "refused": 0, "finished": 0, "cancelled": 0}
        self.listener: GenerationListener | None = None  # telemetry, when the agent exports metrics
        self._jobs: dict[int, Sequence] = {}  # by sequence id: every sequence admitted and not ended

    # ---- the front end (event loop) ------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, count_refusal: bool = True) -> Stream:
        """Admit a request now or raise Refused (draining, queue full, a first-token deadline it cannot meet);
        ValueError for one that cannot fit the model (the prompt and max_tokens beyond the context). A refusal is
        counted unless `count_refusal` is False (the pool then asks another instance, and counts its own)."""
        loop = self._loop = self._loop or asyncio.get_running_loop()
        if self.broken is not None:
            if count_refusal:  # else the pool asks another instance and counts its own refusal
                self.refused()
            raise Refused(Rejection("draining", f"the model's engine stopped: {self.broken}; see the agent log", 5.0))
        if self._thread is None:
            self._start()
        stream = Stream(self, loop)
        level = self.scheduler.resolve_level(request.priority)
        now = time.monotonic()
        deadline = self.scheduler.deadline_for(level, now, request.timeout_s)
        job = _Job(request, stream, Sampler(request.sampling), self.text.incremental(), list(request.prompt),
                   level=level, arrived=now)  # fmt: skip
        sequence = Sequence(prompt=len(request.prompt), max_tokens=request.max_tokens, level=level, arrival=now,
                            deadline=deadline, payload=job, tenant=request.tenant)  # fmt: skip
        try:
            with self._lock:
                if self._dead:
                    why = f"the model's engine stopped: {self.broken}; see the agent log" if self.broken else (
                        "the model's engine is closed")  # fmt: skip
                    rejection: Rejection | None = Rejection("draining", why, 5.0)
                else:
                    rejection = self.scheduler.admit(sequence, now, context=self.context)
                if rejection is None:
                    self._jobs[sequence.id] = sequence
        except ValueError:  # it cannot fit the model: counted as refused, told as a bad request
            self.refused(level, request.tenant)
            raise
        if rejection is not None:
            if count_refusal:
                self.refused(level, request.tenant)
            raise Refused(rejection)
        self.counts["admitted"] += 1
        stream.job = job
        self._wake.set()
        return stream

    def predict_first_token_s(self, request: GenerationRequest) -> float:
        """Seconds to the request's first token were it admitted now (ValueError for a priority out of range)."""
        with self._lock:
            level = self.scheduler.resolve_level(request.priority)
            return self.scheduler.predict_first_token_s(level, len(request.prompt), time.monotonic(), request.tenant)

    @property
    def load(self) -> int:
        """Sequences running or waiting."""
        with self._lock:
            return len(self.scheduler.running) + self.scheduler.waiting

    def refused(self, level: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        """Count a request refused before any token (by admission, or as invalid: level 0)."""
        self.counts["refused"] += 1
        if self.listener is None:
            return
        if tenant == DEFAULT_TENANT:  # as listeners written before tenants are called
            self.listener.outcome(level, names.REJECTED)
        else:
            self.listener.outcome(level, names.REJECTED, tenant)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights for fair share within a level, from the next step on (a tenant left out: 1)."""
        with self._lock:
            self.scheduler.set_weights(weights)
        self._wake.set()

    def limit(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Lower the scheduler's limits from the next step on (None: as configured; see GenerationScheduler.limit).
        Under the lock the engine thread plans each step with: a step already planned runs as planned."""
        with self._lock:
            self.scheduler.limit(max_num_seqs, max_num_batched_tokens)
        self._wake.set()  # a raised limit may let a waiting sequence in now

    @property
    def active(self) -> int:
        """Sequences admitted and not yet ended (running or waiting)."""
        with self._lock:
            return len(self._jobs)

    async def drain(self) -> None:
        """Stop admitting; return once every stream has ended."""
        with self._lock:
            self.scheduler.drain()
        while True:  # polled under the lock: a flag set from the engine thread could go stale before it is read
            with self._lock:
                if self.scheduler.idle:
                    return
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the engine thread ---------------------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=f"generate-{self.name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop:
                self._step()
        except Exception as exc:  # a bug of ours: every stream still gets its end, and new ones are refused
            log.exception("the generative engine of %s stopped", self.name)
            self.broken = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._dead = True  # under the lock: a submit either sees it, or its sequence is ended just below
                for sequence in list(self._jobs.values()):
                    self.scheduler.finish(sequence)
                    self.runner.release(sequence.id)
                    reason: FinishReason = "error" if self.broken else "cancelled"
                    self._deliver(sequence.payload, self._chunk(sequence.payload, "", 0, reason))
                self._jobs.clear()

    def _step(self) -> None:
        started, model_before = time.perf_counter(), self.runner.run_s
        with self._lock:
            self._end_cancelled()
            plan = self.scheduler.step(time.monotonic())
            for sequence in plan.preempted:  # a recompute starts from its tokens: its cache goes now
                self.runner.release(sequence.id)
            idle = self.scheduler.idle
        if plan.empty:
            self._wake.wait(0.05 if not idle else None)
            self._wake.clear()
            return
        self._finals = []
        try:
            self._run_and_settle(plan)
        finally:  # a stream ends once its blocks are free: its client sees the pool as it is
            self.timing.steps += 1
            self.timing.model_s += self.runner.run_s - model_before
            if self.listener is not None:
                self.listener.step(plan.tokens)
            finals, self._finals = self._finals, None
            for job, chunk in finals:
                self._post(job.stream._put, chunk)
            self.timing.step_s += time.perf_counter() - started

    def _run_and_settle(self, plan: StepPlan) -> None:
        try:
            finished = self._run(plan)
        except Exception:  # a model failure ends every stream of the step, never the engine
            log.exception("a generation step of %s failed", self.name)
            finished = {s: "error" for s in (*plan.decode, *(q for q, _ in plan.prefill))}
            for sequence in finished:
                self._deliver(sequence.payload, self._chunk(sequence.payload, "", 0, "error"))
        with self._lock:
            self.scheduler.advance(plan, frozenset(finished))
            for sequence in finished:
                self.scheduler.finish(sequence)
                self.runner.release(sequence.id)
                self._jobs.pop(sequence.id, None)
            for sequence in (*plan.decode, *(q for q, _ in plan.prefill)):  # ended by the scheduler alone
                if sequence.state == "finished" and sequence.id in self._jobs:
                    self.runner.release(sequence.id)
                    del self._jobs[sequence.id]
                    self._deliver(sequence.payload, self._chunk(sequence.payload, "", 0, "length"))

    def _end_cancelled(self) -> None:
        for sequence in [s for s in self._jobs.values() if s.payload.cancelled]:
            self.scheduler.finish(sequence)
            self.runner.release(sequence.id)
            del self._jobs[sequence.id]
            self.counts["cancelled"] += 1
            self._deliver(sequence.payload, self._chunk(sequence.payload, "", 0, "cancelled"))

    def _run(self, plan: StepPlan) -> dict[Sequence, FinishReason]:
        """Run the plan; the sequences it finishes, with why."""
        started = time.perf_counter()
        new_tokens: dict[Sequence, int] = {}
        prefill_tokens = 0
        for sequence, chunk in plan.prefill:
            job: _Job = sequence.payload
            known = job.tokens[: sequence.prompt + max(sequence.generated - 1, 0)]
            logits = self.runner.prefill(sequence.id, known[sequence.prefilled : sequence.prefilled + chunk])
            prefill_tokens += chunk
            if sequence.prefilled + chunk == len(known) and sequence.generated == 0:
                new_tokens[sequence] = job.sampler.sample(logits)
        prefill_s = time.perf_counter() - started
        if plan.decode:
            logits = self.runner.decode([s.id for s in plan.decode], [s.payload.tokens[-1] for s in plan.decode])
            for row, sequence in enumerate(plan.decode):
                new_tokens[sequence] = sequence.payload.sampler.sample(logits[row])
        elapsed = time.perf_counter() - started
        self.scheduler.rates.observe(prefill_tokens, 0, prefill_s)
        if plan.decode:
            self.scheduler.rates.observe(0, len(plan.decode), elapsed - prefill_s)
        finished: dict[Sequence, FinishReason] = {}
        for sequence, token in new_tokens.items():
            reason = self._append(sequence, token)
            if reason is not None:
                finished[sequence] = reason
        return finished

    def _append(self, sequence: Sequence, token: int) -> FinishReason | None:
        job: _Job = sequence.payload
        job.tokens.append(token)
        generated = len(job.tokens) - sequence.prompt
        if token in self.eos_ids and not job.request.ignore_eos:
            self._deliver(job, self._chunk(job, job.text.text[job.sent :], 1, "stop"))
            return "stop"
        job.text.push(token)
        text = job.text.text
        found = [at for stop in job.request.stop if (at := text.find(stop, job.sent)) >= 0]
        if found:  # the earliest match ends it, whichever stop string it is
            self._deliver(job, self._chunk(job, text[job.sent : min(found)], 1, "stop"))
            return "stop"
        if generated >= job.request.max_tokens or len(job.tokens) >= self.context:
            self._deliver(job, self._chunk(job, text[job.sent :], 1, "length"))
            return "length"
        # Hold back what could be the start of a stop string, so that a stop is never half sent.
        hold = max((len(s) - 1 for s in job.request.stop), default=0)
        ready = len(text) - hold
        if ready > job.sent:
            self._deliver(job, self._chunk(job, text[job.sent : ready], 1, None))
        else:
            self._deliver(job, self._chunk(job, "", 1, None))
        return None

    def _chunk(self, job: _Job, text: str, tokens: int, reason: FinishReason | None) -> Chunk:
        job.sent += len(text)
        prompt = len(job.request.prompt)
        return Chunk(text, tokens, reason, prompt, len(job.tokens) - prompt)

    def _deliver(self, job: _Job, chunk: Chunk) -> None:
        if job.ended:
            return
        job.ended = chunk.finish_reason is not None
        if chunk.tokens and job.first_token_at is None:
            job.first_token_at = time.monotonic()
        if chunk.finish_reason is not None:
            if chunk.finish_reason != "cancelled":
                self.counts["finished"] += 1
            if self.listener is not None:  # one outcome per request: served here, or an error of the model run
                outcome: str | None = names.ERROR if chunk.finish_reason == "error" else names.LOCAL
                if not job.request.counted:
                    outcome = None
                ttft = None if job.first_token_at is None else job.first_token_at - job.arrived
                self.listener.finished(job.level, outcome, operation=job.request.operation,
                                       prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                                       ttft_s=ttft, duration_s=time.monotonic() - job.arrived,
                                       tenant=job.request.tenant)  # fmt: skip
            if self._finals is not None:
                self._finals.append((job, chunk))
                return
        self._post(job.stream._put, chunk)

    def _post(self, callback: Callable[..., object], *args: object) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(callback, *args)

    def waiting_by_level(self) -> list[int]:
        """Requests waiting for their first step, per level (1 the highest)."""
        with self._lock:
            return [self.scheduler.waiting_at(level) for level in range(1, self.scheduler.config.levels + 1)]

    def json(self) -> dict[str, Any]:
        with self._lock:
            return {"running": len(self.scheduler.running), "waiting": self.scheduler.waiting,
                    "active": len(self._jobs), "kv_blocks": self.scheduler.blocks.json(),
                    "preemptions": self.scheduler.preemptions, "steps": self.timing.steps,
                    "timing": self.timing.json(), **self.counts}  # fmt: skip
