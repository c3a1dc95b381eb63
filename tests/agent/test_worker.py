"""The asyncio worker with a fake runner and an injected clock: splitting, failures, one outcome per request."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from edge_agent.scheduling.core import LevelPolicy, Scheduler, SchedulerConfig
from edge_agent.scheduling.worker import ExecutionFailed, ModelWorker, Refused


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Profile:
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def predict(self, batch_size: int) -> float:
        return 0.001 * batch_size

    def observe(self, batch_size: int, seconds: float) -> None:
        self.seen.append((batch_size, seconds))


class Doubler:
    """Outputs 2x the input, and records the batch sizes it was given."""

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.fail = fail

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append(len(inputs["x"]))
        if self.fail:
            raise RuntimeError("out of memory")
        return {"y": inputs["x"] * 2}


def make_worker(runner: Doubler, **config: object) -> tuple[ModelWorker, Clock]:
    clock = Clock()
    settings = {"max_batch_size": 16, "max_queue_delay_s": 0.0, "levels": (LevelPolicy(), LevelPolicy())}
    settings.update(config)
    scheduler = Scheduler(SchedulerConfig(**settings), Profile())  # type: ignore[arg-type]
    return ModelWorker(scheduler, [runner], Profile(), batching=True, clock=clock), clock


def test_a_batch_is_split_back_row_for_row() -> None:
    runner = Doubler()
    worker, _ = make_worker(runner)

    async def main() -> list[np.ndarray]:
        # Two requests of 3 rows and one of 1 row, queued while the instance is busy with a first one.
        inputs = [np.full((n, 2), float(i), np.float32) for i, n in enumerate((1, 3, 3, 1))]
        tasks = [asyncio.create_task(worker.infer({"x": x}, len(x), 0, None)) for x in inputs]
        return [(await t).outputs["y"] for t in tasks]

    outputs = asyncio.run(main())
    assert [o.shape[0] for o in outputs] == [1, 3, 3, 1]
    for i, out in enumerate(outputs):
        assert (out == 2.0 * i).all()
    assert sum(runner.batches) == 8 and len(runner.batches) < 4
    worker.close()


def test_a_failed_run_fails_every_request_of_its_batch_and_counts_each_once() -> None:
    runner = Doubler(fail=True)
    worker, _ = make_worker(runner)

    async def main() -> list[BaseException | None]:
        tasks = [asyncio.create_task(worker.infer({"x": np.ones((1, 2), np.float32)}, 1, 1, None)) for _ in range(5)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    errors = asyncio.run(main())
    assert all(isinstance(e, ExecutionFailed) and "out of memory" in str(e) for e in errors)
    assert worker.stats.outcomes == Counter({(1, "error"): 5})
    assert worker.stats.fail.count == 5
    worker.close()


def test_rejections_and_timeouts_are_outcomes_too() -> None:
    runner = Doubler()
    worker, clock = make_worker(runner, levels=(LevelPolicy(max_queue_size=1), LevelPolicy()))

    async def main() -> Counter[str]:
        x = {"x": np.ones((1, 2), np.float32)}
        results: Counter[str] = Counter()
        first = asyncio.create_task(worker.infer(x, 1, 1, None))  # dispatched at once
        await asyncio.sleep(0)
        queued = asyncio.create_task(worker.infer(x, 1, 1, None))  # waits behind it
        await asyncio.sleep(0)
        with pytest.raises(Refused) as full:
            await worker.infer(x, 1, 1, None)
        results[full.value.rejection.reason] += 1
        for task in (first, queued):
            await task
            results["served"] += 1
        return results

    results = asyncio.run(main())
    assert results == Counter({"queue_full": 1, "served": 2})
    assert worker.stats.outcomes == Counter({(1, "local"): 2, (1, "rejected"): 1})
    assert clock.now == 0.0
    worker.close()


def test_drain_waits_for_everything_queued() -> None:
    runner = Doubler()
    worker, _ = make_worker(runner)

    async def main() -> tuple[int, str]:
        tasks = [asyncio.create_task(worker.infer({"x": np.ones((1, 2), np.float32)}, 1, 0, None)) for _ in range(6)]
        await asyncio.sleep(0)
        await worker.drain()
        done = sum(t.done() for t in tasks)
        with pytest.raises(Refused) as late:
            await worker.infer({"x": np.ones((1, 2), np.float32)}, 1, 0, None)
        return done, late.value.rejection.reason

    assert asyncio.run(main()) == (6, "draining")
    worker.close()
