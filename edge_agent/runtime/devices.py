"""Free and total memory of the device a model instance is placed on, from whichever source can tell: NVML (a GPU,
or a MIG device), else CUDA's `cudaMemGetInfo` through the CUDA runtime library that onnxruntime-gpu loads, else the
host's `MemAvailable` (a CPU; and a Jetson, whose GPU allocates from the board's RAM). Never raises: a reading says
which source answered, or that none could.

A placement is what an instance's session is created on: a CUDA device ordinal (the agent's `device_id`, an
`instance_group.gpus` id), which goes through CUDA_VISIBLE_DEVICES as CUDA itself does (NVML ignores that variable,
so ordinal 0 with CUDA_VISIBLE_DEVICES=2 is NVML's GPU 2, and an entry `MIG-...` makes the ordinal that MIG device),
or a device's UUID (`GPU-...`, `MIG-...`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("spillway.agent.runtime")

Placement = int | str
HOST = "host"
# Where a reading came from (DeviceMemory.source).
NVML, NVML_MIG, CUDART, MEMINFO, JETSON, UNKNOWN = "nvml", "nvml-mig", "cudart", "meminfo", "jetson", "unknown"
GPU_SOURCES = frozenset({NVML, NVML_MIG, CUDART})
# A Jetson: L4T's release file, or the device tree's "nvidia,tegra..." compatible string.
TEGRA_RELEASE = Path("/etc/nv_tegra_release")
DEVICE_TREE_COMPATIBLE = Path("/proc/device-tree/compatible")
# The CUDA runtime's names, newest first: one that onnxruntime's CUDA provider loaded already is found by its soname.
CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so", "cudart64_12.dll")
NVML_DEVICE_MIG_ENABLE = 1


@dataclass(frozen=True)
class DeviceMemory:
    """One reading: `device` names the memory (a GPU's NVML index or UUID, a MIG UUID, "host"), bytes free and in
    all (None: unknown), and the source that answered."""

    device: str
    free: int | None
    total: int | None
    source: str
    parent: str | None = None  # a MIG device's GPU

    @property
    def on_gpu(self) -> bool:
        """Whether this is a GPU's own memory (not the host's, which a Jetson's GPU shares)."""
        return self.source in GPU_SOURCES

    @property
    def kind(self) -> str:
        """Either "gpu" or "host": what a measured need is remembered for."""
        return "gpu" if self.on_gpu else "host"

    def describe(self) -> str:
        """The memory in words, for messages: "GPU 1 (NVML)", "host memory (MemAvailable)"."""
        if self.source == NVML_MIG:
            return f"MIG device {self.device} of GPU {self.parent} (NVML)"
        if self.source == NVML:
            return f"GPU {self.device} (NVML)"
        if self.source == CUDART:
            return f"GPU {self.device} (cudaMemGetInfo)"
        if self.source == JETSON:
            return "the Jetson's RAM shared by CPU and GPU (MemAvailable)"
        if self.source == MEMINFO:
            return "host memory (MemAvailable)"
        return f"device {self.device} (free memory unknown)"


def load_nvml() -> Any:
    """nvidia-ml-py's module (the `gpu` extra); raises where it is missing."""
    import pynvml

    return pynvml


def load_cudart() -> Any:
    """The CUDA runtime library through ctypes: one onnxruntime-gpu loaded already (found by its soname), one on the
    loader's path, or one from the NVIDIA wheels onnxruntime-gpu depends on (`nvidia/cuda_runtime/lib`). Raises
    OSError where there is none."""
    for name in CUDART_NAMES:
        with contextlib.suppress(OSError):
            return ctypes.CDLL(name)
    for entry in sys.path:
        for folder in (Path(entry) / "nvidia" / "cuda_runtime" / "lib", Path(entry) / "onnxruntime" / "capi"):
            for path in sorted(folder.glob("libcudart.so*"), reverse=True) if folder.is_dir() else []:
                with contextlib.suppress(OSError):
                    return ctypes.CDLL(str(path))
    raise OSError("no CUDA runtime library (libcudart) found")


def read_meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo's fields in bytes ({} where it cannot be read); never raises."""
    fields: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            with contextlib.suppress(ValueError, IndexError):
                fields[name] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return fields


def is_jetson(release: Path = TEGRA_RELEASE, compatible: Path = DEVICE_TREE_COMPATIBLE) -> bool:
    """An NVIDIA Jetson (Tegra) board: its GPU has no memory of its own."""
    try:
        if release.exists():
            return True
        return b"nvidia,tegra" in compatible.read_bytes()
    except OSError:
        return False


@contextlib.contextmanager
def nvml_session(load: Callable[[], Any] = load_nvml) -> Iterator[Any]:
    """NVML between its init and shutdown (NVML counts them, so this nests inside a probe that holds it open);
    yields None where NVML cannot start (no library, no driver)."""
    try:
        nvml = load()
        nvml.nvmlInit()
    except Exception:  # ImportError, NVMLError (no driver, no GPU), a broken install
        yield None
        return
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):  # a probe that answered must not fail its caller on shutdown
            nvml.nvmlShutdown()


