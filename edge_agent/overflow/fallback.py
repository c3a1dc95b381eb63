"""Local fallbacks: the last successful answer to identical inputs (a byte-bounded LRU), or a configured default.

The cache is filled from normal successful answers and read only while a policy says to answer a priority level
with a fallback. Its key is the model, the version that served, and every input's name, datatype, shape and bytes:
an answer is reused only for exactly the same request to exactly the same model version. With a `ttl_s`, an answer
is served only that long after it was stored (reading it does not make it fresher). Everything here runs on the
event loop, so nothing is locked.

Generative models keep their own cache of the same kind (`CompletionCache`): only greedy completions, whose text is
a function of the request, keyed by everything that decides it (`completion_key`).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

_ENTRY_OVERHEAD = 256  # bytes per entry beyond the arrays: key, dict slots, array headers (an estimate)
_U64 = struct.Struct("<Q")
V = TypeVar("V")


def inputs_key(model: str, version: int, inputs: Mapping[str, np.ndarray]) -> bytes:
    """A digest of everything that decides a model's answer: model, version, and each input's dtype, shape, bytes."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{model}\0{version}\0".encode())
    for name in sorted(inputs):
        array = inputs[name]
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        if array.dtype.kind == "O":  # BYTES: each element, length-prefixed so that boundaries count
            for element in array.ravel().tolist():
                raw = element if isinstance(element, bytes) else str(element).encode()
                digest.update(_U64.pack(len(raw)))
                digest.update(raw)
        else:
            digest.update(np.ascontiguousarray(array).data)
    return digest.digest()


def _size(outputs: Mapping[str, np.ndarray]) -> int:
    total = _ENTRY_OVERHEAD
    for array in outputs.values():
        if array.dtype.kind == "O":
            total += (
                sum(len(e) if isinstance(e, bytes) else len(str(e)) for e in array.ravel().tolist()) + 8 * array.size
            )
        else:
            total += array.nbytes
    return total


class _BoundedCache(Generic[V]):
    """Values by key, at most `capacity_bytes` in all (each value's size estimated by the caller); least recently
    used go first; with a `ttl_s`, a value is served only that long after it was stored."""

    def __init__(self, capacity_bytes: int, ttl_s: float | None, clock: Callable[[], float]) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s}")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[V, int, float]] = OrderedDict()  # key -> (value, size, stored_at)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.expired = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, key: bytes, value: V, size: int) -> bool:
        if size > self.capacity_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        while self._entries and self.bytes + size > self.capacity_bytes:
            _, (_, evicted, _) = self._entries.popitem(last=False)
            self.bytes -= evicted
        self._entries[key] = (value, size, self._clock() if self.ttl_s is not None else 0.0)
        self.bytes += size
        return True

    def get(self, key: bytes) -> V | None:
        """The value stored for `key`, now the most recently used; None when absent or older than `ttl_s`."""
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        if self.ttl_s is not None and self._clock() - found[2] >= self.ttl_s:
            del self._entries[key]
            self.bytes -= found[1]
            self.expired += 1
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0]

    def json(self) -> dict[str, int | float | None]:
        return {"capacity_bytes": self.capacity_bytes, "bytes": self.bytes, "entries": len(self._entries),
                "hits": self.hits, "misses": self.misses, "expired": self.expired, "ttl_s": self.ttl_s}  # fmt: skip


class ResponseCache(_BoundedCache[dict[str, np.ndarray]]):
    """Recent successful answers by `inputs_key`, at most `capacity_bytes` in all; least recently used go first."""

    def __init__(
        self, capacity_bytes: int, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Args:
        capacity_bytes: the bound on the outputs kept (with an estimate of each entry's overhead); 0 disables it.
        ttl_s: how long after it was stored an answer may be served; None: until it is evicted.
        clock: seconds, monotonic.
        """
        super().__init__(capacity_bytes, ttl_s, clock)

    def put(self, key: bytes, outputs: Mapping[str, np.ndarray]) -> bool:
        """Keep a copy of `outputs` (never a view into a whole batch's output); False when it is too big to keep."""
        size = _size(outputs)
        if size > self.capacity_bytes:
            return False
        kept: dict[str, np.ndarray] = {}
        for name, array in outputs.items():
            copy = np.array(array, copy=True)
            copy.flags.writeable = False
            kept[name] = copy
        return self._put(key, kept, size)


@dataclass(frozen=True)
class Completion:
    """A finished greedy completion, as a fallback answers it again."""

    text: str
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int


def completion_key(model: str, version: str, operation: str, prompt: list[int], max_tokens: int,
                   stop: tuple[str, ...], ignore_eos: bool) -> bytes:  # fmt: skip
    """A digest of everything that decides a greedy completion: the model and version that served it, the operation,
    the prompt's tokens (after the chat template: the messages as the model saw them), `max_tokens` (after any cap),
    the stop strings and `ignore_eos`. Sampling parameters are not in it: only greedy requests are cached."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{model}\0{version}\0{operation}\0{max_tokens}\0{int(ignore_eos)}\0{len(stop)}\0".encode())
    for text in stop:
        raw = text.encode()
        digest.update(_U64.pack(len(raw)))
        digest.update(raw)
    digest.update(np.asarray(prompt, dtype=np.int64).tobytes())
    return digest.digest()


class CompletionCache(_BoundedCache[Completion]):
    """Recent greedy completions of the generative models by `completion_key`, at most `capacity_bytes` in all."""

    def __init__(
        self, capacity_bytes: int, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(capacity_bytes, ttl_s, clock)

    def put(self, key: bytes, completion: Completion) -> bool:
        """Keep `completion`; False when it is too big to keep."""
        return self._put(key, completion, _ENTRY_OVERHEAD + len(completion.text.encode()))


def default_answer(outputs: Mapping[str, np.ndarray], rows: int, batching: bool) -> dict[str, np.ndarray]:
    """A policy's default outputs for a request of `rows` rows: one row each, repeated for a batching model."""
    if not batching:
        return dict(outputs)
    return {name: np.repeat(array[np.newaxis, ...], rows, axis=0) for name, array in outputs.items()}
