"""Would another model version fit beside the ones running? Checked before a variant is loaded next to the
version it replaces, so that a switch is refused with a clear message instead of running the device out of memory.

On a GPU that NVML can measure, the GPU's free memory decides (the same check as at start, `gpu.check_fits`). On
a CPU, and on a Jetson (whose GPU shares the host's RAM and has no NVML), the host's available memory decides:
`MemAvailable` from /proc/meminfo against the model files' size times the load factor, plus a headroom.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edge_agent.errors import AgentError
from edge_agent.runtime import gpu
from spillway.contract.spec import ModelVersion

# Weights plus activations and the session's own buffers: loading takes more than the file's size.
LOAD_FACTOR = 1.5


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
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "MemAvailable":
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_load_fits(
    version: ModelVersion,
    providers: Sequence[str],
    *,
    device_id: int = 0,
    headroom: int = 256 * gpu.MiB,
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
    headroom: int = 256 * gpu.MiB,
    meminfo: Path = Path("/proc/meminfo"),
) -> str:
    """`check_load_fits` for the files of a version's directory, named `what` in the message (a decoder's version
    has no V2 model config)."""
    needed = int(folder_bytes(folder) * LOAD_FACTOR)
    if any(name in gpu.GPU_PROVIDERS for name in providers) and gpu.check_fits(needed, device_id, headroom) is not None:
        return "gpu"
    available = available_host_memory(meminfo)
    if available is None:
        return "unmeasured"
    if needed + headroom > available:
        raise HostMemoryError(
            f"{what} needs about {needed / gpu.MiB:.0f} MiB plus "
            f"{headroom / gpu.MiB:.0f} MiB headroom beside the running version, but only "
            f"{available / gpu.MiB:.0f} MiB of host memory are available"
        )
    return "host"
