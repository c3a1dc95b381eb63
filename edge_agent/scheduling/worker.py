"""The asyncio shell around the scheduler core: moves requests in, runs batches on executor threads, and
moves results out (one future per request; an exception fails every request of its batch)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_agent.scheduling.core import Batch, Pending, Rejection, Scheduler
from edge_agent.scheduling.stats import ModelStats


class BatchRunner(Protocol):
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Profile(Protocol):
    def predict(self, batch_size: int) -> float: ...

    def observe(self, batch_size: int, seconds: float) -> None: ...


class Refused(Exception):
    """The scheduler would not (or could no longer) serve the request; carries the reason."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


class ExecutionFailed(Exception):
    """The model run failed for the whole batch this request was in."""


@dataclass
class Served:
    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_rows: int


@dataclass(eq=False)
class _Job:
    inputs: dict[str, np.ndarray]
    future: asyncio.Future[Served]
    priority: int
    dispatched: float = 0.0
    counted: bool = True  # False: its outcome is counted elsewhere (an async job accepted earlier)


@dataclass(eq=False)
class _Instance:
    runner: BatchRunner
    work: queue.SimpleQueue[Batch | None]
    thread: threading.Thread | None = None


@dataclass
class _Result:
    outputs: list[dict[str, np.ndarray]] | None = None
    error: BaseException | None = None
    compute_s: float = 0.0


