"""Would a model version fit? Checked before every load and variant switch, on each device its instances are placed
on, so that a load is refused with a clear message instead of running the device out of memory under traffic.

A version's need, per instance: what it really took at its last load (free memory before minus after, on its
devices, remembered in a small JSON file in the agent's state directory for later loads and variant switches), else
an estimate from its files (their size times LOAD_FACTOR, no more than its `gpu_mem_limit` where one bounds the CUDA
arena); a generative model adds its KV budget. Three limits: the memory free on each device (the probe's reading,
`devices.MemoryProbe`) less a headroom (the agent's `load_headroom_bytes` where a version loads beside another
version of its model, as a variant switch or a reload does; at most 256 MiB of it for a model's first load); the
model's `gpu_mem_limit` (a per-session cap: its weights must fit in it);
and the agent's `gpu_memory_budget_bytes`, which all the models on GPUs together may not exceed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from edge_agent.errors import AgentError
from edge_agent.runtime import gpu
from edge_agent.runtime.devices import (
    JETSON,
    UNKNOWN,
    DeviceMemory,
    MemoryProbe,
    Placement,
    default_probe,
    read_meminfo,
)
from spillway.contract.spec import ModelConfig, ModelVersion

if TYPE_CHECKING:
    from edge_agent.config import AgentConfig

log = logging.getLogger("spillway.agent.runtime")
T = TypeVar("T")

# Before a version's first load: weights plus activations and the session's own buffers take more than the files.
LOAD_FACTOR = 1.5
NEEDS_FILE = "memory-needs.json"
GPU_MEM_LIMIT = "gpu_mem_limit"  # the model config's `parameters` key of its per-session cap
DEFAULT_HEADROOM = 256 * gpu.MiB
_SIZE = re.compile(r"\s*([0-9]+)\s*([KMGT]i?B?)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class HostMemoryError(AgentError, RuntimeError):
    """A model version would not fit in the host memory that is available."""


def model_bytes(version: ModelVersion) -> int:
    """The size of the files in the version's directory (the model and any external weights)."""
    return folder_bytes(version.path.parent)


def folder_bytes(folder: Path) -> int:
    """The size of the files in a version's directory (a decoder's: its model, weights, tokenizer)."""
    return sum(entry.stat().st_size for entry in folder.iterdir() if entry.is_file())


def available_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """`MemAvailable` in bytes, or None where /proc/meminfo does not say (not Linux); never raises."""
    return read_meminfo(meminfo).get("MemAvailable")


def mib(n: int) -> str:
    return f"{n / gpu.MiB:.0f}"


def parse_bytes(value: str) -> int:
    """A positive size: bytes ("1073741824") or with a binary unit ("1GiB", "512MiB", "512M"); ValueError else."""
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a size in bytes (e.g. 1073741824, 1GiB, 512MiB)")
    number = int(match.group(1)) * _UNITS[(match.group(2) or "")[:1].upper()]
    if number <= 0:
        raise ValueError(f"{value!r} is not a positive size")
    return number


def model_gpu_mem_limit(config: ModelConfig | None, agent_limit: int | None = None) -> tuple[int | None, str | None]:
    """The cap on each of a model's sessions' CUDA arena, and where it comes from: its config's
    `parameters { key: "gpu_mem_limit" ... }`, else the agent's `gpu_mem_limit`. ModelConfigError for a bad value."""
    from edge_agent.runtime.config import ModelConfigError

    value = None if config is None else config.parameters.get(GPU_MEM_LIMIT)
    if value is None:
        return agent_limit, None if agent_limit is None else "the agent's gpu_mem_limit"
    assert config is not None
    try:
        return parse_bytes(value), f"parameters['{GPU_MEM_LIMIT}'] of {config.source}"
    except ValueError as exc:
        raise ModelConfigError(f"{config.source}: parameters[{GPU_MEM_LIMIT!r}]: {exc}") from None


