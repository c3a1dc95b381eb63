"""The decoder runner on a real onnxruntime session: sequences that join mid-flight, with prompts of different
lengths and prefilled in chunks, decode in one batch exactly what each decodes alone (continuous batching keeps
greedy output unchanged), and a preempted sequence recomputed from its tokens goes on as if never preempted. The
decode batch persists between steps: it changes only when who decodes changes (rows that leave are dropped in place,
unless the longest goes; a join gathers it again), what leaves it is freed, and a failed step leaves it usable.

Each runs on tiny-lm's two attentions: MatMul and a mask (left-padded batches), and onnxruntime's GroupQueryAttention
as onnxruntime-genai's model builder emits it (right-padded batches, no position_ids, a float16 KV cache too)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np
import pytest

from edge_agent.config import GenerationSettings
from edge_agent.generation.load import load_engine
from edge_agent.generation.runner import DecoderConfig, DecoderRunner, GenerationConfigError
from spillway.demo.tiny_lm import TINY, DecoderShape, build_tiny_lm_version
from tests.agent.lm_support import greedy_alone

GQA_SHAPE = DecoderShape(width=64, layers=2, heads=4, kv_heads=2, context=128)  # the rotary needs head size 16k
# (attention, kv_dtype) -> what the runner must pick up from the graph: the padding side and the cache's type
VARIANTS = {"matmul": ("matmul", "float32"), "gqa": ("gqa", "float32"), "gqa-fp16": ("gqa", "float16")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DecoderRunner:
    attention, kv_dtype = VARIANTS[request.param]
    shape = TINY if attention == "matmul" else GQA_SHAPE
    folder = build_tiny_lm_version(tmp_path_factory.mktemp("tiny-lm"), 1, shape, attention=attention,
                                   kv_dtype=kv_dtype)  # fmt: skip
    built = DecoderRunner(DecoderConfig.load(folder))
    assert built.padding == ("left" if attention == "matmul" else "right")
    assert built.kv_dtype == np.dtype(kv_dtype)
    assert built.kv.bytes_per_token == 2 * shape.layers * shape.kv_heads * shape.head_size * built.kv_dtype.itemsize
    return built


def _alone(runner: DecoderRunner, prompt: list[int], steps: int) -> list[np.ndarray]:
    """The logits of each of `steps` greedy tokens of `prompt` decoded alone (the first from its prefill)."""
    logits = [runner.prefill("alone", prompt)]
    while len(logits) < steps:
        logits.append(runner.decode(["alone"], [int(logits[-1].argmax())])[0])
    runner.release("alone")
    return logits


def test_the_batch_is_gathered_only_when_who_decodes_changes_and_every_row_decodes_as_alone(
    runner: DecoderRunner,
) -> None:
    rng = np.random.default_rng(11)
    prompts = {name: rng.integers(0, 256, size=n).tolist() for name, n in (("a", 6), ("b", 21), ("c", 3), ("d", 13),
                                                                            ("e", 9))}  # fmt: skip
    steps = 12
    tolerance = 1e-4 if runner.kv_dtype == np.float32 else 1e-3
    alone = {name: _alone(runner, prompt, steps) for name, prompt in prompts.items()}
    joins = {"a": 0, "b": 0, "c": 2, "d": 5, "e": 9}
    preempt = {"b": 6}  # released, and prefilled again from its tokens at the next step (the engine's recompute)
    pause = {
        "c": (7, 8)
    }  # kept, but not decoded at these steps (a short token budget): it leaves the batch and returns
    produced: dict[str, list[int]] = {name: [] for name in prompts}
    running: list[str] = []
    recompute: list[str] = []
    regroups, changes, decodes, last = runner.rebuilds + runner.drops, 0, 0, None
    for step in range(30):
        touched = False  # a sequence of the batch was released or prefilled: its row is stale
        for name in recompute:
            known = prompts[name] + produced[name][:-1]
            for start in range(0, len(known), 8):
                runner.prefill(name, known[start : start + 8])
            running.append(name)
        recompute.clear()
        for name in [n for n, at in joins.items() if at == step]:
            for start in range(0, len(prompts[name]), 8):  # chunked prefill beside the running decode
                logits = runner.prefill(name, prompts[name][start : start + 8])
            assert np.abs(logits - alone[name][0]).max() < tolerance
            produced[name].append(int(logits.argmax()))
            running.append(name)
        for name in [n for n, at in preempt.items() if at == step]:
            runner.release(name)
            running.remove(name)
            recompute.append(name)
            touched = True
        active = [n for n in running if len(produced[n]) < steps and step not in pause.get(n, ())]
        if active:
            changes += active != last or touched
            logits = runner.decode(active, [produced[n][-1] for n in active])
            decodes += 1
            for row, name in enumerate(active):
                assert np.abs(logits[row] - alone[name][len(produced[name])]).max() < tolerance, (step, name)
                produced[name].append(int(logits[row].argmax()))
                assert runner.caches[name].tokens == len(prompts[name]) + len(produced[name]) - 1
            last = active
        for name in [n for n in running if len(produced[n]) >= steps]:
            runner.release(name)
            running.remove(name)
    assert produced == {name: [int(lg.argmax()) for lg in logits] for name, logits in alone.items()}
    assert runner.caches == {}
    # Every other step fed last step's presents as they were; a change gathered the batch, or dropped rows in it.
    assert runner.rebuilds + runner.drops - regroups == changes
    assert (changes, decodes) == (10, 20)


def test_what_leaves_the_batch_keeps_none_of_it_alive(runner: DecoderRunner) -> None:
    for row, n in enumerate((5, 9, 2)):
        runner.prefill(row, list(range(10, 10 + n)))
    prefilled = weakref.ref(runner.caches[2].keys[0])
    runner.decode([0, 1, 2], [1, 2, 3])
    assert prefilled() is None  # in the batch, its row holds its tokens: the array of its prefill went
    runner.release(0)
    runner.decode([1, 2], [4, 5])
    kept = runner.caches[2].keys[0].copy()
    runner.decode([1], [6])  # 2 leaves the batch but keeps its cache: a copy of its own, not a view of the batch
    assert runner.caches[2].keys[0].base is None and np.array_equal(runner.caches[2].keys[0], kept)
    assert runner.caches[2].tokens == 4 and runner.caches[1].tokens == 12
    batch = weakref.ref(runner.caches[1].keys[0].base)  # the batch's array: a sequence in it reads a view of it
    runner.release(1)
    assert batch() is None  # nobody is left in the batch: it went at once, not at some later decode
    runner.release(2)
    assert runner.caches == {}


def test_rows_that_leave_are_dropped_in_place_unless_the_longest_goes(runner: DecoderRunner) -> None:
    rng = np.random.default_rng(17)
    prompts = {name: rng.integers(0, 256, size=n).tolist() for name, n in (("a", 5), ("b", 14), ("c", 9), ("d", 3))}
    tolerance = 1e-4 if runner.kv_dtype == np.float32 else 1e-3
    alone = {name: _alone(runner, prompt, 8) for name, prompt in prompts.items()}
    produced = {name: [int(runner.prefill(name, prompt).argmax())] for name, prompt in prompts.items()}

    def step(names: list[str]) -> None:
        logits = runner.decode(names, [produced[name][-1] for name in names])
        for row, name in enumerate(names):  # in the caller's order, whatever the rows' order
            assert np.abs(logits[row] - alone[name][len(produced[name])]).max() < tolerance, (names, name)
            produced[name].append(int(logits[row].argmax()))

    step(["a", "b", "c", "d"])
    rebuilds, drops = runner.rebuilds, runner.drops
    last = weakref.ref(runner.caches["b"].keys[0].base)  # last step's presents: the batch's arrays
    runner.release("a")  # the first row, not the longest: the last row moves into its place
    step(["b", "c", "d"])
    assert last() is None  # the released row went with the arrays of the step before
    step(["d", "c", "b"])  # the same rows in another order
    step(["d", "b"])  # c pauses (a short token budget) and keeps its cache: a copy of its row
    assert runner.caches["c"].keys[0].base is None
    assert runner.caches["c"].tokens == len(prompts["c"]) + len(produced["c"]) - 1
    assert (runner.rebuilds, runner.drops) == (rebuilds, drops + 3)
    step(["b", "c", "d"])  # c joins again: gathered
    assert (runner.rebuilds, runner.drops) == (rebuilds + 1, drops + 3)
    runner.release("b")  # the longest: its columns would be padding in every row left, so gathered without them
    step(["c", "d"])
    assert (runner.rebuilds, runner.drops) == (rebuilds + 2, drops + 3)
    assert runner.caches["c"].keys[0].base.shape[2] == runner.caches["c"].tokens > runner.caches["d"].tokens
    for name in "cd":
        runner.release(name)
    assert runner.caches == {}


def test_after_a_failed_step_the_caches_are_as_before_it(runner: DecoderRunner) -> None:
    rng = np.random.default_rng(23)
    sizes = (("a", 4), ("b", 11), ("c", 7), ("d", 19), ("e", 16))
    prompts = {name: rng.integers(0, 256, size=n).tolist() for name, n in sizes}
    tolerance = 1e-4 if runner.kv_dtype == np.float32 else 1e-3
    alone = {name: _alone(runner, prompt, 3) for name, prompt in prompts.items()}
    produced = {name: [int(runner.prefill(name, prompts[name]).argmax())] for name in "abcd"}

    def step(names: str) -> None:
        logits = runner.decode(list(names), [produced[name][-1] for name in names])
        for row, name in enumerate(names):
            assert np.abs(logits[row] - alone[name][len(produced[name])]).max() < tolerance, (names, name)
            produced[name].append(int(logits[row].argmax()))

    step("abcd")
    runner.release("d")  # the longest: the next step gathers a, b and c again
    with pytest.raises(Exception, match="out of data bounds"):  # a token the model has no embedding for
        runner.decode(["a", "b", "c"], [produced["a"][-1], 10**6, produced["c"][-1]])
    # That step's past, gathered into the runner's scratch, holds b's and c's rows still: the next gather reads them
    # from there, into rows of another width.
    runner.release("a")
    produced["e"] = [int(runner.prefill("e", prompts["e"]).argmax())]
    step("bce")
    for name in "bce":
        runner.release(name)
    assert runner.caches == {}


def test_the_kv_budget_counts_the_exports_own_bytes_per_value(tmp_path: Path) -> None:
    settings = GenerationSettings(kv_budget_bytes=64 * 16 * GQA_SHAPE.kv_bytes_per_token, block_size=16)
    blocks = {}
    for kv_dtype in ("float32", "float16"):
        folder = build_tiny_lm_version(tmp_path / kv_dtype, 1, GQA_SHAPE, attention="gqa", kv_dtype=kv_dtype)
        pool = load_engine("lm", folder, settings, free_bytes=1 << 30)
        blocks[kv_dtype] = pool.instances[0].scheduler.blocks.total
        pool.close()
    assert blocks == {"float32": 64, "float16": 128}  # 2 bytes a value: twice the tokens in the same bytes


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


def test_batched_decode_of_different_lengths_gives_each_row_its_logits_alone(runner: DecoderRunner) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (3, 11, 7, 1)]
    alone = []
    for row, prompt in enumerate(prompts):
        runner.prefill(("alone", row), prompt)
        alone.append(runner.decode([("alone", row)], [row + 5])[0])
        runner.release(("alone", row))
    for row, prompt in enumerate(prompts):
        for start in range(0, len(prompt), 4):  # chunked prefill: each chunk after the cache the last one left
            runner.prefill(row, prompt[start : start + 4])
    batched = runner.decode(list(range(len(prompts))), [row + 5 for row in range(len(prompts))])
    for row, prompt in enumerate(prompts):
        assert np.abs(batched[row] - alone[row]).max() < 1e-4
        assert runner.caches[row].tokens == len(prompt) + 1
        assert runner.caches[row].keys[0].dtype == runner.kv_dtype
        runner.release(row)
    assert batched.dtype == np.float32 and np.abs(batched).max() > 0.5  # logits of unit scale: the check means more


def test_kv_cached_decoding_equals_full_recomputation(runner: DecoderRunner) -> None:
    tokens = np.random.default_rng(9).integers(0, 256, size=12).tolist()
    # float32 agrees to ~1e-6; float16 keys and values may round differently when a whole prompt is recomputed.
    tolerance = 1e-4 if runner.kv_dtype == np.float32 else 1e-3
    cached = [runner.prefill("cached", tokens[:5])]
    cached += [runner.decode(["cached"], [token])[0] for token in tokens[5:]]
    runner.release("cached")
    for end, logits in enumerate(cached, start=5):
        full = runner.prefill("full", tokens[:end])
        runner.release("full")
        assert np.abs(logits - full).max() < tolerance
        assert int(logits.argmax()) == int(full.argmax())


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
    config = json.loads((folder := build_tiny_lm_version(tmp_path / "third", 1, TINY)).joinpath("genai_config.json")
                        .read_text())  # fmt: skip
    config["model"]["decoder"]["inputs"]["input_ids"] = "tokens"  # inputs are named as the config says
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(GenerationConfigError, match="no input 'tokens'"):
        DecoderRunner(DecoderConfig.load(folder))


def test_eos_token_id_may_be_a_list_of_stop_ids(tmp_path: Path) -> None:
    folder = build_tiny_lm_version(tmp_path, 1, TINY)
    assert DecoderConfig.load(folder).eos_ids == (257,)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [257, 262]  # a chat model's EOS and its turn end, as builders write them
    del config["model"]["pad_token_id"]
    (folder / "genai_config.json").write_text(json.dumps(config))
    loaded = DecoderConfig.load(folder)
    assert loaded.eos_ids == (257, 262) and loaded.pad == 257
    config["model"]["eos_token_id"] = []
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(GenerationConfigError, match="eos_token_id is an empty list"):
        DecoderConfig.load(folder)
