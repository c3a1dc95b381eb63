"""`tiny-lm`, the decoder built from code for the generative path: a real onnxruntime session on it decodes with a KV
cache exactly as full recomputation does, and a left-padded batch gives each row what it gives alone. Its
GroupQueryAttention variant has the I/O of onnxruntime-genai's builder (tests/agent/test_decoder_runner.py runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from spillway.demo.tiny_lm import (
    PAST_KEY,
    PAST_VALUE,
    PRESENT_KEY,
    TINY,
    TINY_LITE,
    DecoderShape,
    build_tiny_lm,
    build_tiny_lm_version,
)

TOLERANCE = 1e-4  # float32 through a few layers; the "around 1e-5" on logits of unit scale


def _session(shape: DecoderShape) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(build_tiny_lm(shape).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _empty_past(shape: DecoderShape, batch: int) -> dict[str, np.ndarray]:
    empty = np.zeros((batch, shape.kv_heads, 0, shape.head_size), np.float32)
    return {name % i: empty for i in range(shape.layers) for name in (PAST_KEY, PAST_VALUE)}


def _run(session: ort.InferenceSession, shape: DecoderShape, ids: np.ndarray, mask: np.ndarray,
         past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:  # fmt: skip
    """One call: `ids` [b, s] after the past, `mask` [b, past + s]; positions count only unmasked tokens."""
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
    names = [o.name for o in session.get_outputs()]
    outputs = session.run(names, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past})
    found = dict(zip(names, outputs, strict=True))
    present = {
        (PAST_KEY if ".key" in n else PAST_VALUE) % int(n.split(".")[1]): a for n, a in found.items() if n != "logits"
    }
    return found["logits"], present


@pytest.mark.parametrize("shape", [TINY, TINY_LITE], ids=["tiny", "lite"])
def test_kv_cached_decoding_equals_full_recomputation(shape: DecoderShape) -> None:
    session = _session(shape)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 256, size=(1, 12), dtype=np.int64)
    full, _ = _run(session, shape, tokens, np.ones_like(tokens), _empty_past(shape, 1))

    prompt = 5
    logits, past = _run(session, shape, tokens[:, :prompt], np.ones((1, prompt), np.int64), _empty_past(shape, 1))
    assert np.abs(logits - full[:, :prompt]).max() < TOLERANCE
    for t in range(prompt, tokens.shape[1]):  # then one token at a time, with the cache
        logits, past = _run(session, shape, tokens[:, t : t + 1], np.ones((1, t + 1), np.int64), past)
        assert np.abs(logits[:, 0] - full[:, t]).max() < TOLERANCE
        assert past[PAST_KEY % 0].shape == (1, shape.kv_heads, t + 1, shape.head_size)
    assert np.abs(full).max() > 0.1  # logits of unit scale: the comparison above means something


def test_a_left_padded_batch_equals_each_row_alone() -> None:
    shape = TINY
    session = _session(shape)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, size=n, dtype=np.int64) for n in (3, 9, 6)]
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), 258, np.int64)  # the pad token
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    batch_logits, batch_past = _run(session, shape, ids, mask, _empty_past(shape, len(prompts)))
    nexts = batch_logits[:, -1].argmax(axis=-1).astype(np.int64)[:, None]
    step_logits, _ = _run(session, shape, nexts, np.concatenate([mask, np.ones_like(nexts)], axis=1), batch_past)
    for row, prompt in enumerate(prompts):
        alone, alone_past = _run(session, shape, prompt[None], np.ones((1, len(prompt)), np.int64),
                                 _empty_past(shape, 1))  # fmt: skip
        assert np.abs(batch_logits[row, -1] - alone[0, -1]).max() < TOLERANCE
        assert int(nexts[row, 0]) == int(alone[0, -1].argmax())
        step_alone, _ = _run(session, shape, nexts[row : row + 1], np.ones((1, len(prompt) + 1), np.int64), alone_past)
        assert np.abs(step_logits[row, 0] - step_alone[0, 0]).max() < TOLERANCE


def test_the_genai_config_describes_the_graph(tmp_path: Path) -> None:
    folder = build_tiny_lm_version(tmp_path, 1, TINY)
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    session = ort.InferenceSession(str(folder / decoder["filename"]), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    layers = decoder["num_hidden_layers"]
    assert layers == TINY.layers and decoder["head_size"] * decoder["num_attention_heads"] == decoder["hidden_size"]
    for i in range(layers):
        for name in (decoder["inputs"]["past_key_names"] % i, decoder["inputs"]["past_value_names"] % i):
            assert inputs[name].shape[1] == decoder["num_key_value_heads"] and inputs[name].shape[3] == TINY.head_size
        assert decoder["outputs"]["present_key_names"] % i in outputs and PRESENT_KEY % i in outputs
    assert {decoder["inputs"][k] for k in ("input_ids", "attention_mask", "position_ids")} <= set(inputs)
    assert config["model"]["vocab_size"] == TINY.vocab and config["model"]["context_length"] == TINY.context
    assert TINY.kv_bytes_per_token == 2 * 3 * 2 * 24 * 4


def test_shapes_that_do_not_split_into_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="must split"):
        DecoderShape(width=100, heads=3)
    with pytest.raises(ValueError, match="must split"):
        DecoderShape(heads=4, kv_heads=3)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_the_gqa_variant_has_the_model_builders_io(tmp_path: Path, kv_dtype: str) -> None:
    shape = DecoderShape(width=64, layers=2, heads=4, kv_heads=2, context=128)
    folder = build_tiny_lm_version(tmp_path, 1, shape, attention="gqa", kv_dtype=kv_dtype)
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    assert "position_ids" not in decoder["inputs"]  # the builder's GQA exports take positions from the mask
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.type for i in session.get_inputs()}
    outputs = {o.name: o.type for o in session.get_outputs()}
    kv = "tensor(float16)" if kv_dtype == "float16" else "tensor(float)"
    assert inputs == {"input_ids": "tensor(int64)", "attention_mask": "tensor(int64)",
                      **{name % i: kv for i in range(shape.layers) for name in (PAST_KEY, PAST_VALUE)}}  # fmt: skip
    assert outputs["logits"] == "tensor(float)" and outputs[PRESENT_KEY % 1] == kv
    attention = [n for n in build_tiny_lm(shape, attention="gqa").graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == shape.layers and {n.domain for n in attention} == {"com.microsoft"}
    with pytest.raises(ValueError, match="multiple of 16"):
        build_tiny_lm(TINY, attention="gqa")  # head size 24
    with pytest.raises(ValueError, match="needs attention='gqa'"):
        build_tiny_lm(TINY, kv_dtype="float16")
