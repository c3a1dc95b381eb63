"""Run one model version with ONNX Runtime on the best installed provider (TensorRT EP, CUDA EP, CPU).

onnxruntime is imported when a runner is built, not when this module is, so the API and the scheduler load
without it. On a GPU the CUDA arena is bounded and free memory is checked before the session is created.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.errors import AgentError
from edge_agent.runtime import gpu
from edge_agent.runtime.profile import ComputeProfile
from spillway.contract.spec import ModelVersion

if TYPE_CHECKING:
    import onnxruntime

PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
# Weights plus activations, workspace and the CUDA context: loading needs more than the file's size.
GPU_LOAD_FACTOR = 1.5

NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}


class RunnerError(AgentError, RuntimeError):
    """A model version this runner cannot load (wrong platform, no usable provider, a session onnxruntime cannot
    create on the device asked for)."""


def choose_providers(available: Iterable[str], requested: Sequence[str] | None = None) -> list[str]:
    """The requested (default: TensorRT, CUDA, CPU) providers that are installed, in order of preference."""
    installed = set(available)
    chosen = [name for name in (requested or PREFERRED_PROVIDERS) if name in installed]
    if not chosen:
        raise RunnerError(f"none of the providers {list(requested or PREFERRED_PROVIDERS)} is installed ({installed})")
    return chosen


class OrtRunner:
    """One onnxruntime session for one model version; `run` is safe to call from several threads."""

    def __init__(
        self,
        version: ModelVersion,
        *,
        intra_op_threads: int = 1,
        inter_op_threads: int = 1,
        providers: Sequence[str] | None = None,
        gpu_mem_limit: int | None = None,
        device_id: int = 0,
        spin: bool = False,
    ) -> None:
        """Args:
        version: the model version to load (platform onnxruntime_onnx).
        intra_op_threads, inter_op_threads: onnxruntime's thread pools; size them to the cores this model gets.
        providers: execution providers in order of preference; default TensorRT, CUDA, CPU, whichever installed.
        gpu_mem_limit: bytes the CUDA arena may grow to (None: onnxruntime's default, unbounded).
        device_id: which GPU.
        spin: let idle intra-op threads spin; faster hand-offs, but it burns cores that a small device lacks.
        """
        import onnxruntime as ort

        if version.config.platform != "onnxruntime_onnx":
            raise RunnerError(f"{version.path}: platform {version.config.platform!r} is not run by onnxruntime")
        if gpu_mem_limit is not None and gpu_mem_limit <= 0:
            raise ValueError(f"gpu_mem_limit must be a positive number of bytes, got {gpu_mem_limit}")
        self.version = version
        chosen = choose_providers(ort.get_available_providers(), providers)
        on_gpu = any(name in gpu.GPU_PROVIDERS for name in chosen)
        if on_gpu:
            self._check_gpu_memory(gpu_mem_limit, device_id)
        try:
            self._session = ort.InferenceSession(
                str(version.path),
                sess_options=_session_options(ort, intra_op_threads, inter_op_threads, spin),
                providers=session_providers(chosen, gpu_mem_limit, device_id),
            )
        except Exception as exc:  # onnxruntime's own errors (a device that is not there, a graph it cannot run)
            where = f"GPU {device_id} ({', '.join(chosen)})" if on_gpu else ", ".join(chosen)
            raise RunnerError(f"{version.path}: onnxruntime cannot create a session on {where}: "
                              f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
        self.output_names = tuple(output.name for output in self._session.get_outputs())
        self.input_names = tuple(value.name for value in self._session.get_inputs())

    @property
    def providers(self) -> list[str]:
        """The execution providers the session actually uses (a GPU provider may have failed to start)."""
        return list(self._session.get_providers())

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one (batched) request; returns every output of the graph by name."""
        results = self._session.run(None, inputs)
        return dict(zip(self.output_names, results, strict=True))

    def example_inputs(self, batch_size: int, *, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs of the configured shapes (variable dims as 1) for a batch of `batch_size`."""
        rng = np.random.default_rng(seed)
        config = self.version.config
        inputs: dict[str, np.ndarray] = {}
        for spec in config.inputs:
            dims = tuple(1 if dim == -1 else dim for dim in spec.shape)
            shape = (batch_size, *dims) if config.max_batch_size > 0 else dims
            dtype = NUMPY_DTYPES.get(spec.datatype)
            if dtype is None:
                raise RunnerError(f"{config.source}: input {spec.name!r} has datatype {spec.datatype}, not runnable")
            if spec.datatype == "BYTES":
                inputs[spec.name] = np.full(shape, b"", dtype=np.object_)
            elif spec.datatype == "BOOL":
                inputs[spec.name] = rng.integers(0, 2, size=shape).astype(np.bool_)
            elif np.issubdtype(dtype, np.floating):
                inputs[spec.name] = rng.standard_normal(size=shape).astype(dtype)
            else:
                inputs[spec.name] = rng.integers(0, 8, size=shape).astype(dtype)
        return inputs

    def warm_up(self, batch_sizes: Iterable[int], repeats: int = 3, *, alpha: float = 0.2) -> ComputeProfile:
        """Measure the compute time at each batch size (the fastest of `repeats` runs, after one untimed run) as a
        ComputeProfile. The fastest, not the median: other processes on a shared machine only ever add time, and
        an estimate too high refuses requests that serving would have measured, while one too low is corrected
        by the first batches (the EWMA).

        A model that does not batch (max_batch_size 0) is measured once, as batch size 1.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        max_batch_size = self.version.config.max_batch_size
        sizes = sorted(set(batch_sizes)) if max_batch_size > 0 else [1]
        if not sizes or sizes[0] < 1 or sizes[-1] > max(max_batch_size, 1):
            raise ValueError(f"batch sizes must lie in 1..{max(max_batch_size, 1)}, got {sizes}")
        measured: dict[int, float] = {}
        for size in sizes:
            inputs = self.example_inputs(size)
            self.run(inputs)  # first run per shape allocates: not what serving costs
            timings = []
            for _ in range(repeats):
                start = time.perf_counter()
                self.run(inputs)
                timings.append(time.perf_counter() - start)
            measured[size] = min(timings)
        return ComputeProfile(measured, alpha=alpha)

    def _check_gpu_memory(self, gpu_mem_limit: int | None, device_id: int) -> None:
        version_dir = self.version.path.parent
        model_bytes = sum(entry.stat().st_size for entry in version_dir.iterdir() if entry.is_file())
        needed = int(model_bytes * GPU_LOAD_FACTOR)
        if gpu_mem_limit is not None and needed > gpu_mem_limit:
            raise gpu.GpuMemoryError(
                f"{self.version.path}: needs about {needed / gpu.MiB:.0f} MiB on the GPU, more than its "
                f"gpu_mem_limit of {gpu_mem_limit / gpu.MiB:.0f} MiB"
            )
        gpu.check_fits(needed, device_id)


def _session_options(ort: Any, intra_op_threads: int, inter_op_threads: int, spin: bool) -> onnxruntime.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "1" if spin else "0")
    return options


def session_providers(
    chosen: Sequence[str], gpu_mem_limit: int | None, device_id: int
) -> list[tuple[str, dict[str, str]]]:
    """onnxruntime's `providers` argument for one session: each chosen provider with its options (`device_id`: the
    GPU this instance runs on)."""
    return [(name, provider_options(name, gpu_mem_limit, device_id)) for name in chosen]


def provider_options(name: str, gpu_mem_limit: int | None, device_id: int) -> dict[str, str]:
    """onnxruntime's options for one execution provider: the device, and the CUDA arena's cap."""
    if name == "CUDAExecutionProvider":
        options = {"device_id": str(device_id), "arena_extend_strategy": "kSameAsRequested"}
        if gpu_mem_limit is not None:
            options["gpu_mem_limit"] = str(gpu_mem_limit)
        return options
    if name == "TensorrtExecutionProvider":
        return {"device_id": str(device_id)}
    return {}
