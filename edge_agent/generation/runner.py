"""A decoder on a plain onnxruntime session, with explicit `past_key_values` in and `present` out (the I/O of
Optimum's and onnxruntime-genai's exports, described by `genai_config.json`).

Each sequence keeps its own cache, one array per layer for keys and one for values, shaped
[1, kv_heads, tokens, head_size]. Two calls:

- `prefill(sequence, tokens)`: a prompt, or a chunk of one, for one sequence, after what it holds already;
- `decode(sequences, tokens)`: one token for each of many sequences in one session call. The caches of different
  lengths are padded to the longest (mask 0 on the padding), so every row computes what it would alone; each row's
  cache is then cut back to its own tokens.

Where the padding goes depends on the attention the graph is built from (`DecoderRunner.padding`):

- attention from MatMul, Softmax and the mask (Optimum's exports, tiny-lm) concatenates the past and the new token
  and masks what is padding: the caches are LEFT-padded, so every row's new token lands in the last column;
- onnxruntime's `GroupQueryAttention` (com.microsoft; what onnxruntime-genai's model builder emits) ignores the mask's
  layout: the graph turns it into `seqlens_k = sum(mask) - 1` per row and `total_sequence_length` = its width, and
  the kernel reads row b's past at positions 0 .. seqlens_k[b] - 1, writes the new token at seqlens_k[b] and takes
  the rotary position from there. Its caches are RIGHT-padded; left-padded, the shorter rows attend to the padding
  and miss their last tokens (logits off by ~1 on a random Llama). Such exports have no `position_ids` input.

The KV arrays have the model's type (float32 or float16, from its past input), the integer inputs too; an input the
model lacks (`position_ids`) is not fed.

Both return the logits of each sequence's last token. The gather and scatter of the caches around a decode call
are the copies this layout costs (measured by the benchmark); a persistent batch buffer can replace them later
without changing this interface. Not thread-safe: one engine thread owns a runner.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edge_agent.errors import AgentError
from edge_agent.generation.blocks import KvShape

__all__ = ["DecoderConfig", "DecoderRunner", "GenerationConfigError", "SequenceCache"]


class GenerationConfigError(AgentError, ValueError):
    """A `genai_config.json` (or its model) the agent cannot serve; the message names the file and the field."""


@dataclass(frozen=True)
class DecoderConfig:
    """What the runner needs from `genai_config.json`."""

    path: Path  # the model file
    layers: int
    kv_heads: int
    head_size: int
    vocab: int
    context: int
    eos_ids: tuple[int, ...]  # `eos_token_id`: one id, or a list (a chat model's turn end as well as its EOS)
    pad: int
    names: dict[str, str]  # input_ids, attention_mask, position_ids (fed only where the model has it), logits
    past_key: str  # "%d" templates
    past_value: str
    present_key: str
    present_value: str

    @property
    def kv(self) -> KvShape:
        return KvShape(self.layers, self.kv_heads, self.head_size)

    @classmethod
    def load(cls, folder: Path) -> DecoderConfig:
        source = folder / "genai_config.json"
        try:
            raw = json.loads(source.read_text())
            model = raw["model"]
            decoder = model["decoder"]
            inputs, outputs = decoder["inputs"], decoder["outputs"]
            eos = _token_ids("eos_token_id", model["eos_token_id"])
            return cls(
                path=folder / decoder.get("filename", "model.onnx"),
                layers=int(decoder["num_hidden_layers"]),
                kv_heads=int(decoder.get("num_key_value_heads", decoder["num_attention_heads"])),
                head_size=int(decoder["head_size"]),
                vocab=int(model["vocab_size"]),
                context=int(model["context_length"]),
                eos_ids=eos,
                pad=_token_ids("pad_token_id", model["pad_token_id"])[0] if "pad_token_id" in model else eos[0],
                names={
                    "input_ids": inputs.get("input_ids", "input_ids"),
                    "attention_mask": inputs.get("attention_mask", "attention_mask"),
                    "position_ids": inputs.get("position_ids", "position_ids"),
                    "logits": outputs.get("logits", "logits"),
                },
                past_key=inputs["past_key_names"],
                past_value=inputs["past_value_names"],
                present_key=outputs["present_key_names"],
                present_value=outputs["present_value_names"],
            )
        except OSError as exc:
            raise GenerationConfigError(f"{source}: cannot read it: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise GenerationConfigError(f"{source}: not valid JSON ({exc})") from None
        except KeyError as exc:
            raise GenerationConfigError(f"{source}: the field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise GenerationConfigError(f"{source}: {exc}") from None


def _token_ids(field: str, value: Any) -> tuple[int, ...]:
    """A token id field of `genai_config.json`: an int or a non-empty list of ints."""
    ids = tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
    if not ids:
        raise ValueError(f"{field} is an empty list")
    return ids


# The element types of a decoder's inputs that the runner feeds (onnxruntime's names).
_NUMPY_TYPES: dict[str, type[np.generic]] = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
                                             "tensor(int64)": np.int64, "tensor(int32)": np.int32}  # fmt: skip


def _padding_side(path: Path) -> Literal["left", "right"]:
    """Where a batched decode pads the shorter caches: right for onnxruntime's GroupQueryAttention (it reads each
    row's past from position 0 up to its own length), left for attention built from MatMul and a mask."""
    import onnx  # deferred, like onnxruntime; the graph only (the builder keeps its weights in model.onnx.data)

    graph = onnx.load(str(path), load_external_data=False).graph
    return "right" if any(node.op_type == "GroupQueryAttention" for node in graph.node) else "left"


