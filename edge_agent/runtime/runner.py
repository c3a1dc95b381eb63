"""Run one model version: ONNX models with ONNX Runtime on the best installed provider (TensorRT EP, CUDA EP, CPU),
TensorRT plans with the native TensorRT runner (`tensorrt_runner.py`); `create_runner` picks by the platform.

onnxruntime and TensorRT are imported when a runner is built, not when this module is, so the API and the scheduler
load without them. On a GPU the CUDA arena is bounded and free memory is checked before the session is created. The
TensorRT execution provider gets the model config's `tensorrt` accelerator options (precision, workspace, ...) and
keeps the engines it builds in a folder per model under the agent's state directory, so a restart does not rebuild.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.errors import AgentError
from edge_agent.runtime import gpu
from edge_agent.runtime.config import TENSORRT_PLATFORM, TensorrtAccelerator, read_config_message, tensorrt_accelerator
from edge_agent.runtime.profile import ComputeProfile
from spillway.contract.spec import ModelVersion

if TYPE_CHECKING:
    import onnxruntime

PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
TENSORRT_EP = "TensorrtExecutionProvider"
# What a TensorRT plan runs on (its runner's `providers`): TensorRT itself, on a GPU; not an onnxruntime provider.
TENSORRT_RUNTIME = "TensorRT"
# Under the agent's state_dir: a folder per model holding the engines the TensorRT execution provider built.
ENGINE_CACHE_FOLDER = "tensorrt-engines"
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
    create on the device asked for, TensorRT absent or an engine it cannot run)."""


def choose_providers(available: Iterable[str], requested: Sequence[str] | None = None) -> list[str]:
    """The requested (default: TensorRT, CUDA, CPU) providers that are installed, in order of preference."""
    installed = set(available)
    chosen = [name for name in (requested or PREFERRED_PROVIDERS) if name in installed]
    if not chosen:
        raise RunnerError(f"none of the providers {list(requested or PREFERRED_PROVIDERS)} is installed ({installed})")
    return chosen


def runner_providers(
    version: ModelVersion, available: Iterable[str], requested: Sequence[str] | None = None
) -> list[str]:
    """What `version` will run on, before it is loaded: TensorRT for a plan, else the onnxruntime providers chosen
    (`choose_providers`). For the GPU checks that come before a load (placement, free memory)."""
    if version.config.platform == TENSORRT_PLATFORM:
        return [TENSORRT_RUNTIME]
    return choose_providers(available, requested)


def create_runner(
    version: ModelVersion,
    *,
    intra_op_threads: int = 1,
    inter_op_threads: int = 1,
    providers: Sequence[str] | None = None,
    gpu_mem_limit: int | None = None,
    device_id: int = 0,
    spin: bool = False,
    state_dir: Path | None = None,
    memory_checked: bool = False,
) -> ModelRunner:
    """One instance of `version` on the runner its platform needs: a TensorRT plan on the native TensorRT runner (on
    GPU `device_id`; `providers` and the thread settings do not apply), anything else on onnxruntime (`OrtRunner`).
    `state_dir`: the agent's, where the TensorRT execution provider keeps its engines. `memory_checked`: the agent's
    memory guard has checked the load against free memory (`OrtRunner`)."""
    if version.config.platform == TENSORRT_PLATFORM:
        from edge_agent.runtime.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(version, device_id=device_id, gpu_mem_limit=gpu_mem_limit)
    return OrtRunner(version, intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads,
                     providers=providers, gpu_mem_limit=gpu_mem_limit, device_id=device_id, spin=spin,
                     state_dir=state_dir, memory_checked=memory_checked)  # fmt: skip


