"""`tiny-lm`: a small decoder-only language model built from code (onnx.helper, seeded weights; no downloads, no
torch), with the I/O of Optimum's and onnxruntime-genai's exports, so that the agent's generative path runs on the
same kind of graph a real exported model has:

    inputs   input_ids [batch, seq] int64, attention_mask [batch, past + seq] int64, position_ids [batch, seq]
             int64, past_key_values.{i}.key|value [batch, kv_heads, past, head_size] float32
    outputs  logits [batch, seq, vocab] float32, present.{i}.key|value [batch, kv_heads, past + seq, head_size]

A pre-norm transformer: token and position embeddings, per layer LayerNorm -> attention (grouped-query when
`kv_heads` < `heads`) with the past concatenated on the sequence axis -> residual -> LayerNorm -> MLP (GELU, tanh
form) -> residual, a final LayerNorm and the LM head. A key takes part when its position in the whole sequence is
not after the query's (causal, by index in past + seq) and its `attention_mask` is 1, so a left-padded batch gives
each row what it gives alone. The weights are random: the text it writes is noise, but deterministic, and KV-cached
decoding must give what full recomputation gives.

`genai_config.json` describes it the way onnxruntime-genai's model builder does (`model.decoder.inputs`,
`outputs`, `head_size`, `num_key_value_heads`, ...), so one loader reads both.

`attention="gqa"` builds the attention the way that builder does (`-e cpu`), so CI covers that path without torch:
one packed QKV MatMul into onnxruntime's `com.microsoft` GroupQueryAttention with rotary positions (`do_rotary`,
cos/sin caches; no position embeddings and no `position_ids` input), fed `seqlens_k = ReduceSum(attention_mask) - 1`
(int32) and `total_sequence_length = Shape(attention_mask)[1]` computed in the graph. The kernel reads each row's
past from position 0 up to its own length: a batch of caches is right-padded. `kv_dtype="float16"` makes the KV
inputs and outputs half precision (Casts around the attention; the logits stay float32). Its head size must be a
multiple of 16, as the kernel's rotary requires. The default graph (and its seeded weights) does not change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spillway.demo.models import IR_VERSION, OPSET, SEED, _write_atomically

if TYPE_CHECKING:
    import onnx

TINY_LM = "tiny-lm"
# The byte-level tokenizer's special tokens, after the 256 bytes (ids 0-255 are the bytes themselves).
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS, PAD = 256, 257, 258
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's sizes. Bytes of KV cache per token: 2 x layers x kv_heads x head_size x 4 (float32)."""

    vocab: int = 320  # 256 bytes + a few special tokens, as the byte-level tokenizer needs
    width: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    context: int = 512
    mlp: int = 4  # the MLP's width, in multiples of `width`

    def __post_init__(self) -> None:
        if self.width % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"width {self.width} must split into {self.heads} heads, in groups of {self.kv_heads}")

    @property
    def head_size(self) -> int:
        return self.width // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * 4


TINY = DecoderShape()  # version 1
TINY_LITE = DecoderShape(layers=1)  # version 2, "lite": one layer, for degradation
BENCH = DecoderShape(width=512, layers=4, heads=8, kv_heads=4, context=1024)  # compute dominates the step