@dataclass
class SequenceCache:
    """One sequence's KV cache: per layer, keys and values [1, kv_heads, tokens, head_size]."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[2])


class DecoderRunner:
    """One onnxruntime session on a decoder, and the caches of the sequences it runs."""

    def __init__(self, config: DecoderConfig, *, threads: int = 1, providers: list[str] | None = None) -> None:
        import onnxruntime as ort  # deferred: importing the generation package does not load onnxruntime

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.config = config
        try:
            self.session = ort.InferenceSession(str(config.path), options,
                                                providers=providers or ["CPUExecutionProvider"])  # fmt: skip
        except Exception as exc:  # onnxruntime's own errors have no common base worth naming
            raise GenerationConfigError(f"{config.path}: onnxruntime cannot load it: {exc}") from None
        self._outputs = [o.name for o in self.session.get_outputs()]
        inputs = {i.name: i.type for i in self.session.get_inputs()}
        needed = [config.names["input_ids"], config.names["attention_mask"]] + [
            t % i for i in range(config.layers) for t in (config.past_key, config.past_value)]  # fmt: skip
        absent = [name for name in needed if name not in inputs]
        if absent:
            raise GenerationConfigError(f"{config.path}: the model has no input {absent[0]!r} (genai_config.json)")
        types = {name: _NUMPY_TYPES.get(inputs[name]) for name in needed}
        unserved = [name for name, kind in types.items() if kind is None]
        if unserved:
            raise GenerationConfigError(f"{config.path}: the input {unserved[0]!r} is {inputs[unserved[0]]}, "
                                        "which the runner does not feed")  # fmt: skip
        self.kv_dtype = np.dtype(types[config.past_key % 0])  # float32, or float16 for a half-precision export
        self._ids_dtype = np.dtype(types[config.names["input_ids"]])
        self._mask_dtype = np.dtype(types[config.names["attention_mask"]])
        positions = inputs.get(config.names["position_ids"])
        self._positions_dtype = None if positions is None else np.dtype(_NUMPY_TYPES.get(positions, np.int64))
        self.padding = _padding_side(config.path)  # of a batched decode's caches
        expected = {config.names["logits"]} | {t % i for i in range(config.layers)
                                               for t in (config.present_key, config.present_value)}  # fmt: skip
        missing = sorted(expected - set(self._outputs))
        if missing:
            raise GenerationConfigError(f"{config.path}: the model has no output {missing[0]!r} (genai_config.json)")
        self.caches: dict[Any, SequenceCache] = {}
        self._empty = np.zeros((1, config.kv_heads, 0, config.head_size), self.kv_dtype)
        self.run_s = 0.0  # seconds in session.run, all calls: the model's share of a step

    def _run(self, ids: np.ndarray, mask: np.ndarray, past: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        c = self.config
        feed: dict[str, np.ndarray] = {
            c.names["input_ids"]: ids.astype(self._ids_dtype, copy=False),
            c.names["attention_mask"]: mask.astype(self._mask_dtype, copy=False),
        }
        if self._positions_dtype is not None:  # a token's position counts the unmasked tokens before it
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
            feed[c.names["position_ids"]] = positions.astype(self._positions_dtype, copy=False)
        for i, (k, v) in enumerate(past):
            feed[c.past_key % i], feed[c.past_value % i] = k, v
        started = time.perf_counter()
        try:
            return dict(zip(self._outputs, self.session.run(self._outputs, feed), strict=True))
        finally:
            self.run_s += time.perf_counter() - started

    def _presents(self, found: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
        c = self.config
        return [(found[c.present_key % i], found[c.present_value % i]) for i in range(c.layers)]

    def prefill(self, sequence: Any, tokens: list[int]) -> np.ndarray:
        """Run `tokens` for one sequence after its cache (a new sequence has none); the last token's logits."""
        if not tokens:
            raise ValueError("a prefill needs at least one token")
        cache = self.caches.setdefault(sequence, SequenceCache())
        held = cache.tokens
        past = [(cache.keys[i], cache.values[i]) for i in range(self.config.layers)] if held else [
            (self._empty, self._empty)] * self.config.layers  # fmt: skip
        ids = np.asarray([tokens], np.int64)
        found = self._run(ids, np.ones((1, held + len(tokens)), np.int64), past)
        presents = self._presents(found)
        cache.keys = [k for k, _ in presents]
        cache.values = [v for _, v in presents]
        return np.asarray(found[self.config.names["logits"]][0, -1], np.float32)

    def decode(self, sequences: list[Any], tokens: list[int]) -> np.ndarray:
        """One token for each sequence (each holds a cache already), in one call; logits [len(sequences), vocab]."""
        c = self.config
        caches = [self.caches[s] for s in sequences]
        lengths = [cache.tokens for cache in caches]
        longest = max(lengths)
        batch = len(sequences)
        right = self.padding == "right"
        # Row r's past lies at `held[r]`, its new token's mask column is 1; `kept[r]` is where its present lies after.
        held = [slice(0, n) if right else slice(longest - n, longest) for n in lengths]
        kept = [slice(0, n + 1) if right else slice(longest - n, longest + 1) for n in lengths]
        mask = np.zeros((batch, longest + 1), np.int64)
        for row, where in enumerate(kept):
            mask[row, where] = 1
        past: list[tuple[np.ndarray, np.ndarray]] = []
        for i in range(c.layers):
            keys = np.zeros((batch, c.kv_heads, longest, c.head_size), self.kv_dtype)
            values = np.zeros_like(keys)
            for row, cache in enumerate(caches):
                keys[row, :, held[row]] = cache.keys[i][0]
                values[row, :, held[row]] = cache.values[i][0]
            past.append((keys, values))
        found = self._run(np.asarray(tokens, np.int64)[:, None], mask, past)
        presents = self._presents(found)
        for row, cache in enumerate(caches):
            cache.keys = [np.ascontiguousarray(k[row : row + 1, :, kept[row]]) for k, _ in presents]
            cache.values = [np.ascontiguousarray(v[row : row + 1, :, kept[row]]) for _, v in presents]
        return np.asarray(found[c.names["logits"]][:, -1], np.float32)

    def release(self, sequence: Any) -> None:
        """Forget a sequence's cache (it ended, or was preempted: a recompute starts from its tokens again)."""
        self.caches.pop(sequence, None)
