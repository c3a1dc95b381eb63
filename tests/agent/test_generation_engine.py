"""The generative engine on tiny-lm: concurrent streams, on the engine's thread, give each what it gives alone; each
ends exactly once with its reason (length, stop string, EOS, cancelled); a cancelled stream frees its blocks; a
first-token deadline that cannot be met is refused at once; draining waits for every stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.generation import BlockManager, DecoderConfig, DecoderRunner
from edge_agent.generation.engine import Chunk, GenerationEngine, GenerationRequest, Stream
from edge_agent.generation.scheduler import GenerationConfig, GenerationScheduler, Rates
from edge_agent.generation.text import TextCodec
from edge_agent.scheduling.worker import Refused
from spillway.demo.tiny_lm import TINY, build_tiny_lm_version
from tests.agent.lm_support import greedy_alone


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm_version(tmp_path_factory.mktemp("lm"), 1, TINY)


@pytest.fixture
def engine(folder: Path) -> Iterator[GenerationEngine]:
    config = DecoderConfig.load(folder)
    scheduler = GenerationScheduler(GenerationConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                     long_prefill_threshold=16), BlockManager(64, 16))  # fmt: skip
    built = GenerationEngine(
        "tiny-lm", DecoderRunner(config), TextCodec.load(folder), scheduler, context=config.context
    )
    yield built
    built.close()


async def _collect(stream: Stream) -> list[Chunk]:
    return [chunk async for chunk in stream]


def test_concurrent_streams_each_get_what_they_get_alone(engine: GenerationEngine, folder: Path) -> None:
    prompts = [engine.text.encode(p) for p in ("Hello", "The quick brown fox", "1 2 3", "a much longer prompt " * 3)]

    async def main() -> list[list[Chunk]]:
        streams = [engine.submit(GenerationRequest(prompt=p, max_tokens=10)) for p in prompts]
        return await asyncio.gather(*(_collect(s) for s in streams))

    results = asyncio.run(main())
    for prompt, chunks in zip(prompts, results, strict=True):
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        last = chunks[-1]
        expected = greedy_alone(DecoderRunner(DecoderConfig.load(folder)), prompt, 10)
        if engine.eos in expected:  # it ended early, on EOS
            expected = expected[: expected.index(engine.eos) + 1]
            assert last.finish_reason == "stop"
        else:
            assert last.finish_reason == "length"
        assert last.completion_tokens == len(expected) and last.prompt_tokens == len(prompt)
        text = "".join(c.text for c in chunks)
        assert text == engine.text.tokenizer.decode([t for t in expected if t != engine.eos], skip_special_tokens=True)
    assert engine.scheduler.idle and engine.scheduler.blocks.used_blocks == 0
    assert engine.counts == {"admitted": 4, "refused": 0, "finished": 4, "cancelled": 0}


def test_a_stop_string_ends_the_stream_before_it(engine: GenerationEngine, folder: Path) -> None:
    prompt = engine.text.encode("stop here")
    full = engine.text.tokenizer.decode(
        greedy_alone(DecoderRunner(DecoderConfig.load(folder)), prompt, 12), skip_special_tokens=True
    )
    stop = full[3:5]  # two characters the model writes
    assert stop

    async def main() -> list[Chunk]:
        # The earliest match ends it whatever the list's order: a later-matching stop listed first changes nothing.
        later = full[5:7] if full[5:7] and full[5:7] not in full[:5] else "\x00never"
        return await _collect(engine.submit(GenerationRequest(prompt=prompt, max_tokens=12, stop=(later, stop))))

    chunks = asyncio.run(main())
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == full[: full.index(stop)]


def test_a_cancelled_stream_ends_and_frees_its_blocks(engine: GenerationEngine) -> None:
    async def main() -> list[Chunk]:
        stream = engine.submit(GenerationRequest(prompt=engine.text.encode("cancel me"), max_tokens=400))
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                stream.cancel()
        return chunks

    chunks = asyncio.run(main())
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) < 400
    assert engine.scheduler.idle and engine.scheduler.blocks.used_blocks == 0 and engine.runner.caches == {}
    assert engine.counts["cancelled"] == 1


def test_an_unmeetable_first_token_deadline_is_refused_at_once(folder: Path) -> None:
    config = DecoderConfig.load(folder)
    slow = Rates(prefill_tokens_per_s=10.0, step_s=0.01)  # as measured on a very slow device
    scheduler = GenerationScheduler(GenerationConfig(), BlockManager(64, 16), slow)
    engine = GenerationEngine("tiny-lm", DecoderRunner(config), TextCodec.load(folder), scheduler,
                              context=config.context)  # fmt: skip

    async def main() -> str:
        with pytest.raises(Refused) as refused:
            engine.submit(GenerationRequest(prompt=list(range(50)), max_tokens=4, timeout_s=0.5))
        return refused.value.rejection.reason

    try:
        assert asyncio.run(main()) == "deadline_unmeetable"
        assert engine.counts["refused"] == 1 and engine.scheduler.waiting == 0
    finally:
        engine.close()


def test_draining_refuses_new_streams_and_waits_for_running_ones(engine: GenerationEngine) -> None:
    async def main() -> tuple[list[Chunk], str]:
        stream = engine.submit(GenerationRequest(prompt=engine.text.encode("drain"), max_tokens=20))
        collecting = asyncio.ensure_future(_collect(stream))
        await asyncio.sleep(0)
        await engine.drain()
        with pytest.raises(Refused) as refused:
            engine.submit(GenerationRequest(prompt=[1, 2], max_tokens=2))
        return await collecting, refused.value.rejection.reason

    chunks, reason = asyncio.run(main())
    assert chunks[-1].finish_reason in ("length", "stop") and reason == "draining"


def test_generative_telemetry_follows_the_genai_conventions(engine: GenerationEngine) -> None:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
    from spillway.contract import names

    reader = InMemoryMetricReader()
    telemetry = AgentTelemetry(TelemetrySettings(agent_id="t"), readers=[reader], probes=False)
    engine.listener = telemetry.generation("tiny-lm")
    telemetry.watch_engines(lambda: [("tiny-lm", engine.json())])

    async def main() -> list[Chunk]:
        stream = engine.submit(GenerationRequest(prompt=engine.text.encode("measure me"), max_tokens=6))
        return await _collect(stream)

    chunks = asyncio.run(main())
    with pytest.raises(ValueError, match="context"):
        asyncio.run(_submit_too_long(engine))
    data = reader.get_metrics_data()
    assert data is not None
    points = {m.name: list(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics}  # fmt: skip
    (ttft,) = points[names.GENAI_TTFT]
    assert ttft.count == 1 and tuple(ttft.explicit_bounds) == names.GENAI_TTFT_BUCKETS
    assert ttft.attributes[names.ATTR_GENAI_MODEL] == "tiny-lm"
    (tpot,) = points[names.GENAI_TPOT]
    assert tpot.count == 1 and tuple(tpot.explicit_bounds) == names.GENAI_TPOT_BUCKETS
    usage = {p.attributes[names.ATTR_GENAI_TOKEN_TYPE]: p.sum for p in points[names.GENAI_TOKEN_USAGE]}
    assert usage == {"input": len(b"measure me"), "output": chunks[-1].completion_tokens}
    outcomes = {(p.attributes[names.ATTR_PRIORITY], p.attributes[names.ATTR_OUTCOME]): p.value
                for p in points[names.REQUESTS]}  # fmt: skip
    assert outcomes == {(2, "local"): 1, (2, "rejected"): 1}  # the too-long one counted, once
    (total,) = points[names.KV_BLOCKS_TOTAL]
    assert total.value == engine.scheduler.blocks.total and points[names.KV_BLOCKS_USED][0].value == 0
    (active,) = points[names.ACTIVE_STREAMS]  # every stream ended (test_generation_policy sees running ones)
    assert active.value == 0 and dict(active.attributes or {}) == {names.ATTR_MODEL: "tiny-lm"}
    (step_tokens,) = points[names.STEP_TOKENS]  # every prompt token once, then one decode per later token
    assert step_tokens.sum == len(b"measure me") + chunks[-1].completion_tokens - 1
    assert step_tokens.count == engine.timing.steps and tuple(step_tokens.explicit_bounds) == names.STEP_TOKEN_BUCKETS
    assert engine.waiting_by_level() == [0, 0, 0]
    telemetry.shutdown()


async def _submit_too_long(engine: GenerationEngine) -> None:
    engine.submit(GenerationRequest(prompt=list(range(200)) * 3, max_tokens=8))


def test_a_pool_of_instances_spreads_streams_and_answers_for_the_model_as_one(folder: Path) -> None:
    from edge_agent.generation.pool import EnginePool

    def instance() -> GenerationEngine:
        config = DecoderConfig.load(folder)
        scheduler = GenerationScheduler(GenerationConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                         long_prefill_threshold=16), BlockManager(64, 16))  # fmt: skip
        return GenerationEngine("tiny-lm", DecoderRunner(config), TextCodec.load(folder), scheduler,
                                context=config.context)  # fmt: skip

    pool = EnginePool([instance(), instance()])
    prompts = [pool.text.encode(p) for p in ("one", "two two", "three three three", "four")]

    async def main() -> list[list[Chunk]]:
        streams = [pool.submit(GenerationRequest(prompt=p, max_tokens=40, ignore_eos=True)) for p in prompts]
        return await asyncio.gather(*(_collect(s) for s in streams))

    try:
        results = asyncio.run(main())
        admitted = [engine.counts["admitted"] for engine in pool.instances]
        assert sum(admitted) == 4 and min(admitted) >= 1  # both instances took streams
        for prompt, chunks in zip(prompts, results, strict=True):
            assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 40
            incremental = pool.text.incremental()
            for token in greedy_alone(DecoderRunner(DecoderConfig.load(folder)), prompt, 40):
                incremental.push(token)
            assert "".join(c.text for c in chunks) == incremental.text  # what it writes alone
        state = pool.json()
        assert state["instances"] == 2 and state["admitted"] == 4 and state["finished"] == 4
        assert state["kv_blocks"]["total"] == 128 and state["kv_blocks"]["used"] == 0
        assert state["steps"] == sum(e.timing.steps for e in pool.instances) and pool.waiting_by_level() == [0, 0, 0]
    finally:
        pool.close()


def test_a_request_after_the_engine_thread_ended_is_refused_never_left_waiting(engine: GenerationEngine) -> None:
    async def main() -> None:
        await _collect(engine.submit(GenerationRequest(prompt=engine.text.encode("hi"), max_tokens=2)))
        engine.close()  # the thread ends (as it does on a bug of ours, with `broken` set)
        with pytest.raises(Refused) as refused:
            engine.submit(GenerationRequest(prompt=engine.text.encode("too late"), max_tokens=2))
        assert refused.value.rejection.reason == "draining" and "closed" in refused.value.rejection.message
        assert engine.load == 0  # nothing was admitted that nobody would run

    asyncio.run(main())


def test_a_pool_asks_the_next_instance_when_one_is_full_and_counts_each_refusal_once(folder: Path) -> None:
    from edge_agent.generation.pool import EnginePool
    from edge_agent.scheduling.core import LevelPolicy

    def instance() -> GenerationEngine:
        config = DecoderConfig.load(folder)
        capped = GenerationConfig(
            max_num_seqs=1,
            max_num_batched_tokens=64,
            long_prefill_threshold=16,
            level_policies=(LevelPolicy(), LevelPolicy(max_queue_size=1), LevelPolicy()),
        )
        return GenerationEngine("tiny-lm", DecoderRunner(config), TextCodec.load(folder),
                                GenerationScheduler(capped, BlockManager(64, 16)), context=config.context)  # fmt: skip

    pool = EnginePool([instance(), instance()])

    async def main() -> tuple[list[Stream], int]:
        streams, refused = [], 0
        for _ in range(8):  # far more than 2 instances x (1 running + 1 waiting) hold
            try:
                streams.append(pool.submit(GenerationRequest(prompt=[65, 66, 67], max_tokens=300, ignore_eos=True)))
            except Refused as exc:
                assert exc.rejection.reason == "queue_full"
                refused += 1
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*(_collect(s) for s in streams))
        return streams, refused

    try:
        streams, refused = asyncio.run(main())
        admitted = [engine.counts["admitted"] for engine in pool.instances]
        assert min(admitted) >= 1 and sum(admitted) == len(streams) and len(streams) + refused == 8
        assert refused >= 4 and sum(engine.counts["refused"] for engine in pool.instances) == refused
    finally:
        pool.close()