@dataclass(frozen=True)
class Need:
    """What a model version needs: per instance (measured or estimated, `basis` says which), on the devices its
    instances are placed on, plus a generative model's KV budget (split evenly over its instances)."""

    label: str  # "mlp v2"
    name: str
    version: str
    weights: int  # bytes of its version's files
    per_instance: int
    basis: str  # "measured at its last load", "estimated ..."
    placements: tuple[tuple[Placement, int], ...]  # (device, instances on it), in the order of the instances
    on_gpu: bool  # it runs on a GPU execution provider
    kv_bytes: int = 0
    cap: int | None = None
    cap_source: str | None = None

    @property
    def instances(self) -> int:
        return sum(count for _, count in self.placements)

    def bytes_for(self, instances: int) -> int:
        """The need of `instances` of its instances (those placed on one device), their share of the KV included."""
        return self.per_instance * instances + self.kv_bytes * instances // max(self.instances, 1)

    @property
    def total(self) -> int:
        return self.bytes_for(self.instances)

    def detail(self, instances: int) -> str:
        kv = f" + {mib(self.kv_bytes * instances // max(self.instances, 1))} MiB of KV budget" if self.kv_bytes else ""
        plural = "instance" if instances == 1 else "instances"
        return f"{instances} {plural} x {mib(self.per_instance)} MiB, {self.basis}{kv}"