class ModelRunner:
    """One instance of a model version, as the scheduler's worker runs its batches: `run`, the providers it runs on,
    `close`, and what warm-up needs (random example inputs, the compute profile it measures)."""

    version: ModelVersion

    @property
    def providers(self) -> list[str]:
        raise NotImplementedError

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one (batched) request; returns every output of the model by name."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the runner holds (a session, device memory); idempotent. `run` may not be called after."""

    def variable_dim(self, tensor: str, axis: int) -> int:
        """The size example inputs give a variable dimension (`axis` of input `tensor`, not counting the batch)."""
        return 1

    def example_inputs(self, batch_size: int, *, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs of the configured shapes (variable dims as `variable_dim`) for a batch of `batch_size`."""
        rng = np.random.default_rng(seed)
        config = self.version.config
        inputs: dict[str, np.ndarray] = {}
        for spec in config.inputs:
            dims = tuple(
                self.variable_dim(spec.name, axis) if dim == -1 else dim for axis, dim in enumerate(spec.shape)
            )
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


def check_gpu_memory(version: ModelVersion, gpu_mem_limit: int | None, device_id: int, *,
                     free_memory: bool = True) -> None:  # fmt: skip
    """Refuse (GpuMemoryError) a version whose files alone exceed its `gpu_mem_limit`, or (with `free_memory`) whose
    files times GPU_LOAD_FACTOR exceed the memory free on GPU `device_id` (where NVML can tell). The agent's memory
    guard checks the finer need (measured at an earlier load, or estimated) on every device before a load: a runner
    it placed skips the free-memory estimate, which would count the instances loaded before it twice."""
    version_dir = version.path.parent
    model_bytes = sum(entry.stat().st_size for entry in version_dir.iterdir() if entry.is_file())
    if gpu_mem_limit is not None and model_bytes > gpu_mem_limit:
        raise gpu.GpuMemoryError(
            f"{version.path}: its files alone take {model_bytes / gpu.MiB:.0f} MiB, more than its "
            f"gpu_mem_limit of {gpu_mem_limit / gpu.MiB:.0f} MiB"
        )
    if free_memory:
        gpu.check_fits(int(model_bytes * GPU_LOAD_FACTOR), device_id)


class OrtRunner(ModelRunner):
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
        state_dir: Path | None = None,
        memory_checked: bool = False,
    ) -> None:
        """Args:
        version: the model version to load (platform onnxruntime_onnx).
        intra_op_threads, inter_op_threads: onnxruntime's thread pools; size them to the cores this model gets.
        providers: execution providers in order of preference; default TensorRT, CUDA, CPU, whichever installed.
        gpu_mem_limit: bytes the CUDA arena may grow to (None: onnxruntime's default, unbounded).
        device_id: which GPU.
        spin: let idle intra-op threads spin; faster hand-offs, but it burns cores that a small device lacks.
        state_dir: the agent's; the TensorRT execution provider's engines go to a folder of it (default: the agent's
            default state directory).
        memory_checked: the agent's memory guard has checked this load against the device's free memory; only the
            cap is checked here.
        """
        import onnxruntime as ort

        if version.config.platform != "onnxruntime_onnx":
            raise RunnerError(f"{version.path}: platform {version.config.platform!r} is not run by onnxruntime")
        if gpu_mem_limit is not None and gpu_mem_limit <= 0:
            raise ValueError(f"gpu_mem_limit must be a positive number of bytes, got {gpu_mem_limit}")
        self.version = version
        chosen = choose_providers(ort.get_available_providers(), providers)
        on_gpu = any(name in gpu.GPU_PROVIDERS for name in chosen)
        tensorrt, cache_dir = None, None
        if TENSORRT_EP in chosen:
            tensorrt = tensorrt_accelerator(read_config_message(version.config), version.config.source)
            cache_dir = engine_cache_dir(version, tensorrt, state_dir)
        if on_gpu:
            check_gpu_memory(version, gpu_mem_limit, device_id, free_memory=not memory_checked)
        try:
            self._session = ort.InferenceSession(
                str(version.path),
                sess_options=_session_options(ort, intra_op_threads, inter_op_threads, spin),
                providers=session_providers(chosen, gpu_mem_limit, device_id, tensorrt=tensorrt, cache_dir=cache_dir),
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


def engine_cache_dir(
    version: ModelVersion, tensorrt: TensorrtAccelerator | None, state_dir: Path | None
) -> Path | None:
    """The folder the TensorRT execution provider keeps this model's engines in, created (None: the config turns the
    cache off): the config's `trt_engine_cache_path`, else `<state_dir>/tensorrt-engines/<model>`. onnxruntime names
    each engine by the graph's hash and the GPU, so the versions of a model share it."""
    if tensorrt is not None and not tensorrt.engine_cache:
        return None
    if tensorrt is not None and tensorrt.engine_cache_path is not None:
        folder = Path(tensorrt.engine_cache_path)
    else:
        if state_dir is None:
            from edge_agent.config import default_state_dir

            state_dir = default_state_dir()
        folder = state_dir / ENGINE_CACHE_FOLDER / version.config.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunnerError(f"{version.path}: cannot create the TensorRT engine cache {folder}: {exc}") from exc
    return folder


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
    chosen: Sequence[str],
    gpu_mem_limit: int | None,
    device_id: int,
    *,
    tensorrt: TensorrtAccelerator | None = None,
    cache_dir: Path | None = None,
) -> list[tuple[str, dict[str, str]]]:
    """onnxruntime's `providers` argument for one session: each chosen provider with its options (`device_id`: the
    GPU this instance runs on; `tensorrt`, `cache_dir`: the TensorRT execution provider's, `provider_options`)."""
    return [(name, provider_options(name, gpu_mem_limit, device_id, tensorrt=tensorrt, cache_dir=cache_dir))
            for name in chosen]  # fmt: skip


def provider_options(
    name: str,
    gpu_mem_limit: int | None,
    device_id: int,
    *,
    tensorrt: TensorrtAccelerator | None = None,
    cache_dir: Path | None = None,
) -> dict[str, str]:
    """onnxruntime's options for one execution provider: the device, and the CUDA arena's cap; for the TensorRT
    execution provider, the model config's `tensorrt` accelerator options (precision, workspace, ...; `tensorrt`)
    and the engine cache in `cache_dir` (None: no cache), with the timing cache beside it when the config asks."""
    if name == "CUDAExecutionProvider":
        options = {"device_id": str(device_id), "arena_extend_strategy": "kSameAsRequested"}
        if gpu_mem_limit is not None:
            options["gpu_mem_limit"] = str(gpu_mem_limit)
        return options
    if name == TENSORRT_EP:
        options = {"device_id": str(device_id), **(tensorrt.options if tensorrt is not None else {})}
        if cache_dir is not None:
            options["trt_engine_cache_enable"] = "True"
            options["trt_engine_cache_path"] = str(cache_dir)
            if tensorrt is not None and tensorrt.timing_cache:
                options["trt_timing_cache_path"] = str(cache_dir)
        return options
    return {}
