"""Free GPU memory and the number of GPUs through NVML, when a GPU and nvidia-ml-py are present, to refuse a model
that would not fit, or an instance pinned to a GPU that is not there.

Refusing at load gives a clear error; loading anyway gives an out-of-memory error later, under traffic.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from edge_agent.errors import AgentError

MiB = 2**20
# onnxruntime's execution providers that run on the GPU (its memory, not the host's, holds what they load).
GPU_PROVIDERS = frozenset({"TensorrtExecutionProvider", "CUDAExecutionProvider"})


class GpuMemoryError(AgentError, RuntimeError):
    """A model would not fit in the GPU memory that is free (or in the arena it is allowed)."""


def free_gpu_memory(device_id: int = 0) -> int | None:
    """Free bytes on GPU `device_id`, or None when that cannot be known (no NVML, no GPU); never raises."""
    return _ask_nvml(lambda nvml: int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(device_id)).free))


def device_count() -> int | None:
    """How many GPUs CUDA shows this process, so the ids a session's `device_id` may take (0..n-1): NVML's count,
    cut to the length of CUDA_VISIBLE_DEVICES where that is set (NVML itself ignores it). None when it cannot be
    known (no NVML, no driver); never raises."""
    count = _ask_nvml(lambda nvml: int(nvml.nvmlDeviceGetCount()))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if count is None or visible is None:
        return count
    return min(count, len([entry for entry in visible.split(",") if entry.strip()]))


def _ask_nvml(query: Callable[[Any], int]) -> int | None:
    """`query(pynvml)` between NVML's init and shutdown; None where NVML cannot answer."""
    try:
        import pynvml  # nvidia-ml-py: optional, only on GPU devices
    except Exception:  # an ImportError, or a broken install
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError: no driver or no GPU
        return None
    try:
        return query(pynvml)
    except Exception:  # NVMLError: no such device, or not supported (some Jetson boards)
        return None
    finally:
        with contextlib.suppress(Exception):  # shutting down a probe that already answered must not fail the caller
            pynvml.nvmlShutdown()


def check_fits(model_bytes: int, device_id: int = 0, headroom: int = 256 * MiB) -> int | None:
    """Raise GpuMemoryError unless `model_bytes` plus `headroom` bytes are free on the GPU.

    Returns the free bytes measured, or None when free memory cannot be measured (then nothing is refused).
    """
    free = free_gpu_memory(device_id)
    if free is None:
        return None
    needed = model_bytes + headroom
    if needed > free:
        raise GpuMemoryError(
            f"GPU {device_id}: the model needs about {model_bytes / MiB:.0f} MiB plus {headroom / MiB:.0f} MiB "
            f"headroom, but only {free / MiB:.0f} MiB are free; free memory or serve a lighter variant"
        )
    return free
