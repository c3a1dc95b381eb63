"""Free GPU memory and the number of GPUs, to refuse a model that would not fit, or an instance pinned to a GPU that
is not there. The readings come from `devices.MemoryProbe` (NVML, MIG devices included, else cudaMemGetInfo).

Refusing at load gives a clear error; loading anyway gives an out-of-memory error later, under traffic.
"""

from __future__ import annotations

from edge_agent.errors import AgentError
from edge_agent.runtime.devices import MemoryProbe, Placement, default_probe

MiB = 2**20
# What runs on the GPU (its memory, not the host's, holds what they load): onnxruntime's GPU execution providers,
# and the native TensorRT runner of `model.plan` engines (runner.TENSORRT_RUNTIME).
GPU_PROVIDERS = frozenset({"TensorrtExecutionProvider", "CUDAExecutionProvider", "TensorRT"})


class GpuMemoryError(AgentError, RuntimeError):
    """A model would not fit in the GPU memory that is free (or in the arena it is allowed)."""


class GpuBudgetError(GpuMemoryError):
    """A model would take the agent's models past its `gpu_memory_budget_bytes`."""


def free_gpu_memory(device_id: Placement = 0, probe: MemoryProbe | None = None) -> int | None:
    """Free bytes on GPU `device_id` (a CUDA ordinal, or a GPU or MIG device's UUID), or None when that cannot be
    known (no NVML and no CUDA runtime, no such GPU); never raises."""
    reading = (probe or default_probe()).gpu(device_id)
    return None if reading is None else reading.free


def device_count(probe: MemoryProbe | None = None) -> int | None:
    """How many GPUs CUDA shows this process, so the ids a session's `device_id` may take (0..n-1): NVML's count,
    cut to the length of CUDA_VISIBLE_DEVICES where that is set (NVML itself ignores it). None when it cannot be
    known (no NVML, no driver); never raises."""
    return (probe or default_probe()).gpu_count()


def check_fits(
    model_bytes: int, device_id: Placement = 0, headroom: int = 256 * MiB, probe: MemoryProbe | None = None
) -> int | None:
    """Raise GpuMemoryError unless `model_bytes` plus `headroom` bytes are free on the GPU.

    Returns the free bytes measured, or None when free memory cannot be measured (then nothing is refused).
    """
    reading = (probe or default_probe()).gpu(device_id)
    if reading is None or reading.free is None:
        return None
    needed = model_bytes + headroom
    if needed > reading.free:
        raise GpuMemoryError(
            f"{reading.describe()}: the model needs about {model_bytes / MiB:.0f} MiB plus {headroom / MiB:.0f} MiB "
            f"headroom, but only {reading.free / MiB:.0f} MiB are free; free memory or serve a lighter variant"
        )
    return reading.free
