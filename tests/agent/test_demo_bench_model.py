"""`spillway models build-demo --size bench`: the wider decoder the generation benchmark runs on, alone in its
repository, loads as a generative model and decodes with its cache as a whole prefill does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from edge_agent.generation.runner import DecoderConfig, DecoderRunner
from edge_agent.runtime.repository import generative_models
from spillway.cli import app
from spillway.demo.models import BENCH_LM
from spillway.demo.tiny_lm import BENCH


def test_build_demo_size_bench_writes_the_bench_decoder_alone(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["models", "build-demo", "--out", str(tmp_path), "--size", "bench"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [BENCH_LM]  # nothing else for an agent to serve
    assert set(generative_models(tmp_path)) == {BENCH_LM}

    config = DecoderConfig.load(tmp_path / BENCH_LM / "1")
    assert (config.layers, config.kv_heads, config.head_size, config.context) == (
        BENCH.layers, BENCH.kv_heads, BENCH.head_size, BENCH.context)  # fmt: skip
    runner = DecoderRunner(config, threads=1)
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    runner.prefill("cached", prompt[:-1])
    cached = runner.decode(["cached"], [prompt[-1]])[0]
    whole = runner.prefill("whole", prompt)
    assert cached.shape == (BENCH.vocab,)
    np.testing.assert_allclose(cached, whole, atol=1e-4)