class _Graph:
    """Nodes and initialisers, with fresh names."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, value: Any, hint: str = "c", dtype: Any = np.float32) -> str:
        name = self.name(hint)
        self.initializers.append(self.numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, kind: str, *inputs: str, hint: str | None = None, output: str | None = None, **attributes: Any) -> str:
        out = output or self.name(hint or kind.lower())
        self.nodes.append(self.helper.make_node(kind, list(inputs), [out], **attributes))
        return out


def build_tiny_lm(shape: DecoderShape = TINY, *, seed: int = SEED, attention: str = "matmul",
                  kv_dtype: str = "float32") -> onnx.ModelProto:  # fmt: skip
    """The decoder as an ONNX graph (opset 17) with seeded random weights; `attention` "matmul" (the default) or
    "gqa" (onnxruntime's GroupQueryAttention, as onnxruntime-genai's builder emits it; `kv_dtype` float32 or
    float16)."""
    import onnx
    from onnx import TensorProto, helper

    if attention not in ("matmul", "gqa") or kv_dtype not in ("float32", "float16"):
        raise ValueError(f"attention is 'matmul' or 'gqa' and kv_dtype 'float32' or 'float16', not {attention!r}, "
                         f"{kv_dtype!r}")  # fmt: skip
    gqa = attention == "gqa"
    if not gqa and kv_dtype != "float32":
        raise ValueError("a float16 KV cache needs attention='gqa'")
    if gqa and shape.head_size % 16:
        raise ValueError(f"GroupQueryAttention's rotary needs a head size that is a multiple of 16, not "
                         f"{shape.head_size}")  # fmt: skip
    rng = np.random.default_rng(seed + shape.layers * 1000 + shape.width)
    g = _Graph()
    width, head, heads, kv_heads = shape.width, shape.head_size, shape.heads, shape.kv_heads

    def weight(rows: int, cols: int, hint: str) -> str:
        return g.const(rng.standard_normal((rows, cols)) / np.sqrt(rows), hint)

    if gqa:
        return _build_gqa(g, shape, rng, weight, half=kv_dtype == "float16")
    i64 = np.int64
    zero, one = g.const([0], "zero", i64), g.const([1], "one", i64)
    tokens = g.op("Gather", g.const(rng.standard_normal((shape.vocab, width)) * 0.5, "wte"), "input_ids")
    positions = g.op("Gather", g.const(rng.standard_normal((shape.context, width)) * 0.1, "wpe"), "position_ids")
    x = g.op("Add", tokens, positions, hint="embed")

    # The mask, shared by every layer: key j is seen from query i when j <= past + i and attention_mask[b, j] = 1.
    ids_shape = g.op("Shape", "input_ids")
    seq = g.op("Gather", ids_shape, one, axis=0)  # [1]
    total = g.op("Gather", g.op("Shape", "attention_mask"), one, axis=0)
    past = g.op("Sub", total, seq)
    scalar = g.const([], "scalar_shape", i64)
    query_index = g.op("Range", g.op("Reshape", past, scalar), g.op("Reshape", total, scalar),
                       g.const(1, "step", i64))  # fmt: skip
    key_index = g.op("Range", g.const(0, "start", i64), g.op("Reshape", total, scalar), g.const(1, "step", i64))
    causal = g.op("LessOrEqual", g.op("Unsqueeze", key_index, zero), g.op("Unsqueeze", query_index, one))  # [s, t]
    padding = g.op("Cast", g.op("Unsqueeze", "attention_mask", g.const([1, 2], "axes", i64)), to=TensorProto.BOOL)
    allowed = g.op("And", causal, padding, hint="allowed")  # [b, 1, s, t]
    blocked = g.const(-1e9, "blocked")
    scale = g.const(1.0 / np.sqrt(head), "scale")

    def layer_norm(value: str, hint: str) -> str:
        return g.op("LayerNormalization", value, g.const(np.ones(width), f"{hint}_g"),
                    g.const(np.zeros(width), f"{hint}_b"), axis=-1, epsilon=1e-5)  # fmt: skip

    def split_heads(value: str, count: int) -> str:  # [b, s, count * head] -> [b, count, s, head]
        shaped = g.op("Reshape", value, g.const([0, 0, count, head], "heads_shape", i64))
        return g.op("Transpose", shaped, perm=[0, 2, 1, 3])

    for i in range(shape.layers):
        normed = layer_norm(x, f"ln{i}a")
        q = split_heads(g.op("MatMul", normed, weight(width, heads * head, f"wq{i}")), heads)
        k = split_heads(g.op("MatMul", normed, weight(width, kv_heads * head, f"wk{i}")), kv_heads)
        v = split_heads(g.op("MatMul", normed, weight(width, kv_heads * head, f"wv{i}")), kv_heads)
        # The graph's outputs are the Concat's own (no Identity copy of the cache).
        present_k = g.op("Concat", PAST_KEY % i, k, axis=2, output=PRESENT_KEY % i)
        present_v = g.op("Concat", PAST_VALUE % i, v, axis=2, output=PRESENT_VALUE % i)
        # Grouped-query attention: each KV head serves heads / kv_heads query heads. The query heads of a group
        # share one matrix product with their KV head, and the cache is never transposed or repeated: the scores
        # come out as K q^T [b, kv, t, groups * s] and only they are transposed.
        groups = heads // kv_heads
        batch = g.op("Slice", ids_shape, zero, one)
        kv_group = g.const([kv_heads, groups], "groups", i64)
        head_dim = g.const([head], "head", i64)
        qg = g.op("Reshape", q, g.op("Concat", batch, kv_group, seq, head_dim, axis=0))  # [b, kv, groups, s, head]
        qt = g.op("Reshape", g.op("Transpose", qg, perm=[0, 1, 4, 2, 3]),
                  g.const([0, kv_heads, head, -1], "qt_shape", i64))  # fmt: skip  # [b, kv, head, groups * s]
        scores_t = g.op("MatMul", present_k, qt)  # [b, kv, t, groups * s]
        scores_t = g.op("Reshape", scores_t, g.op("Concat", batch, g.const([kv_heads, -1, groups], "st_shape", i64),
                                                  seq, axis=0))  # fmt: skip  # [b, kv, t, groups, s]
        scores = g.op("Mul", g.op("Transpose", scores_t, perm=[0, 1, 3, 4, 2]), scale)  # [b, kv, groups, s, t]
        scores = g.op("Where", g.op("Unsqueeze", allowed, one), scores, blocked)
        probs = g.op("Reshape", g.op("Softmax", scores, axis=-1), g.op("Concat", batch, g.const([kv_heads, -1],
                     "probs_shape", i64), total, axis=0))  # fmt: skip  # [b, kv, groups * s, t]
        attended = g.op("MatMul", probs, present_v)  # [b, kv, groups * s, head]
        merged = g.op("Reshape", g.op("Transpose", g.op("Reshape", attended, g.op(
            "Concat", g.op("Slice", ids_shape, zero, one), g.const([heads], "nheads", i64), seq,
            g.const([head], "head", i64), axis=0)), perm=[0, 2, 1, 3]),
            g.const([0, 0, width], "merge_shape", i64))  # fmt: skip
        x = g.op("Add", x, g.op("MatMul", merged, weight(width, width, f"wo{i}")), hint=f"attn_res{i}")
        hidden = g.op("MatMul", layer_norm(x, f"ln{i}b"), weight(width, shape.mlp * width, f"w1{i}"))
        # GELU, tanh form: 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))
        cubic = g.op("Mul", g.op("Mul", g.op("Mul", hidden, hidden), hidden), g.const(0.044715))
        inner = g.op("Mul", g.op("Add", hidden, cubic), g.const(np.sqrt(2 / np.pi)))
        gelu = g.op("Mul", g.op("Mul", hidden, g.const(0.5)), g.op("Add", g.op("Tanh", inner), g.const(1.0)))
        x = g.op("Add", x, g.op("MatMul", gelu, weight(shape.mlp * width, width, f"w2{i}")), hint=f"mlp_res{i}")
    g.op("MatMul", layer_norm(x, "ln_f"), weight(width, shape.vocab, "lm_head"), output="logits")
    kv: list[str | int | None] = ["batch", kv_heads, "past_sequence_length", head]
    present: list[str | int | None] = ["batch", kv_heads, "total_sequence_length", head]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence_length"]),
    ]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence_length", shape.vocab])]
    for i in range(shape.layers):
        inputs += [helper.make_tensor_value_info(PAST_KEY % i, TensorProto.FLOAT, kv),
                   helper.make_tensor_value_info(PAST_VALUE % i, TensorProto.FLOAT, kv)]  # fmt: skip
        outs += [helper.make_tensor_value_info(PRESENT_KEY % i, TensorProto.FLOAT, present),
                 helper.make_tensor_value_info(PRESENT_VALUE % i, TensorProto.FLOAT, present)]  # fmt: skip
    graph = helper.make_graph(g.nodes, TINY_LM, inputs, outs, g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="spillway")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _build_gqa(g: _Graph, shape: DecoderShape, rng: np.random.Generator, weight: Any, *,
               half: bool) -> onnx.ModelProto:  # fmt: skip
    """`build_tiny_lm(attention="gqa")`: the attention as onnxruntime-genai's builder writes it."""
    import onnx
    from onnx import TensorProto, helper

    width, head, heads, kv_heads = shape.width, shape.head_size, shape.heads, shape.kv_heads
    x = g.op("Gather", g.const(rng.standard_normal((shape.vocab, width)) * 0.5, "wte"), "input_ids")
    kv_type = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    one = g.const([1], "one", np.int64)
    # What the builder's attn_mask_reformat subgraph computes: each row's tokens - 1, and the mask's width.
    tokens = g.op("ReduceSum", "attention_mask", one, keepdims=0)
    seqlens_k = g.op("Cast", g.op("Sub", tokens, one), to=TensorProto.INT32)
    total = g.op("Cast", g.op("Gather", g.op("Shape", "attention_mask"), one, axis=0), to=TensorProto.INT32)
    inverse = 1.0 / 10000 ** (np.arange(0, head, 2) / head)
    angles = np.arange(shape.context)[:, None] * inverse[None, :]  # [context, head / 2]
    kv_np = np.float16 if half else np.float32
    cos, sin = g.const(np.cos(angles), "cos_cache", kv_np), g.const(np.sin(angles), "sin_cache", kv_np)

    def layer_norm(value: str, hint: str) -> str:
        return g.op("LayerNormalization", value, g.const(np.ones(width), f"{hint}_g"),
                    g.const(np.zeros(width), f"{hint}_b"), axis=-1, epsilon=1e-5)  # fmt: skip

    for i in range(shape.layers):
        qkv = g.op("MatMul", layer_norm(x, f"ln{i}a"), weight(width, (heads + 2 * kv_heads) * head, f"wqkv{i}"))
        if half:
            qkv = g.op("Cast", qkv, to=TensorProto.FLOAT16)
        attended = g.name(f"gqa{i}")
        g.nodes.append(helper.make_node(
            "GroupQueryAttention", [qkv, "", "", PAST_KEY % i, PAST_VALUE % i, seqlens_k, total, cos, sin],
            [attended, PRESENT_KEY % i, PRESENT_VALUE % i], domain="com.microsoft", num_heads=heads,
            kv_num_heads=kv_heads, scale=1.0 / np.sqrt(head), do_rotary=1, local_window_size=-1))  # fmt: skip
        if half:
            attended = g.op("Cast", attended, to=TensorProto.FLOAT)
        x = g.op("Add", x, g.op("MatMul", attended, weight(width, width, f"wo{i}")), hint=f"attn_res{i}")
        hidden = g.op("MatMul", layer_norm(x, f"ln{i}b"), weight(width, shape.mlp * width, f"w1{i}"))
        silu = g.op("Mul", hidden, g.op("Sigmoid", hidden))  # Llama's MLP activation, as the builder writes it
        x = g.op("Add", x, g.op("MatMul", silu, weight(shape.mlp * width, width, f"w2{i}")))
    g.nodes.append(helper.make_node("MatMul", [layer_norm(x, "ln_f"), weight(width, shape.vocab, "lm_head")],
                                    ["logits"]))  # fmt: skip
    kv: list[str | int | None] = ["batch", kv_heads, "past_sequence_length", head]
    present: list[str | int | None] = ["batch", kv_heads, "total_sequence_length", head]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_sequence_length"]),
    ]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence_length", shape.vocab])]
    for i in range(shape.layers):
        inputs += [helper.make_tensor_value_info(PAST_KEY % i, kv_type, kv),
                   helper.make_tensor_value_info(PAST_VALUE % i, kv_type, kv)]  # fmt: skip
        outs += [helper.make_tensor_value_info(PRESENT_KEY % i, kv_type, present),
                 helper.make_tensor_value_info(PRESENT_VALUE % i, kv_type, present)]  # fmt: skip
    graph = helper.make_graph(g.nodes, TINY_LM, inputs, outs, g.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="spillway")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def genai_config(shape: DecoderShape, *, eos: int = EOS, bos: int = BOS, pad: int = PAD,
                 position_ids: bool = True) -> dict[str, Any]:  # fmt: skip
    """onnxruntime-genai's `genai_config.json` for the decoder (its model builder's field names); the builder's
    GroupQueryAttention exports name no `position_ids`."""
    names = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids"}
    if not position_ids:
        del names["position_ids"]
    return {
        "model": {
            "type": "spillway-tiny-lm",
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "context_length": shape.context,
            "vocab_size": shape.vocab,
            "decoder": {
                "filename": "model.onnx",
                "head_size": shape.head_size,
                "hidden_size": shape.width,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.kv_heads,
                "num_hidden_layers": shape.layers,
                "inputs": {**names, "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
                "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
            },
        },
        "search": {"max_length": shape.context, "do_sample": False, "num_beams": 1},
        "spillway": {"shape": asdict(shape)},
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters, which the ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]  # fmt: skip
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_tokenizer() -> Any:
    """A byte-level tokenizer (Hugging Face `tokenizers`): token i < 256 is byte i, then `SPECIALS`; any text
    encodes, and decoding gives back its bytes exactly."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tokenizer


def build_tiny_lm_version(out: Path, version: int, shape: DecoderShape, *, seed: int = SEED, attention: str = "matmul",
                          kv_dtype: str = "float32") -> Path:  # fmt: skip
    """Write `out/<version>/`: `model.onnx`, `genai_config.json`, `tokenizer.json` and `tokenizer_config.json` (its
    chat template, as Hugging Face models ship it); returns the version's folder. `attention` and `kv_dtype` as for
    `build_tiny_lm`."""
    folder = out / str(version)
    model = build_tiny_lm(shape, seed=seed, attention=attention, kv_dtype=kv_dtype)
    _write_atomically(folder / "model.onnx", model.SerializeToString())
    described = genai_config(shape, position_ids=attention == "matmul")
    _write_atomically(folder / "genai_config.json", (json.dumps(described, indent=2) + "\n").encode())
    _write_atomically(folder / "tokenizer.json", build_tokenizer().to_str().encode())
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
              "pad_token": SPECIALS[2]}  # fmt: skip
    _write_atomically(folder / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())
    return folder