class NeedBook:
    """What each model version really took at a load, per instance and kind of memory ("gpu", "host"), with the
    size of its files then (a version whose files changed since is estimated again). Kept in a JSON file (None: in
    memory only); a file that cannot be read or written costs the measurement, never the load."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._needs: dict[str, dict[str, dict[str, dict[str, int]]]] | None = None
        self._warned = False

    def measured(self, name: str, version: str, kind: str, weights: int) -> int | None:
        with self._lock:
            entry = self._load().get(name, {}).get(version, {}).get(kind)
        if not entry or entry.get("weights") != weights or entry.get("per_instance", 0) <= 0:
            return None
        return int(entry["per_instance"])

    def remember(self, name: str, version: str, kind: str, weights: int, per_instance: int) -> None:
        with self._lock:
            needs = self._load()
            entry = {"per_instance": per_instance, "weights": weights}
            needs.setdefault(name, {}).setdefault(version, {})[kind] = entry
            if self.path is None:
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                partial = self.path.with_name(self.path.name + ".tmp")
                partial.write_text(json.dumps({"format": 1, "needs": needs}, indent=1, sort_keys=True))
                os.replace(partial, self.path)
            except OSError as error:
                if not self._warned:
                    self._warned = True
                    log.warning("cannot keep measured model memory in %s (%s); later loads estimate again",
                                self.path, error)  # fmt: skip

    def _load(self) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        if self._needs is None:
            self._needs = {}
            if self.path is not None and self.path.is_file():
                try:
                    document = json.loads(self.path.read_text())
                    if isinstance(document, dict) and isinstance(document.get("needs"), dict):
                        self._needs = document["needs"]
                except (OSError, ValueError) as error:
                    log.warning("ignoring %s: %s", self.path, error)
        return self._needs


class DeviceNeed(NamedTuple):
    """One device a load was checked on: its reading, the instances placed there and the bytes they need."""

    reading: DeviceMemory
    instances: int
    needed: int


@dataclass
class Holding:
    """Memory a loaded model holds, per device it was measured on (the GPU budget counts those on GPUs)."""

    label: str  # "mlp v2"
    name: str  # its model
    per_device: dict[str, int]
    on_gpu: bool

    @property
    def total(self) -> int:
        return sum(self.per_device.values())


class MemoryGuard:
    """Checks a load against each device's free memory, the model's cap and the agent's GPU budget; measures what
    the load took, remembers it, and holds it against the budget until the model is released (explicitly, or when
    the object holding it is garbage: a load that failed later in a policy is closed and dropped).

    `headroom` stays free when a version loads beside a version of the same model that the guard holds (a variant
    switch, a reload); `first_headroom` (default: the smaller of `headroom` and 256 MiB) at a model's first load."""

    def __init__(
        self,
        probe: MemoryProbe | None = None,
        book: NeedBook | None = None,
        *,
        headroom: int = DEFAULT_HEADROOM,
        first_headroom: int | None = None,
        budget: int | None = None,
    ) -> None:
        self.probe = probe or default_probe()
        self.book = book or NeedBook()
        self.headroom = headroom
        self.first_headroom = min(headroom, DEFAULT_HEADROOM) if first_headroom is None else first_headroom
        self.budget = budget
        # While the agent starts, every version the repository serves loads with `first_headroom`: serving two
        # versions side by side is the configuration, not a switch (set by `build_registry`).
        self.starting = False
        self._lock = threading.Lock()
        self._loads = threading.RLock()  # one measured load at a time: two would see each other's allocations
        self._held: dict[int, Holding] = {}  # by a token of its own (an id may be reused once its object is gone)
        self._tokens: dict[int, int] = {}  # id(holder) -> its token
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        # Tokens of holders collected: a finalizer runs inside any allocation, so it only appends (no lock taken).
        self._collected: deque[int] = deque()
        self._counter = itertools.count()

    @classmethod
    def for_agent(cls, agent: AgentConfig, probe: MemoryProbe | None = None) -> MemoryGuard:
        """The guard of an agent: its headroom and GPU budget, its measurements kept in its state directory."""
        return cls(probe, NeedBook(agent.state_dir / NEEDS_FILE), headroom=agent.load_headroom_bytes,
                   budget=agent.gpu_memory_budget_bytes)  # fmt: skip

    # ---- needs -----------------------------------------------------------------------------------------------------

    def need(
        self,
        name: str,
        version: str | int,
        folder: Path,
        *,
        placements: Iterable[Placement],
        on_gpu: bool,
        cap: int | None = None,
        cap_source: str | None = None,
        kv_bytes: int = 0,
        label: str | None = None,
    ) -> Need:
        """The need of the version in `folder` with one instance on each of `placements` (a device repeated holds
        several): measured at an earlier load where the book has it, else estimated from its files."""
        counts = Counter(placements)
        if not counts:
            raise ValueError(f"{name} v{version}: no placement for its instances")
        weights = folder_bytes(folder)
        first = next(iter(counts))
        kind = self.probe.read(first, gpu=on_gpu).kind
        measured = self.book.measured(name, str(version), kind, weights)
        if measured is not None:
            per_instance, basis = measured, "measured at its last load"
        else:
            per_instance = int(weights * LOAD_FACTOR)
            basis = f"estimated as {LOAD_FACTOR:g} x its files' {mib(weights)} MiB"
            if on_gpu and cap is not None and weights <= cap < per_instance:
                per_instance, basis = cap, f"estimated: its files' {mib(weights)} MiB and the arena up to its cap"
        return Need(label or f"{name} v{version}", name, str(version), weights, per_instance, basis,
                    tuple(counts.items()), on_gpu, kv_bytes, cap, cap_source)  # fmt: skip

    def need_of(
        self,
        version: ModelVersion,
        *,
        placements: Iterable[Placement],
        providers: Sequence[str],
        agent_cap: int | None = None,
    ) -> Need:
        """The need of a V2 model version with its instances on `placements`, on the execution `providers` chosen
        (its cap: its config's gpu_mem_limit, else `agent_cap`)."""
        cap, source = model_gpu_mem_limit(version.config, agent_cap)
        return self.need(version.config.name, version.version, version.path.parent, placements=placements,
                         on_gpu=on_gpu(providers), cap=cap, cap_source=source)  # fmt: skip

    # ---- the check -------------------------------------------------------------------------------------------------

    def check(self, need: Need) -> list[DeviceNeed]:
        """Raise GpuMemoryError (its cap, a device's free memory), HostMemoryError or GpuBudgetError unless `need`
        fits; returns each device read, with the instances placed there and the bytes they need (a device whose
        memory cannot be read refuses nothing)."""
        if need.on_gpu and need.cap is not None and need.weights > need.cap:
            raise gpu.GpuMemoryError(
                f"{need.label}: its files alone take {mib(need.weights)} MiB, more than its gpu_mem_limit of "
                f"{mib(need.cap)} MiB ({need.cap_source}), which bounds each session's CUDA arena; raise the cap or "
                "serve a lighter variant"
            )
        everything = self.held()
        beside = not self.starting and any(h.name == need.name for h in everything)
        headroom = self.headroom if beside else self.first_headroom
        devices = self._devices(need)
        for reading, instances in devices:
            needed = need.bytes_for(instances)
            if reading.free is not None and needed + headroom > reading.free:
                raise self._refusal(need, reading, instances, needed, headroom)
        if self.budget is not None and need.on_gpu:
            held = [h for h in everything if h.on_gpu]
            taken = sum(h.total for h in held)
            if taken + need.total > self.budget:
                holders = ", ".join(f"{h.label} {mib(h.total)} MiB" for h in held) or "nothing"
                raise gpu.GpuBudgetError(
                    f"{need.label} needs about {mib(need.total)} MiB of GPU memory ({need.detail(need.instances)}), "
                    f"but the agent's gpu_memory_budget_bytes of {mib(self.budget)} MiB has "
                    f"{mib(max(self.budget - taken, 0))} MiB left (held: {holders}); unload a model, serve a lighter "
                    "variant or raise gpu_memory_budget_bytes"
                )
        return [DeviceNeed(reading, instances, need.bytes_for(instances)) for reading, instances in devices]

    def _devices(self, need: Need) -> list[tuple[DeviceMemory, int]]:
        """Each memory the need's instances allocate from, read once, with its instances (placements that share one,
        as every GPU placement on a Jetson does, add up)."""
        found: dict[str, tuple[DeviceMemory, int]] = {}
        for placement, count in need.placements:
            reading = self.probe.read(placement, gpu=need.on_gpu)
            key = reading.device if reading.source != UNKNOWN else f"{reading.device}:{placement}"
            previous = found.get(key)
            found[key] = (reading, count + (previous[1] if previous else 0))
        return list(found.values())

    def _refusal(self, need: Need, reading: DeviceMemory, instances: int, needed: int, headroom: int) -> AgentError:
        assert reading.free is not None
        if reading.on_gpu:
            return gpu.GpuMemoryError(
                f"{need.label} needs about {mib(needed)} MiB ({need.detail(instances)}) on {reading.describe()} plus "
                f"{mib(headroom)} MiB headroom, but only {mib(reading.free)} MiB are free there; free memory, "
                "place its instances on another device (instance_group.gpus) or serve a lighter variant"
            )
        memory = "the Jetson's RAM (shared by its CPU and GPU)" if reading.source == JETSON else "host memory"
        return HostMemoryError(
            f"{need.label} needs about {mib(needed)} MiB ({need.detail(instances)}) plus {mib(headroom)} MiB "
            f"headroom beside what is loaded, but only {mib(reading.free)} MiB of {memory} are available "
            "(MemAvailable); free memory or serve a lighter variant"
        )

    # ---- a measured load -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def loading(self, need: Need) -> Iterator[Loading]:
        """Check `need` (raising before anything loads), then measure the load made inside the block: call
        `done(holder)` with what holds the memory once it is loaded. One measured load at a time."""
        with self._loads:
            before = self.check(need)
            yield Loading(self, need, before)

    def load(self, need: Need, build: Callable[[], T]) -> T:
        """`build()` inside `loading(need)`, its result the holder."""
        with self.loading(need) as load:
            result = build()
            load.done(result)
        return result

    # ---- what is held ----------------------------------------------------------------------------------------------

    def hold(self, holder: object, holding: Holding) -> None:
        """Count `holding` against the budget until `holder` is released or collected."""
        token = next(self._counter)
        with self._lock:
            self._prune()
            self._held[token] = holding
            self._tokens[id(holder)] = token
        try:
            finalizer = weakref.finalize(holder, self._collected.append, token)
        except TypeError:  # not weakly referable: released explicitly only
            return
        with self._lock:
            if token in self._held:
                self._finalizers[token] = finalizer

    def release(self, holder: object) -> None:
        """The model `holder` holds is unloaded: its memory no longer counts against the budget (idempotent)."""
        with self._lock:
            token = self._tokens.pop(id(holder), None)
            if token is None:
                return
            self._held.pop(token, None)
            finalizer = self._finalizers.pop(token, None)
        if finalizer is not None:
            finalizer.detach()

    def held(self) -> list[Holding]:
        with self._lock:
            self._prune()
            return list(self._held.values())

    def _prune(self) -> None:
        """Drop what collected holders held (under the lock)."""
        while self._collected:
            token = self._collected.popleft()
            self._held.pop(token, None)
            self._finalizers.pop(token, None)
            for key in [k for k, t in self._tokens.items() if t == token]:
                del self._tokens[key]

    def json(self) -> dict[str, Any]:
        """For the agent's status: the budget and what each loaded model holds."""
        held = self.held()
        return {
            "gpu_memory_budget_bytes": self.budget,
            "gpu_bytes_held": sum(h.total for h in held if h.on_gpu),
            "models": {h.label: {"bytes": h.total, "devices": dict(h.per_device), "gpu": h.on_gpu} for h in held},
        }


