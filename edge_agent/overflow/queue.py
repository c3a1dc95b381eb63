"""The async queue: requests accepted with 202 and a job id, kept on disk (`jobs.JobStore`), run when the model
has room, and fetched later at `GET /spillway/v1/jobs/{id}`.

A job runs at the model's lowest priority level and without a deadline, only while the model's utilisation is
below `drain_below`, so jobs never take the device from live traffic. Its answer is stored as a JSON V2 response.
A job the agent could not start (refused by admission) goes back to the queue; one whose run failed is retried
(at most three attempts). Jobs are counted once, as `queued_async`, when they are accepted.

When the disk refuses a write (full, say), nothing crashes and nothing is held in memory but job ids: `submit`
raises StoreUnavailable (the app answers 503 with its reason); a run whose end cannot be written (its answer, a
failure, a requeue) stays `running` on disk while this process remembers how it ended, and the drain loop writes
that first, claiming nothing new, once the disk takes writes again. A run whose answer could not be stored counts as
a failed attempt and is run again (failed after `max_attempts`). Each kind of write (accepting jobs, updating them)
logs one line when it starts failing and one when it works again, however many requests came between.

Jobs of models the registry does not hold (the generative ones) run through a `JobRunner` that their API registers
in `runners`: it says when the model has room, and starts a job's stored request (for a generative model, the
completion's JSON is the job's answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from edge_agent.failures import FailureStreak, cancelled
from edge_agent.overflow.jobs import Job, JobNotRunning, JobStore, StoreUnavailable
from edge_agent.scheduling.worker import ExecutionFailed, Refused
from spillway.contract.v2 import RequestedOutput, TensorError, decode_request, encode_response, validate_inputs

if TYPE_CHECKING:
    from edge_agent.serving.models import ModelRegistry

log = logging.getLogger("spillway.agent.jobs")

EXPIRE_EVERY_S = 10.0
STORAGE_RETRY_S = 1.0  # while the store refuses writes, the drain loop tries it again this often
T = TypeVar("T")


class Unservable(Exception):
    """A job's request cannot be served any more (its model or version is gone, or it no longer fits): it fails."""


class JobRunner(Protocol):
    """Runs the jobs of one model the registry does not hold."""

    def has_room(self) -> bool:
        """Whether a job may start now without taking the device from live traffic."""
        ...

    def start(self, job: Job) -> Awaitable[bytes]:
        """Admit the job's request now (raising Refused to be queued again, Unservable to fail it); the awaitable is
        its JSON answer, or raises Refused / ExecutionFailed for a run that failed (tried again)."""
        ...


@dataclass(frozen=True)
class _End:
    """How a run ended, as the store must record it: `error` None is a requeue (it could not start), else a failure,
    queued again with `retry`."""

    job_id: str
    error: str | None = None
    retry: bool = False


