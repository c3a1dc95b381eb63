"""The asyncio shell around the scheduler core: moves requests in, runs batches on executor threads, and
moves results out (one future per request; an exception fails every request of its batch)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_agent.errors import AgentError
from edge_agent.scheduling.core import Batch, Pending, Rejection, Scheduler
from edge_agent.scheduling.stats import ModelStats, RequestOutcome
from spillway.contract.names import ERROR, LOCAL, REJECTED
from spillway.contract.tenants import DEFAULT_TENANT


class BatchRunner(Protocol):
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Profile(Protocol):
    def predict(self, batch_size: int) -> float: ...

    def observe(self, batch_size: int, seconds: float) -> None: ...


class Refused(AgentError):
    """The scheduler would not (or could no longer) serve the request; carries the reason. `waited_s`: how long it
    was queued (0 when refused at admission)."""

    status = 503

    def __init__(self, rejection: Rejection, waited_s: float = 0.0) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection
        self.reason = rejection.reason
        self.waited_s = waited_s


class ExecutionFailed(AgentError):
    """The model run failed for the whole batch this request was in; with the request's times."""

    def __init__(self, message: str, queue_s: float = 0.0, compute_s: float = 0.0, total_s: float = 0.0) -> None:
        super().__init__(message)
        self.queue_s, self.compute_s, self.total_s = queue_s, compute_s, total_s


@dataclass
class Served:
    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_rows: int
    total_s: float = 0.0  # admission to result


@dataclass(eq=False)
class _Job:
    inputs: dict[str, np.ndarray]
    future: asyncio.Future[Served]
    priority: int
    dispatched: float = 0.0


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

    async def infer(self, inputs: dict[str, np.ndarray], rows: int, priority: int, timeout_s: float | None,
                    tenant: str = DEFAULT_TENANT) -> Served:  # fmt: skip
        """Queue one request of `tenant`, wait for its result and count its outcome. Raises Refused, ExecutionFailed
        or ValueError (bad priority)."""
        outcome = RequestOutcome(self.stats, self.scheduler.resolve_level(priority), tenant=tenant)
        try:
            future = self.admit(inputs, rows, priority, timeout_s, tenant)
        except Refused:
            outcome.refused()
            raise
        return await self.result(future, outcome)

    @staticmethod
    async def result(future: asyncio.Future[Served], outcome: RequestOutcome, *, record_local: bool = True) -> Served:
        """Wait for an admitted request's result and count it in `outcome`: `local`, `error`, or `rejected` when it
        timed out in the queue. record_local=False: a result is the caller's to count (once its answer is encoded:
        an answer that fails to encode is an `error`)."""
        try:
            served = await future
        except Refused as exc:
            outcome.ran(REJECTED, exc.waited_s, 0.0, exc.waited_s)
            raise
        except ExecutionFailed as exc:
            outcome.ran(ERROR, exc.queue_s, exc.compute_s, exc.total_s)
            raise
        if record_local:
            outcome.ran(LOCAL, served.queue_s, served.compute_s, served.total_s)
        return served

    def admit(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        priority: int,
        timeout_s: float | None,
        tenant: str = DEFAULT_TENANT,
    ) -> asyncio.Future[Served]:
        """Queue one request of `tenant` now (no await in between), or raise Refused at once; the future is its result.
        Within its level, tenants share the model by weight (`set_weights`).

        Counts nothing: the caller records the request's one outcome (`result` does, for a local run). Raises
        Refused or ValueError (bad priority, or more rows than a batch); the future may fail with Refused (timed
        out in the queue) or ExecutionFailed.
        """
        self._loop = self._loop or asyncio.get_running_loop()
        now = self._clock()
        level = self.scheduler.resolve_level(priority)
        job = _Job(inputs, self._loop.create_future(), level)
        deadline = self.scheduler.deadline_for(level, now, timeout_s)
        shape = tuple((name, a.shape[1:]) for name, a in inputs.items()) if self.batching else None
        pending = Pending(rows=rows, level=level, arrival=now, deadline=deadline, payload=job, shape=shape,
                          tenant=tenant)  # fmt: skip
        refused = self.scheduler.admit(pending, now)
        if refused is not None:
            raise Refused(refused)
        self._idle.clear()
        self._pump()
        return job.future

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights for fair share within a level, from the next batch on (a tenant left out: 1)."""
        self.scheduler.set_weights(weights)

    @property
    def utilisation(self) -> float:
        """How busy the model is: running batches plus queued requests (in batches), per instance."""
        return self.scheduler.utilisation

    def _pump(self) -> None:
        now = self._clock()
        step = self.scheduler.step(now)
        for pending in step.expired:
            job = pending.payload
            if not job.future.done():
                waited = now - pending.arrival
                job.future.set_exception(
                    Refused(Rejection("timeout", f"timed out after {waited * 1e3:.1f} ms in the queue", 1.0), waited)
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
            queue_s, total_s = job.dispatched - pending.arrival, now - pending.arrival
            if job.future.done():  # its caller gave up on it
                continue
            if result.error is not None:
                job.future.set_exception(
                    ExecutionFailed(f"inference failed: {result.error}", queue_s, result.compute_s, total_s)
                )
                continue
            assert result.outputs is not None
            job.future.set_result(Served(result.outputs[i], queue_s, result.compute_s, batch.rows, total_s))
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
        for instance in self._instances:  # a TensorRT runner frees its GPU buffers, stream and engine here
            close = getattr(instance.runner, "close", None)
            if close is not None:
                close()