def text(value: Any) -> str:
    """An NVML string (bytes from older nvidia-ml-py releases, str from newer ones)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def mig_devices(nvml: Any, gpu: Any) -> list[tuple[str, Any]]:
    """(UUID, handle) of each MIG device of a GPU in MIG mode ([] otherwise, or where NVML cannot tell)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(gpu)
        if current != NVML_DEVICE_MIG_ENABLE:
            return []
        slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu))
    except Exception:  # NVMLError_NotSupported: a GPU without MIG
        return []
    found = []
    for index in range(slots):
        try:
            handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, index)
            found.append((text(nvml.nvmlDeviceGetUUID(handle)), handle))
        except Exception:  # NVMLError_NotFound: an empty slot
            log.debug("no MIG device in slot %d", index)
    return found


class MemoryProbe:
    """Reads the memory of the device a placement names (see the module's docstring for the sources, in order).

    Every source is injected, so that tests can hand it fakes: `nvml` loads the pynvml module, `cudart` the CUDA
    runtime library (ctypes), `meminfo` and the Tegra files are paths, `environ` holds CUDA_VISIBLE_DEVICES."""

    def __init__(
        self,
        *,
        nvml: Callable[[], Any] = load_nvml,
        cudart: Callable[[], Any] = load_cudart,
        meminfo: Path = Path("/proc/meminfo"),
        tegra_release: Path = TEGRA_RELEASE,
        device_tree: Path = DEVICE_TREE_COMPATIBLE,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._nvml = nvml
        self._cudart_loader = cudart
        self._cudart: Any = None
        self._cudart_missing = False
        self.meminfo = meminfo
        self.jetson = is_jetson(tegra_release, device_tree)
        self._environ = os.environ if environ is None else environ

    # ---- what callers ask ----------------------------------------------------------------------------------------

    def read(self, placement: Placement, *, gpu: bool = True) -> DeviceMemory:
        """The memory an instance placed on `placement` allocates from: the GPU's (or MIG device's) where `gpu` (it
        runs on a GPU provider) and NVML or the CUDA runtime can tell, else the host's; never raises."""
        reading = self.gpu(placement) if gpu and not self.jetson else None
        return reading if reading is not None else self.host()

    def gpu(self, placement: Placement) -> DeviceMemory | None:
        """The GPU memory of a placement from NVML, else from cudaMemGetInfo; None where neither can tell."""
        reading = self._from_nvml(placement)
        return reading if reading is not None else self._from_cudart(placement)

    def host(self) -> DeviceMemory:
        """The host's available memory (on a Jetson: the RAM its GPU shares)."""
        fields = read_meminfo(self.meminfo)
        source = JETSON if self.jetson else MEMINFO
        if "MemAvailable" not in fields:
            return DeviceMemory(HOST, None, fields.get("MemTotal"), UNKNOWN)
        return DeviceMemory(HOST, fields["MemAvailable"], fields.get("MemTotal"), source)

    def gpu_count(self) -> int | None:
        """How many GPUs CUDA shows this process: NVML's count, cut to the length of CUDA_VISIBLE_DEVICES where that
        is set; None where NVML cannot tell."""
        with nvml_session(self._nvml) as nvml:
            if nvml is None:
                return None
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except Exception:
                return None
        visible = self._visible()
        return count if visible is None else min(count, len(visible))

    # ---- NVML ----------------------------------------------------------------------------------------------------

    def _visible(self) -> list[str] | None:
        value = self._environ.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return None
        entries = []
        for entry in (e.strip() for e in value.split(",")):
            if not entry or entry.startswith("-"):  # CUDA stops at the first invalid entry (such as -1)
                break
            entries.append(entry)
        return entries

    def _from_nvml(self, placement: Placement) -> DeviceMemory | None:
        with nvml_session(self._nvml) as nvml:
            if nvml is None:
                return None
            try:
                found = self._resolve(nvml, placement)
                if found is None:
                    return None
                name, handle, parent = found
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # NVMLError: no such device, not supported (some boards)
                log.debug("NVML cannot read the memory of %r", placement, exc_info=True)
                return None
            return DeviceMemory(name, int(info.free), int(info.total), NVML if parent is None else NVML_MIG, parent)

    def _resolve(self, nvml: Any, placement: Placement) -> tuple[str, Any, str | None] | None:
        """(name, NVML handle, parent GPU for a MIG device) of a placement; None where NVML has no such device."""
        entry: str
        if isinstance(placement, int):
            visible = self._visible()
            if visible is None:
                entry = str(placement)
            elif placement < len(visible):
                entry = visible[placement]
            else:
                return None
        else:
            entry = placement
        if entry.isdigit():
            index = int(entry)
            if index >= int(nvml.nvmlDeviceGetCount()):
                return None
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            migs = mig_devices(nvml, handle)
            if migs:  # a GPU in MIG mode: a process runs on one of its MIG devices, the first unless told which
                return migs[0][0], migs[0][1], str(index)
            return str(index), handle, None
        return self._by_uuid(nvml, entry)

    def _by_uuid(self, nvml: Any, uuid: str) -> tuple[str, Any, str | None] | None:
        """A GPU or MIG device by its UUID, or by the start of one (CUDA_VISIBLE_DEVICES may abbreviate)."""
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if text(nvml.nvmlDeviceGetUUID(handle)).startswith(uuid):
                return str(index), handle, None
            for mig_uuid, mig in mig_devices(nvml, handle):
                if mig_uuid.startswith(uuid):
                    return mig_uuid, mig, str(index)
        return None

    # ---- the CUDA runtime ------------------------------------------------------------------------------------------

    def _runtime(self) -> Any:
        if self._cudart is None and not self._cudart_missing:
            try:
                self._cudart = self._cudart_loader()
            except Exception as error:  # OSError: no libcudart; anything from a broken install
                self._cudart_missing = True
                log.debug("no CUDA runtime for cudaMemGetInfo: %s", error)
        return self._cudart

    def _from_cudart(self, placement: Placement) -> DeviceMemory | None:
        """cudaSetDevice(ordinal) then cudaMemGetInfo on this thread, the thread's device put back after."""
        ordinal = self.ordinal(placement)
        cudart = self._runtime() if ordinal is not None else None
        if cudart is None or ordinal is None:
            return None
        try:
            previous = ctypes.c_int(0)
            restore = cudart.cudaGetDevice(ctypes.byref(previous)) == 0
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            try:
                if cudart.cudaSetDevice(ctypes.c_int(ordinal)) != 0:
                    return None
                if cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
                    return None
            finally:
                if restore:
                    cudart.cudaSetDevice(previous)
        except Exception:  # a library without these symbols
            log.debug("cudaMemGetInfo failed for %r", placement, exc_info=True)
            return None
        return DeviceMemory(str(placement), int(free.value), int(total.value), CUDART)

    def ordinal(self, placement: Placement) -> int | None:
        """The CUDA ordinal (onnxruntime's `device_id`) of a placement: itself, or a UUID's position in
        CUDA_VISIBLE_DEVICES (None: not visible to this process)."""
        if isinstance(placement, int):
            return placement
        visible = self._visible() or []
        for position, entry in enumerate(visible):
            if placement.startswith(entry) or entry.startswith(placement):
                return position
        return None


_default_probe: MemoryProbe | None = None


def default_probe() -> MemoryProbe:
    """The process's probe of the real sources (the CUDA runtime is looked for once, at its first GPU reading)."""
    global _default_probe
    if _default_probe is None:
        _default_probe = MemoryProbe()
    return _default_probe