class ModelWorker:
    """Serves one model version: admission and batching by `Scheduler`, inference on `runners` off the loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        runners: list[BatchRunner],
        profile: Profile,
        *,
        batching: bool,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
    ) -> None:
        self.scheduler = scheduler
        self.profile = profile
        self.batching = batching
        self.stats = ModelStats()
        self._clock = clock
        # One thread per instance, fed through a SimpleQueue and answering with call_soon_threadsafe: the
        # leanest hand-off there is (a ThreadPoolExecutor adds futures, locks and chaining on every batch).
        self._free: list[_Instance] = []
        for i, runner in enumerate(runners):
            instance = _Instance(runner, queue.SimpleQueue())
            thread = threading.Thread(target=self._serve_instance, args=(instance,), name=f"infer-{name}-{i}",
                                      daemon=True)  # fmt: skip
            instance.thread = thread
            thread.start()
            self._free.append(instance)
        self._instances = list(self._free)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._idle = asyncio.Event()

    async def infer(self, inputs: dict[str, np.ndarray], rows: int, priority: int, timeout_s: float | None) -> Served:
        """Queue one request and wait for its result. Raises Refused, ExecutionFailed or ValueError (bad priority)."""
        return await self.admit(inputs, rows, priority, timeout_s)

    def admit(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        priority: int,
        timeout_s: float | None,
        *,
        count_refused: bool = True,
        counted: bool = True,
    ) -> asyncio.Future[Served]:
        """Queue one request now (no await in between), or raise Refused at once; the future is its result.

        count_refused=False: a refusal here is not counted, because the caller gives the request another outcome
        (overflow) or counts it itself; counted=False: its outcome is not counted at all (a job the agent accepted,
        and counted, earlier). Raises Refused or ValueError (bad priority); the future may fail with
        Refused (timed out in the queue) or ExecutionFailed.
        """
        self._loop = self._loop or asyncio.get_running_loop()
        now = self._clock()
        level = self.scheduler.resolve_level(priority)
        job = _Job(inputs, self._loop.create_future(), level, counted=counted)
        deadline = self.scheduler.deadline_for(level, now, timeout_s)
        shape = tuple((name, a.shape[1:]) for name, a in inputs.items()) if self.batching else None
        pending = Pending(rows=rows, level=level, arrival=now, deadline=deadline, payload=job, shape=shape)
        refused = self.scheduler.admit(pending, now)
        if refused is not None:
            if count_refused and counted:
                self.stats.outcome(level, "rejected")
            raise Refused(refused)
        self._idle.clear()
        self._pump()
        return job.future

    @property
    def utilisation(self) -> float:
        """How busy the model is: running batches plus queued requests (in batches), per instance."""
        return self.scheduler.utilisation

    def _pump(self) -> None:
        now = self._clock()
        step = self.scheduler.step(now)
        for pending in step.expired:
            job = pending.payload
            if job.counted:
                self.stats.request(job.priority, "rejected", now - pending.arrival, 0.0, now - pending.arrival)
            if not job.future.done():
                waited = (now - pending.arrival) * 1e3
                job.future.set_exception(
                    Refused(Rejection("timeout", f"timed out after {waited:.1f} ms in the queue", 1.0))
                )
        for batch in step.dispatch:
            instance = self._free.pop()
            for pending in batch.requests:
                pending.payload.dispatched = now
            instance.work.put(batch)
        self._arm(step.wake_at, now)
        if self.scheduler.idle:
            self._idle.set()

    def _arm(self, wake_at: float | None, now: float) -> None:
        if wake_at is None or wake_at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = wake_at
        self._timer = self._loop.call_later(max(0.0, wake_at - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        self._pump()

    def _run(self, batch: Batch, runner: BatchRunner) -> _Result:
        """On an executor thread: stack the batch, run it once, split the outputs per request."""
        jobs = [p.payload for p in batch.requests]
        try:
            if len(jobs) == 1:
                merged = jobs[0].inputs
            else:
                merged = {name: np.concatenate([j.inputs[name] for j in jobs]) for name in jobs[0].inputs}
            started = time.perf_counter()
            outputs = runner.run(merged)
            elapsed = time.perf_counter() - started
            if len(jobs) == 1:
                return _Result([outputs], compute_s=elapsed)
            split: list[dict[str, np.ndarray]] = []
            offset = 0
            for pending in batch.requests:
                split.append({k: v[offset : offset + pending.rows] for k, v in outputs.items()})
                offset += pending.rows
            return _Result(split, compute_s=elapsed)
        except Exception as exc:  # the model failed: every request of the batch gets the error
            return _Result(error=exc)

    def _serve_instance(self, instance: _Instance) -> None:
        """An instance's thread: run each batch it is handed, give the result back to the event loop."""
        while True:
            batch = instance.work.get()
            if batch is None:
                return
            result = self._run(batch, instance.runner)
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._finish, batch, instance, result)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def _finish(self, batch: Batch, instance: _Instance, result: _Result) -> None:
        now = self._clock()
        self.scheduler.complete(batch.id, now)
        self._free.append(instance)
        if result.error is None:
            self.profile.observe(batch.rows, result.compute_s)
        self.stats.batch(batch.rows, result.compute_s, ok=result.error is None)
        for i, pending in enumerate(batch.requests):
            job: _Job = pending.payload
            queue_s = job.dispatched - pending.arrival
            if result.error is not None:
                if job.counted:
                    self.stats.request(job.priority, "error", queue_s, result.compute_s, now - pending.arrival)
                if not job.future.done():
                    job.future.set_exception(ExecutionFailed(f"inference failed: {result.error}"))
                continue
            assert result.outputs is not None
            if job.counted:
                self.stats.request(job.priority, "local", queue_s, result.compute_s, now - pending.arrival)
            if not job.future.done():
                job.future.set_result(Served(result.outputs[i], queue_s, result.compute_s, batch.rows))
        self._pump()

    def retune(self, *, max_queue_delay_s: float | None, preferred_batch_sizes: tuple[int, ...] | None) -> None:
        """New batching parameters (None: as configured), effective at once: a window that is now over ends."""
        self.scheduler.retune(max_queue_delay_s=max_queue_delay_s, preferred_batch_sizes=preferred_batch_sizes)
        if self._loop is not None and not self.scheduler.idle:
            self._pump()

    async def drain(self) -> None:
        """Stop admitting, then return once everything queued or running has been answered."""
        self.scheduler.drain()
        if self.scheduler.idle:
            return
        await self._idle.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for instance in self._instances:
            instance.work.put(None)
        for instance in self._instances:
            if instance.thread is not None:
                instance.thread.join(timeout=30)