@dataclass
class Loading:
    """One load under way: the devices read before it, to measure what it took once `done`."""

    guard: MemoryGuard
    need: Need
    before: list[DeviceNeed]
    taken: dict[str, int] = field(default_factory=dict)  # device -> bytes, once done

    def done(self, holder: object, kv_bytes: int | None = None) -> Holding:
        """Measure what the load took on each device (free before minus after), remember it per instance for later
        loads, and hold it (plus the KV budget: `kv_bytes` as loaded, else the need's) against the budget."""
        need, guard = self.need, self.guard
        kv = need.kv_bytes if kv_bytes is None else kv_bytes
        measured = instances = 0
        kinds = set()
        for reading, count, _ in self.before:
            now = _reread(guard.probe, need, reading)
            if reading.free is None or now is None or now.free is None:
                continue
            measured += reading.free - now.free
            instances += count
            kinds.add(reading.kind)
        per_instance = need.per_instance
        if instances and measured > 0 and len(kinds) == 1:
            per_instance = max(measured // instances, need.weights)  # at least its files: a disturbed reading aside
            guard.book.remember(need.name, need.version, kinds.pop(), need.weights, per_instance)
            log.info("%s took %s MiB per instance (measured; estimated %s MiB)", need.label, mib(per_instance),
                     mib(need.per_instance))  # fmt: skip
        for reading, count, _ in self.before:
            self.taken[reading.device] = per_instance * count + kv * count // max(need.instances, 1)
        holding = Holding(need.label, need.name, dict(self.taken), need.on_gpu)
        guard.hold(holder, holding)
        return holding


def _reread(probe: MemoryProbe, need: Need, reading: DeviceMemory) -> DeviceMemory | None:
    """The device of an earlier reading, read again (through the first placement that reads it)."""
    for placement, _ in need.placements:
        now = probe.read(placement, gpu=need.on_gpu)
        if now.device == reading.device and now.source == reading.source:
            return now
    return None


def on_gpu(providers: Sequence[str]) -> bool:
    return any(name in gpu.GPU_PROVIDERS for name in providers)


# ---- the checks before a variant loads beside the version it replaces (one instance, the agent's device) ---------


def check_load_fits(
    version: ModelVersion,
    providers: Sequence[str],
    *,
    device_id: int = 0,
    headroom: int = DEFAULT_HEADROOM,
    meminfo: Path = Path("/proc/meminfo"),
) -> str:
    """Raise GpuMemoryError or HostMemoryError unless `version` fits beside what is loaded, keeping `headroom` free.

    Returns which memory was checked ("gpu", "host", or "unmeasured" when neither can be measured).
    """
    return check_folder_fits(f"{version.config.name} v{version.version}", version.path.parent, providers,
                             device_id=device_id, headroom=headroom, meminfo=meminfo)  # fmt: skip


def check_folder_fits(
    what: str,
    folder: Path,
    providers: Sequence[str],
    *,
    device_id: int = 0,
    headroom: int = DEFAULT_HEADROOM,
    meminfo: Path = Path("/proc/meminfo"),
) -> str:
    """`check_load_fits` for the files of a version's directory, named `what` in the message (a decoder's version
    has no V2 model config): its files' size times LOAD_FACTOR, one instance."""
    probe = default_probe()
    if meminfo != probe.meminfo:
        probe = MemoryProbe(meminfo=meminfo)
    guard = MemoryGuard(probe, headroom=headroom, first_headroom=headroom)
    name, _, version = what.rpartition(" v")
    need = guard.need(name or what, version, folder, placements=[device_id], on_gpu=on_gpu(providers), label=what)
    ((reading, _, _),) = guard.check(need)
    if reading.free is None:
        return "unmeasured"
    return "gpu" if reading.on_gpu else "host"


__all__ = [
    "LOAD_FACTOR",
    "DeviceNeed",
    "HostMemoryError",
    "Loading",
    "MemoryGuard",
    "Need",
    "NeedBook",
    "available_host_memory",
    "check_folder_fits",
    "check_load_fits",
    "folder_bytes",
    "model_bytes",
    "model_gpu_mem_limit",
    "parse_bytes",
]
