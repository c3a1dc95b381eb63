"""A decoder on a plain onnxruntime session, with explicit `past_key_values` in and `present` out (the I/O of
Optimum's and onnxruntime-genai's exports, described by `genai_config.json`).

Each sequence keeps its own cache, one array per layer for keys and one for values, shaped
[1, kv_heads, tokens, head_size]. Two calls:

- `prefill(sequence, tokens)`: a prompt, or a chunk of one, for one sequence, after what it holds already;
- `decode(sequences, tokens)`: one token for each of many sequences in one session call. The caches of different
  lengths are padded to the longest (mask 0 on the padding), so every row computes what it would alone.

Where the padding goes depends on the attention the graph is built from (`DecoderRunner.padding`):

- attention from MatMul, Softmax and the mask (Optimum's exports, tiny-lm) concatenates the past and the new token
  and masks what is padding: the caches are LEFT-padded, so every row's new token lands in the last column;
- onnxruntime's `GroupQueryAttention` (com.microsoft; what onnxruntime-genai's model builder emits) ignores the mask's
  layout: the graph turns it into `seqlens_k = sum(mask) - 1` per row and `total_sequence_length` = its width, and
  the kernel reads row b's past at positions 0 .. seqlens_k[b] - 1, writes the new token at seqlens_k[b] and takes
  the rotary position from there. Its caches are RIGHT-padded; left-padded, the shorter rows attend to the padding
  and miss their last tokens (logits off by ~1 on a random Llama). Such exports have no `position_ids` input.

The decode batch persists between steps. While the same sequences decode (the steady state), last step's `present`
arrays are the next step's past as they are, the mask one column wider: nothing is copied outside the session call.
When who decodes changes:

- rows only leave (released, paused by the token budget, prefilled again) and one that stays is still the longest
  (no column becomes padding for every row): the batch is kept; the last rows that stay are moved into the holes and
  the arrays cut to the rows left (`drops` counts these); the caller's order may then differ from the rows' order,
  and the tokens in and logits out are permuted (a reordering alone is free too);
- otherwise (a sequence joins after its prefill, or the longest leaves): the batch is gathered again from the rows
  that stay and the caches of those that join, with the padding columns that every row has trimmed (`rebuilds`
  counts them), into a scratch buffer the runner keeps for it (sized for the largest batch so far, a quarter more;
  freed when no row is left). New arrays are zeroed, and page-faulted where the allocator maps fresh pages: 8 rows
  of 100-300 tokens on the BENCH tiny-lm took 2.5-13 ms into new arrays, 2.2 ms into the scratch. The scratch is the
  past of the step right after a rebuild only: that step's presents are new arrays, so the next rebuild may write
  over it (where that step failed, the batch is in it still, and the next rebuild takes new scratch).

A sequence in the batch has no arrays of its own: its `SequenceCache` reads its row, and the row is copied out only
when it leaves the batch without being released or is prefilled again. A released row's data lives in the batch
until the next step (or goes with the batch when no row is left). Chunks and the decode batch stay two session
calls: a chunk row would pad every decode row to the chunk's length (2.5-9x the time of two calls on the BENCH
tiny-lm with chunks of 16-128 tokens), and GroupQueryAttention writes every row's new tokens contiguously after its
past, so it cannot hold padded decode rows at all.

The KV arrays have the model's type (float32 or float16, from its past input), the integer inputs too; an input the
model lacks (`position_ids`) is not fed.

Both return the logits of each sequence's last token. Not thread-safe: one engine thread owns a runner.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
        """At 4 bytes a value: the config does not say the export's type; `DecoderRunner.kv` does."""
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


_GONE = object()  # a batch row whose sequence left it (released, or prefilled again): the next decode regroups


class _Batch:
    """The decode batch kept between steps: per layer keys and values [rows, kv_heads, width, head_size] (last step's
    `present`, the next step's past), each row's token count, and which sequence each row is."""

    __slots__ = ("caches", "keys", "lengths", "members", "order", "padding", "values", "wanted")

    def __init__(self, members: list[Any], caches: list[SequenceCache], lengths: np.ndarray, keys: list[np.ndarray],
                 values: list[np.ndarray], padding: Literal["left", "right"]) -> None:  # fmt: skip
        self.members = members  # in row order; _GONE where the row's sequence left
        self.caches = caches
        self.lengths = lengths  # int64 [rows]
        self.keys = keys
        self.values = values
        self.padding = padding
        self.wanted: list[Any] | None = list(members)  # the sequences as the last decode named them; None: stale
        self.order: np.ndarray | None = None  # the row of each of `wanted`; None: row i is wanted[i]

    def span(self, row: int) -> slice:
        """The columns that hold the row's tokens."""
        width, held = int(self.keys[0].shape[2]), int(self.lengths[row])
        return slice(0, held) if self.padding == "right" else slice(width - held, width)