class AsyncQueue:
    """The job store plus the loop that drains it."""

    def __init__(
        self,
        store: JobStore,
        registry: ModelRegistry,
        models: Collection[str],
        *,
        drain_below: float = 0.5,
        poll_s: float = 0.05,
        allow_non_finite: bool = True,
    ) -> None:
        self.store = store
        self.registry = registry
        self.models = frozenset(models)
        self.drain_below = drain_below
        self.poll_s = poll_s
        self.allow_non_finite = allow_non_finite
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._unsettled: dict[str, _End] = {}  # job id -> how its run ended, which the disk refused to record
        self.runners: dict[str, JobRunner] = {}  # models the registry does not hold, by name
        self.accepting = FailureStreak(
            log,
            "the async queue cannot store new jobs; the requests it would take are refused: {error} "
            "(logged again once it works)",
            "the async queue stores new jobs again after {failures} failed write(s)",
        )
        self.updating = FailureStreak(
            log,
            "the async queue cannot update its jobs; it runs none until it can: {error} (logged again once it works)",
            "the async queue updates its jobs again after {failures} failed write(s)",
        )
        self.ran = 0
        self.failed = 0

    def accepts(self, model: str) -> bool:
        return model in self.models

    async def submit(self, model: str, version: str | None, body: bytes, header_length: int | None) -> Job:
        """Durable when it returns; raises jobs.QueueFull when the queue is at its bound, jobs.StoreUnavailable
        (StoreFull) when the disk refuses the write."""
        try:
            job = await asyncio.to_thread(self.store.submit, model, version, body, header_length)
        except StoreUnavailable as exc:
            self.accepting.failed(exc)
            raise
        self.accepting.worked()
        return job

    async def get(self, job_id: str) -> Job | None:
        return await asyncio.to_thread(self.store.get, job_id)

    # ---- draining ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain_forever(), name="spillway-jobs")

    async def stop(self) -> None:
        await cancelled(self._task)
        self._task = None
        for task in list(self._running):  # a job cut short is "running" on disk: the next start requeues it
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        with contextlib.suppress(StoreUnavailable):  # a last try; what stays "running" is requeued at the next start
            await self._record_unsettled()
        await asyncio.to_thread(self.store.close)

    def _has_room(self) -> list[str]:
        """The models a job may run on now."""
        room = []
        for name in self.models:
            runner = self.runners.get(name)
            if runner is not None:
                if runner.has_room():
                    room.append(name)
                continue
            try:
                model, _ = self.registry.route(name, None)
            except Exception:  # noqa: S112 (a model not served any more: its jobs wait, and expire)
                continue
            if model.worker.utilisation < self.drain_below and not model.worker.scheduler.draining:
                room.append(name)
        return room

    async def _drain_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_expiry = 0.0
        while True:
            started = 0
            try:
                await self._record_unsettled()  # before anything new: these jobs are "running" on disk
                if loop.time() >= next_expiry:
                    expired = await self._write(self.store.expire)
                    if expired:
                        self.updating.worked()
                        log.info("%d job(s) expired", expired)
                    next_expiry = loop.time() + EXPIRE_EVERY_S
                started = await self._start_some()
            except asyncio.CancelledError:
                raise
            except StoreUnavailable:  # counted and logged (once per streak) by _write; the disk gets a moment
                await asyncio.sleep(STORAGE_RETRY_S)
                continue
            except Exception:  # a bug of ours: the loop must outlive it
                log.exception("the job queue's drain step failed")
            await asyncio.sleep(0 if started else self.poll_s)

    async def _start_some(self) -> int:
        room = self._has_room()
        if not room:
            return 0
        job = await self._write(self.store.claim, room)
        if job is None:
            return 0
        self.updating.worked()
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        await asyncio.sleep(0)  # let it reach admission, so the next utilisation reading counts it
        return 1

    async def _run(self, job: Job) -> None:
        """Run a claimed job and record how it ended: done, failed, or queued again. Never raises for the disk: an
        end it cannot record now is recorded by the drain loop once it can, so no job stays `running` for good."""
        try:
            runner = self.runners.get(job.model)
            response = self._admit(job) if runner is None else runner.start(job)
        except Unservable as exc:
            self.failed += 1
            await self._settle(_End(job.id, str(exc)))
            return
        except Refused:
            await self._settle(_End(job.id))
            return
        try:
            body = await response
        except (Refused, ExecutionFailed) as exc:
            self.failed += 1
            await self._settle(_End(job.id, str(exc), retry=True))
            return
        try:
            await self._write(self.store.finish, job.id, body)
        except ValueError as exc:  # an answer the store cannot keep: the job fails rather than staying "running"
            self.failed += 1
            await self._settle(_End(job.id, f"the answer could not be stored: {exc}"))
            return
        except StoreUnavailable as exc:  # run again later, rather than hold answers in memory until the disk frees
            self.failed += 1
            await self._settle(_End(job.id, f"its answer could not be stored: {exc}", retry=True))
            return
        self.updating.worked()
        self.ran += 1

    async def _write(self, write: Callable[..., T], *args: Any) -> T:
        """One write to the store, off the event loop; a refusal of the disk is counted in `updating` and raised.
        (A success is not counted here: a claim or an expiry that found nothing to change wrote nothing.)"""
        try:
            return await asyncio.to_thread(write, *args)
        except StoreUnavailable as exc:
            self.updating.failed(exc)
            raise

    def _record(self, end: _End) -> None:
        if end.error is None:
            self.store.requeue(end.job_id)
        else:
            self.store.fail(end.job_id, end.error, retry=end.retry)

    async def _settle(self, end: _End) -> None:
        try:
            await self._write(self._record, end)
        except StoreUnavailable:
            self._unsettled[end.job_id] = end
            return
        except JobNotRunning:  # ended some other way meanwhile: nothing is left to record
            return
        self.updating.worked()

    async def _record_unsettled(self) -> None:
        """Write the ends the disk refused earlier, oldest first; raises StoreUnavailable while it still refuses."""
        for end in list(self._unsettled.values()):
            with contextlib.suppress(JobNotRunning):
                await self._write(self._record, end)
                self.updating.worked()
            del self._unsettled[end.job_id]

    def _admit(self, job: Job) -> asyncio.Future[bytes]:
        """Queue the job's request on its model (lowest level, no deadline); the future is the JSON answer."""
        assert job.request is not None
        try:
            model, _ = self.registry.route(job.model, job.version)
            request = decode_request(job.request, job.header_length)
            config = model.config
            rows = validate_inputs(request.inputs, config.inputs, config.max_batch_size,
                                   allow_non_finite=self.allow_non_finite)  # fmt: skip
        except (TensorError, ValueError, LookupError) as exc:
            raise Unservable(f"the request cannot be served any more: {exc}") from None
        lowest = len(model.worker.scheduler.config.levels)
        inputs = {i.name: i.array for i in request.inputs}
        served = model.worker.admit(inputs, rows, lowest, None)  # counted once already, when it was accepted
        requested = None if request.outputs is None else [RequestedOutput(o.name, False) for o in request.outputs]
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()

        def done(future: asyncio.Future[Any]) -> None:
            if answer.done():
                return
            if future.exception() is not None:
                answer.set_exception(future.exception())  # type: ignore[arg-type]
                return
            try:
                body, binary = encode_response(
                    model_name=config.name, model_version=str(model.version), request_id=request.id,
                    outputs=future.result().outputs, specs=config.outputs, requested=requested, binary_default=False,
                    parameters={"spillway_outcome": "queued_async", "spillway_job_id": job.id},
                )  # fmt: skip
            except Exception as exc:
                answer.set_exception(ExecutionFailed(f"encoding the answer failed: {exc}"))
                return
            if binary is not None:
                answer.set_exception(ExecutionFailed("the answer has outputs JSON cannot carry (non-UTF-8 BYTES)"))
                return
            answer.set_result(body)

        served.add_done_callback(done)
        return answer

    def json(self) -> dict[str, Any]:
        """The queue's state; a store the disk refuses to read leaves the counts out (None), not the whole status."""
        try:
            counts: dict[str, int] | None = self.store.counts()
        except StoreUnavailable:
            counts = None
        return {"models": sorted(self.models), "drain_below": self.drain_below, "running": len(self._running),
                "ran": self.ran, "failed": self.failed, "unrecorded_ends": len(self._unsettled),
                "store": {"accepting": self.accepting.json(), "updating": self.updating.json()},
                "opened": self.store.opened, "counts": counts}  # fmt: skip
