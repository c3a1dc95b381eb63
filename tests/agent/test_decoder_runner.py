"""The decoder runner on a real onnxruntime session: sequences that join mid-flight, with prompts of different
lengths and prefilled in chunks, decode in one batch exactly what each decodes alone (continuous batching keeps
greedy output unchanged), and a preempted sequence recomputed from its tokens goes on as if never preempted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_agent.generation.runner import DecoderConfig, DecoderRunner, GenerationConfigError
from spillway.demo.tiny_lm import TINY, build_tiny_lm_version
from tests.agent.lm_support import greedy_alone


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> DecoderRunner:
    folder = build_tiny_lm_version(tmp_path_factory.mktemp("tiny-lm"), 1, TINY)
    return DecoderRunner(DecoderConfig.load(folder))


def test_sequences_joining_mid_flight_decode_what_each_decodes_alone(runner: DecoderRunner) -> None:
    rng = np.random.default_rng(5)
    prompts = {name: rng.integers(0, 256, size=n).tolist() for name, n in (("a", 4), ("b", 19), ("c", 9), ("d", 1))}
    joins = {"a": 0, "b": 2, "c": 2, "d": 5}  # the step at which each arrives
    steps = 8
    expected = {name: greedy_alone(runner, prompt, steps) for name, prompt in prompts.items()}

    produced: dict[str, list[int]] = {name: [] for name in prompts}
    running: list[str] = []
    for step in range(20):
        for name in [n for n, at in joins.items() if at == step]:  # a new sequence: its prompt in chunks of 8
            prompt = prompts[name]
            for start in range(0, len(prompt), 8):
                logits = runner.prefill(name, prompt[start : start + 8])
            produced[name].append(int(logits.argmax()))
            running.append(name)
        active = [n for n in running if len(produced[n]) < steps]
        if active:
            logits = runner.decode(active, [produced[n][-1] for n in active])
            for row, name in enumerate(active):
                produced[name].append(int(logits[row].argmax()))
        for name in [n for n in running if len(produced[n]) >= steps]:
            runner.release(name)
            running.remove(name)
    assert produced == expected
    assert runner.caches == {}


def test_a_preempted_sequence_recomputed_goes_on_as_before(runner: DecoderRunner) -> None:
    prompt = list(range(40, 52))
    expected = greedy_alone(runner, prompt, 10)
    produced = [int(runner.prefill("p", prompt).argmax())]
    for _ in range(4):
        produced.append(int(runner.decode(["p"], [produced[-1]])[0].argmax()))
    runner.release("p")  # preempted: its blocks and cache are gone; recompute from the tokens it has
    produced.append(int(runner.prefill("p", prompt + produced[:-1] + [produced[-1]]).argmax()))
    while len(produced) < 10:
        produced.append(int(runner.decode(["p"], [produced[-1]])[0].argmax()))
    runner.release("p")
    assert produced == expected


def test_a_config_that_does_not_fit_is_refused_naming_the_field(tmp_path: Path) -> None:
    folder = build_tiny_lm_version(tmp_path, 1, TINY)
    config = json.loads((folder / "genai_config.json").read_text())
    del config["model"]["decoder"]["head_size"]
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(GenerationConfigError, match="'head_size' is missing"):
        DecoderConfig.load(folder)
    (folder / "genai_config.json").write_text("{")
    with pytest.raises(GenerationConfigError, match="not valid JSON"):
        DecoderConfig.load(folder)
    good = build_tiny_lm_version(tmp_path / "other", 1, TINY)
    config = json.loads((good / "genai_config.json").read_text())
    config["model"]["decoder"]["outputs"]["present_key_names"] = "kv.%d.k"
    (good / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(GenerationConfigError, match=r"no output 'kv\.0\.k'"):
        DecoderRunner(DecoderConfig.load(good))