class SequenceCache:
    """One sequence's KV cache: per layer, keys and values [1, kv_heads, tokens, head_size]. Arrays of its own, or,
    while the sequence decodes in the runner's batch, views of its row there (read-only; valid for that step)."""

    __slots__ = ("_keys", "_slot", "_values")

    def __init__(self) -> None:
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._slot: tuple[_Batch, int] | None = None  # its row in the decode batch

    @property
    def tokens(self) -> int:
        if self._slot is not None:
            batch, row = self._slot
            return int(batch.lengths[row])
        return 0 if not self._keys else int(self._keys[0].shape[2])

    @property
    def keys(self) -> list[np.ndarray]:
        return self._keys if self._slot is None else self._row(self._slot[0].keys)

    @property
    def values(self) -> list[np.ndarray]:
        return self._values if self._slot is None else self._row(self._slot[0].values)

    def _row(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Its row of the batch's per-layer `arrays`, [1, kv_heads, tokens, head_size] views."""
        assert self._slot is not None
        batch, row = self._slot
        return [a[row : row + 1, :, batch.span(row)] for a in arrays]

    def _arrays(self) -> list[np.ndarray]:
        """Its keys then its values, each [kv_heads, tokens, head_size]: what a rebuild copies."""
        if self._slot is None:
            return [a[0] for a in (*self._keys, *self._values)]
        batch, row = self._slot
        at = batch.span(row)
        return [a[row, :, at] for a in (*batch.keys, *batch.values)]

    def _own(self, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        self._keys, self._values, self._slot = keys, values, None

    def _join(self, batch: _Batch, row: int) -> None:
        self._keys, self._values, self._slot = [], [], (batch, row)  # its own arrays go: the row holds its tokens


class DecoderRunner:
    """One onnxruntime session on a decoder, and the caches of the sequences it runs."""

    def __init__(self, config: DecoderConfig, *, threads: int = 1,
                 providers: Sequence[str | tuple[str, dict[str, str]]] | None = None) -> None:  # fmt: skip
        import onnxruntime as ort  # deferred: importing the generation package does not load onnxruntime

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.config = config
        try:
            self.session = ort.InferenceSession(str(config.path), options,
                                                providers=list(providers or ["CPUExecutionProvider"]))  # fmt: skip
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
        self._batch: _Batch | None = None  # the decode batch of the last step
        self.rebuilds = 0  # decode batches gathered from the caches: a join, or the longest row left
        self.drops = 0  # changes of who decodes (or in what order) served in the batch: rows left, none joined
        self._scratch: np.ndarray | None = None  # flat: what rebuilds gather into (keys then values, per layer)

    @property
    def kv(self) -> KvShape:
        """What one token costs in this model's cache, at the KV arrays' own type (2 bytes a value in float16)."""
        return replace(self.config.kv, dtype_bytes=self.kv_dtype.itemsize)

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
        self._leave(cache, keep=True)  # its row would be stale: the next decode rebuilds the batch
        held = cache.tokens
        past = list(zip(cache.keys, cache.values, strict=True)) if held else [
            (self._empty, self._empty)] * self.config.layers  # fmt: skip
        ids = np.asarray([tokens], np.int64)
        found = self._run(ids, np.ones((1, held + len(tokens)), np.int64), past)
        presents = self._presents(found)
        cache._own([k for k, _ in presents], [v for _, v in presents])
        return np.asarray(found[self.config.names["logits"]][0, -1], np.float32)

    def decode(self, sequences: list[Any], tokens: list[int]) -> np.ndarray:
        """One token for each sequence (each holds a cache already), in one call; logits [len(sequences), vocab]."""
        if not sequences:
            raise ValueError("a decode needs at least one sequence")
        if len(tokens) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences decode, but {len(tokens)} tokens were given")
        batch = self._batch
        wanted = list(sequences)
        if batch is None or batch.padding != self.padding or batch.wanted != wanted:
            batch = self._regroup(wanted)
        # The steady state: last step's presents are this step's past; each row gains its new token's column.
        lengths = batch.lengths + 1
        columns = np.arange(batch.keys[0].shape[2] + 1)
        if batch.padding == "right":
            mask = columns[None, :] < lengths[:, None]
        else:
            mask = columns[None, :] >= (len(columns) - lengths)[:, None]
        fed = np.asarray(tokens, np.int64)
        if batch.order is not None:  # the rows are in another order than the caller's
            fed = np.empty_like(fed)
            fed[batch.order] = tokens
        found = self._run(fed[:, None], mask.astype(np.int64), list(zip(batch.keys, batch.values, strict=True)))
        presents = self._presents(found)
        # A GroupQueryAttention present is max(total_sequence_length, past) wide: the mask's width here, as concat's.
        batch.keys, batch.values = [k for k, _ in presents], [v for _, v in presents]
        batch.lengths = lengths
        logits = found[self.config.names["logits"]]
        return np.asarray(logits[:, -1] if batch.order is None else logits[batch.order, -1], np.float32)

    def _regroup(self, sequences: list[Any]) -> _Batch:
        """The decode batch for `sequences` when it is not last step's: last step's with rows dropped (and the order
        mapped) where no sequence joins and no padding column would be left in every row, else a rebuild."""
        caches = [self.caches[s] for s in sequences]
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("a sequence decodes once per step")
        batch = self._batch
        if batch is not None and batch.padding == self.padding:
            rows = [-1 if cache._slot is None or cache._slot[0] is not batch else cache._slot[1] for cache in caches]
            if min(rows) >= 0 and int(batch.lengths[rows].max()) == batch.keys[0].shape[2]:
                self._drop(batch, sequences, rows)
                return batch
        return self._rebuild(sequences, caches)

    def _drop(self, batch: _Batch, sequences: list[Any], rows: list[int]) -> None:
        """Keep only `rows` (those of `sequences`) in the batch: who else is in it leaves (a copy of its row if it
        keeps its cache), the rows that stay beyond the new end move into the holes, and the arrays are cut."""
        staying, count = set(rows), len(rows)
        for row, cache in enumerate(batch.caches):
            if row not in staying and batch.members[row] is not _GONE:
                self._leave(cache, keep=True)  # not decoding this step, but keeps its cache
        source = list(range(count))  # the old row of each new row
        holes = [row for row in source if row not in staying]
        for hole, mover in zip(holes, [row for row in rows if row >= count], strict=True):
            source[hole] = mover
            for array in (*batch.keys, *batch.values):  # last step's presents, or this runner's scratch
                array[hole] = array[mover]
        if count < len(batch.members):
            batch.keys = [k[:count] for k in batch.keys]  # views: contiguous, so fed as they are
            batch.values = [v[:count] for v in batch.values]
            batch.members = [batch.members[row] for row in source]
            batch.caches = [batch.caches[row] for row in source]
            batch.lengths = batch.lengths[source]
            for row in holes:
                batch.caches[row]._slot = (batch, row)
        order = [source.index(row) for row in rows]  # the new row of each of `sequences`
        batch.order = None if order == list(range(count)) else np.asarray(order)
        batch.wanted = list(sequences)
        self.drops += 1

    def _rebuild(self, sequences: list[Any], caches: list[SequenceCache]) -> _Batch:
        """A new decode batch for `sequences`: their rows gathered (from the old batch or their own arrays) and
        padded to the longest; who was in the old batch and is not in this one gets its row copied out."""
        lengths = np.asarray([cache.tokens for cache in caches], np.int64)
        width = int(lengths.max())
        arrays = self._gather_into((len(caches), self.config.kv_heads, width, self.config.head_size))
        for row, cache in enumerate(caches):
            held = int(lengths[row])
            at, padding = (slice(0, held), slice(held, width)) if self.padding == "right" else (
                slice(width - held, width), slice(0, width - held))  # fmt: skip
            sources = cache._arrays() if held else [self._empty[0]] * len(arrays)
            for target, source in zip(arrays, sources, strict=True):
                target[row, :, at] = source
                if held < width:
                    target[row, :, padding] = 0
        old = self._batch
        if old is not None:
            staying = {id(cache) for cache in caches}
            for cache in old.caches:
                if cache._slot is not None and cache._slot[0] is old and id(cache) not in staying:
                    self._leave(cache, keep=True)
        layers = self.config.layers
        batch = _Batch(list(sequences), caches, lengths, arrays[:layers], arrays[layers:], self.padding)
        for row, cache in enumerate(caches):
            cache._join(batch, row)
        self._batch = batch
        self.rebuilds += 1
        return batch

    def _gather_into(self, shape: tuple[int, int, int, int]) -> list[np.ndarray]:
        """Arrays of `shape` for a rebuild's keys then values, per layer: views of the scratch, grown if too small,
        or new scratch where the old batch's rows are in it still (the step after its rebuild failed)."""
        size = shape[0] * shape[1] * shape[2] * shape[3]
        needed = 2 * self.config.layers * size
        scratch, old = self._scratch, self._batch
        if scratch is None or scratch.size < needed or (old is not None and np.may_share_memory(old.keys[0], scratch)):
            scratch = self._scratch = np.empty(needed + needed // 4, self.kv_dtype)  # room for the batch to grow
        return [scratch[i * size : (i + 1) * size].reshape(shape) for i in range(2 * self.config.layers)]

    def release(self, sequence: Any) -> None:
        """Forget a sequence's cache (it ended, or was preempted: a recompute starts from its tokens again)."""
        cache = self.caches.pop(sequence, None)
        if cache is not None:
            self._leave(cache, keep=False)

    def _leave(self, cache: SequenceCache, *, keep: bool) -> None:
        """Take a sequence out of the decode batch: its row copied out when it `keep`s its cache (copies, so that the
        batch's arrays can go), else dropped; a batch with no row left goes at once."""
        if cache._slot is None:
            return
        batch, row = cache._slot
        if keep:
            cache._own([k.copy() for k in cache.keys], [v.copy() for v in cache.values])
        cache._slot = None
        batch.members[row] = _GONE
        batch.wanted = None  # the next decode regroups, even if asked for the same sequences
        if batch is self._batch and all(member is _GONE for member in batch.members):
            self._batch = self._scratch = None
