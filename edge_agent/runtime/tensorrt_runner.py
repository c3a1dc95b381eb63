"""Run a serialized TensorRT engine (`model.plan`, platform `tensorrt_plan`) natively: TensorRT's Python API for the
engine, cuda-python's runtime API for the device buffers and the stream.

The engine is deserialized once per model version and GPU and shared by its instances; each instance (runner) has its
own execution context, CUDA stream and device buffers, which grow to the largest batch seen. At load the engine's
inputs and outputs are checked against the model config (names, datatypes, shapes, and that its optimization profile
takes every batch size up to `max_batch_size`), so a mismatch is refused naming the field instead of failing the first
request. An engine runs in the precision it was built in (FP32, FP16, INT8): its I/O datatypes are what it declares.

`tensorrt` and `cuda-python` are imported when a runner is built, never when this module is: the agent runs without
them, and a plan without them is refused with a RunnerError that says what to install.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.runtime.config import TENSORRT_PLATFORM, ModelConfigError
from edge_agent.runtime.runner import NUMPY_DTYPES, TENSORRT_RUNTIME, ModelRunner, RunnerError, check_gpu_memory
from spillway.contract.spec import ModelConfig, ModelVersion

log = logging.getLogger("spillway.agent")

INSTALL_HINT = (
    "install the tensorrt extra: pip install 'spillway[tensorrt]' (TensorRT and cuda-python). TensorRT's wheels run "
    "on NVIDIA GPUs with a CUDA 12 driver (x86_64 and SBSA arm64); on a Jetson, TensorRT comes with JetPack "
    "(python3-libnvinfer) and cuda-python from pip"
)
# TensorRT's DataType (by name) -> the V2 datatype of a tensor the agent serves. FP8, INT4 and FP4 I/O have none.
TENSORRT_DATATYPES = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "BF16": "BF16",
    "INT8": "INT8",
    "UINT8": "UINT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
}
PROFILE = 0  # the optimization profile every context runs (an engine built for batching has at least one)
_MIN_BUFFER = 256  # bytes: CUDA's allocation granularity anyway, and never a zero-byte allocation


def import_tensorrt() -> tuple[Any, Any]:
    """`tensorrt` and cuda-python's runtime module (`cuda.bindings.runtime`, `cuda.cudart` before cuda-python 12.6),
    or a RunnerError saying what to install."""
    try:
        import tensorrt
    except Exception as exc:  # ImportError, or a broken install (libnvinfer missing: OSError)
        raise RunnerError(f"a TensorRT plan needs TensorRT's Python package, which cannot be imported here "
                          f"({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc  # fmt: skip
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except Exception as exc:
            raise RunnerError(f"a TensorRT plan needs cuda-python for its device buffers, which cannot be imported "
                              f"here ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc  # fmt: skip
    return tensorrt, cudart


@dataclass(frozen=True)
class EngineTensor:
    """One input or output of the engine, as the runner binds it. Shapes include the batch dimension; an input's
    `min_shape`..`max_shape` are its optimization profile's bounds (equal to `shape` where a dimension is fixed)."""

    name: str
    is_input: bool
    datatype: str  # V2
    dtype: Any  # numpy
    shape: tuple[int, ...]  # the engine's, -1 where dynamic
    min_shape: tuple[int, ...] = ()
    opt_shape: tuple[int, ...] = ()
    max_shape: tuple[int, ...] = ()

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether an input of `shape` lies within the optimization profile."""
        return len(shape) == len(self.min_shape) and all(
            low <= size <= high for low, size, high in zip(self.min_shape, shape, self.max_shape, strict=True)
        )


class TensorRTRunner(ModelRunner):
    """One instance of a TensorRT plan: an execution context on the version's engine, on GPU `device_id`.

    `run` is safe to call from several threads (one at a time runs: a context runs one batch at a time).
    """

    def __init__(self, version: ModelVersion, *, device_id: int = 0, gpu_mem_limit: int | None = None) -> None:
        """Args:
        version: the model version to load (platform tensorrt_plan, its `model.plan`).
        device_id: the GPU to run on; the engine must have been built for this GPU model and TensorRT version.
        gpu_mem_limit: bytes the model may take on the GPU (checked against its size at load; TensorRT has no arena).
        """
        if version.config.platform != TENSORRT_PLATFORM:
            raise RunnerError(f"{version.path}: platform {version.config.platform!r} is not run by TensorRT")
        if gpu_mem_limit is not None and gpu_mem_limit <= 0:
            raise ValueError(f"gpu_mem_limit must be a positive number of bytes, got {gpu_mem_limit}")
        self.version = version
        self.device_id = device_id
        trt, cudart = import_tensorrt()
        self._trt = trt
        self._cuda = _Cuda(cudart, device_id)
        self._cuda.set_device()
        check_gpu_memory(version, gpu_mem_limit, device_id)
        self._engine = _ENGINES.acquire(trt, version.path, device_id)
        try:
            engine = self._engine.engine
            self.inputs, self.outputs = check_engine(trt, engine, version.config, version.path)
            context = engine.create_execution_context()
            if context is None:
                raise RunnerError(f"{version.path}: TensorRT cannot create an execution context on GPU {device_id} "
                                  f"({_LOG.last_error() or 'out of GPU memory?'})")  # fmt: skip
            self._context = context
            self._stream = self._cuda.call("cudaStreamCreate")
        except BaseException:
            _ENGINES.release(self._engine)
            raise
        self._buffers: dict[str, tuple[int, int]] = {}  # tensor -> (device address, capacity in bytes)
        self._lock = threading.Lock()
        self._closed = False
        self.input_names = tuple(tensor.name for tensor in self.inputs)
        self.output_names = tuple(tensor.name for tensor in self.outputs)

    @property
    def providers(self) -> list[str]:
        return [TENSORRT_RUNTIME]

    def variable_dim(self, tensor: str, axis: int) -> int:
        """Example inputs take the optimization profile's optimum for a dynamic dimension."""
        spec = next(t for t in self.inputs if t.name == tensor)
        offset = 1 if self.version.config.max_batch_size > 0 else 0
        return max(1, spec.opt_shape[axis + offset])

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy the inputs to the device, run the engine on this instance's stream, copy every output back."""
        with self._lock:
            if self._closed:
                raise RunnerError(f"{self.version.path}: the TensorRT runner is closed")
            self._cuda.set_device()  # the CUDA runtime's current device is per thread: set it on the worker's
            staged = []  # the host arrays stay alive until the stream is synchronized
            for tensor in self.inputs:
                array = self._input(tensor, inputs)
                if not self._context.set_input_shape(tensor.name, array.shape):
                    raise RunnerError(f"{self.version.path}: TensorRT refused the shape {array.shape} of input "
                                      f"{tensor.name!r}: {_LOG.last_error() or 'no reason given'}")  # fmt: skip
                address = self._buffer(tensor.name, array.nbytes)
                self._context.set_tensor_address(tensor.name, address)
                if array.nbytes:
                    self._cuda.copy(address, array.ctypes.data, array.nbytes, "cudaMemcpyHostToDevice", self._stream)
                staged.append(array)
            results: dict[str, np.ndarray] = {}
            for tensor in self.outputs:
                shape = tuple(int(d) for d in self._context.get_tensor_shape(tensor.name))
                if any(d < 0 for d in shape):
                    raise RunnerError(f"{self.version.path}: output {tensor.name!r} has a data-dependent shape "
                                      f"({shape}), which the agent's TensorRT runner does not serve")  # fmt: skip
                results[tensor.name] = np.empty(shape, dtype=tensor.dtype)
                self._context.set_tensor_address(tensor.name, self._buffer(tensor.name, results[tensor.name].nbytes))
            if not self._context.execute_async_v3(int(self._stream)):
                raise RunnerError(f"{self.version.path}: TensorRT failed to run the batch: "
                                  f"{_LOG.last_error() or 'no reason given'}")  # fmt: skip
            for name, host in results.items():
                if host.nbytes:
                    self._cuda.copy(host.ctypes.data, self._buffers[name][0], host.nbytes, "cudaMemcpyDeviceToHost",
                                    self._stream)  # fmt: skip
            self._cuda.call("cudaStreamSynchronize", self._stream)
            del staged
            return results

    def close(self) -> None:
        """Free the device buffers and the stream, drop the context, and the engine with its last instance."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._cuda.set_device()
                for address, _ in self._buffers.values():
                    self._cuda.call("cudaFree", address)
                self._cuda.call("cudaStreamDestroy", self._stream)
            except RunnerError as exc:  # a device in a bad state: what is left is freed with the process
                log.warning("closing %s: %s", self.version.path, exc)
            self._buffers.clear()
            del self._context
            _ENGINES.release(self._engine)

    def _input(self, tensor: EngineTensor, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The request's array for `tensor`, checked against the engine: present, its datatype, within the profile."""
        array = inputs.get(tensor.name)
        if array is None:
            raise RunnerError(f"{self.version.path}: input {tensor.name!r} is missing (given: {sorted(inputs)})")
        if array.dtype != tensor.dtype:
            raise RunnerError(f"{self.version.path}: input {tensor.name!r} is {array.dtype}, the engine takes "
                              f"{tensor.datatype}")  # fmt: skip
        if not tensor.fits(array.shape):
            raise RunnerError(f"{self.version.path}: input {tensor.name!r} of shape {list(array.shape)} is outside "
                              f"the engine's optimization profile {PROFILE} (min {list(tensor.min_shape)}, max "
                              f"{list(tensor.max_shape)}); rebuild the engine with a profile covering it")  # fmt: skip
        return np.ascontiguousarray(array)

    def _buffer(self, name: str, nbytes: int) -> int:
        """The device address of `name`'s buffer, grown (doubled at least) when `nbytes` no longer fits."""
        address, capacity = self._buffers.get(name, (0, 0))
        if nbytes <= capacity:
            return address
        size = max(nbytes, 2 * capacity, _MIN_BUFFER)
        if address:
            self._cuda.call("cudaFree", address)
            del self._buffers[name]
        address = int(self._cuda.call("cudaMalloc", size))
        self._buffers[name] = (address, size)
        return address


def check_engine(
    trt: Any, engine: Any, config: ModelConfig, path: Path
) -> tuple[tuple[EngineTensor, ...], tuple[EngineTensor, ...]]:
    """The engine's inputs and outputs, checked against the model config: every input is configured (and the other
    way round), every configured output exists, datatypes and dims agree, and optimization profile 0 takes every batch
    size from 1 to `max_batch_size` and every fixed dimension of the config. ModelConfigError names the field."""
    names = [engine.get_tensor_name(index) for index in range(engine.num_io_tensors)]
    if engine.num_optimization_profiles > 1:
        log.info("%s: the engine has %d optimization profiles; the agent runs profile %d", path,
                 engine.num_optimization_profiles, PROFILE)  # fmt: skip
    found = {name: _engine_tensor(trt, engine, name, path) for name in names}
    engine_inputs = {name: t for name, t in found.items() if t.is_input}
    engine_outputs = {name: t for name, t in found.items() if not t.is_input}
    for field, specs, tensors in (("input", config.inputs, engine_inputs), ("output", config.outputs, engine_outputs)):
        for spec in specs:
            where = f"{config.source}: {field} {spec.name!r}"
            tensor = tensors.get(spec.name)
            if tensor is None:
                raise ModelConfigError(f"{where}: field 'name': the engine in {path} has no such {field} "
                                       f"({sorted(tensors)})")  # fmt: skip
            if tensor.datatype != spec.datatype:
                raise ModelConfigError(f"{where}: field 'data_type': {spec.datatype} in the config, "
                                       f"{tensor.datatype} in the engine in {path}")  # fmt: skip
            _check_dims(config, spec.shape, tensor, where, path)
    extra = sorted(set(engine_inputs) - {spec.name for spec in config.inputs})
    if extra:
        raise ModelConfigError(f"{config.source}: field 'input': the engine in {path} also needs input(s) {extra}")
    return tuple(engine_inputs.values()), tuple(engine_outputs.values())


def _engine_tensor(trt: Any, engine: Any, name: str, path: Path) -> EngineTensor:
    is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
    kind = "input" if is_input else "output"
    if engine.is_shape_inference_io(name):
        raise ModelConfigError(f"{path}: {kind} {name!r} is a shape tensor, which the agent's TensorRT runner does "
                               "not serve")  # fmt: skip
    trt_type = getattr(engine.get_tensor_dtype(name), "name", "?")
    datatype = TENSORRT_DATATYPES.get(trt_type)
    dtype = NUMPY_DTYPES.get(datatype or "")
    if datatype is None or dtype is None:
        raise ModelConfigError(f"{path}: {kind} {name!r} is TensorRT {trt_type}, which has no datatype the agent "
                               "serves (numpy has no bfloat16, FP8 or INT4); rebuild the engine with FP32, FP16 or "
                               "integer I/O")  # fmt: skip
    shape = tuple(int(d) for d in engine.get_tensor_shape(name))
    if not is_input:
        return EngineTensor(name, False, datatype, dtype, shape)
    low, opt, high = (tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, PROFILE))
    return EngineTensor(name, True, datatype, dtype, shape, low, opt, high)


def _check_dims(config: ModelConfig, dims: tuple[int, ...], tensor: EngineTensor, where: str, path: Path) -> None:
    """The config's `dims` (plus the batch dimension when batching) against the engine's shape and profile."""
    batching = config.max_batch_size > 0
    shape = tensor.shape
    if len(shape) != len(dims) + batching:
        batch_note = " plus the batch dimension" if batching else ""
        raise ModelConfigError(f"{where}: field 'dims': {list(dims)}{batch_note} is rank {len(dims) + batching}, but "
                               f"the engine in {path} has rank {len(shape)} ({list(shape)})")  # fmt: skip
    if batching:
        if shape[0] != -1:
            raise ModelConfigError(f"{where}: field 'max_batch_size': {config.max_batch_size} needs a dynamic first "
                                   f"dimension, but the engine in {path} fixes it to {shape[0]}")  # fmt: skip
        if tensor.is_input and not tensor.min_shape[0] <= 1 <= config.max_batch_size <= tensor.max_shape[0]:
            raise ModelConfigError(f"{where}: field 'max_batch_size': batches of 1..{config.max_batch_size} are "
                                   f"served, but the engine in {path} takes {tensor.min_shape[0]}.."
                                   f"{tensor.max_shape[0]} (its optimization profile {PROFILE}); lower max_batch_size "
                                   "or rebuild the engine with that range")  # fmt: skip
    offset = 1 if batching else 0
    for axis, configured in enumerate(dims):
        actual = shape[axis + offset]
        if actual != -1 and configured != -1 and configured != actual:
            raise ModelConfigError(f"{where}: field 'dims': {list(dims)} in the config, {list(shape[offset:])} in "
                                   f"the engine in {path}")  # fmt: skip
        if actual == -1 and configured != -1 and tensor.is_input:
            low, high = tensor.min_shape[axis + offset], tensor.max_shape[axis + offset]
            if not low <= configured <= high:
                raise ModelConfigError(f"{where}: field 'dims': dimension {axis} is {configured} in the config, but "
                                       f"the engine in {path} takes {low}..{high} there (its optimization profile "
                                       f"{PROFILE})")  # fmt: skip


class _Cuda:
    """cuda-python's runtime calls on one GPU, their status checked: an error is a RunnerError naming the call."""

    def __init__(self, cudart: Any, device_id: int) -> None:
        self._rt = cudart
        self.device_id = device_id

    def call(self, name: str, *args: Any) -> Any:
        """`cudart.<name>(*args)`: its one result (None when it has none); a RunnerError when it fails."""
        result = getattr(self._rt, name)(*args)
        status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if int(getattr(status, "value", status) or 0) != 0:
            raise RunnerError(f"GPU {self.device_id}: {name} failed: {self._describe(status)}")
        return values[0] if len(values) == 1 else (values or None)

    def set_device(self) -> None:
        self.call("cudaSetDevice", self.device_id)

    def copy(self, destination: int, source: int, nbytes: int, kind: str, stream: Any) -> None:
        self.call("cudaMemcpyAsync", destination, source, nbytes, getattr(self._rt.cudaMemcpyKind, kind), stream)

    def _describe(self, status: Any) -> str:
        try:
            name = self._rt.cudaGetErrorName(status)[1]
        except Exception:  # the name is a courtesy: the status alone still says what failed
            return str(status)
        return name.decode() if isinstance(name, bytes) else str(name)


class _TensorRTLog:
    """TensorRT's logger (one per process, as TensorRT wants): warnings and errors go to the agent's log, and each
    thread's last error is kept to explain a call that failed."""

    def __init__(self) -> None:
        self._instance: Any = None
        self._errors: collections.deque[tuple[int, str]] = collections.deque(maxlen=16)
        self._lock = threading.Lock()

    def logger(self, trt: Any) -> Any:
        with self._lock:
            if self._instance is None:
                self._instance = self._make(trt)
            return self._instance

    def last_error(self) -> str | None:
        me = threading.get_ident()
        return next((message for thread, message in reversed(self._errors) if thread == me), None)

    def _make(self, trt: Any) -> Any:
        errors = self._errors

        class Logger(trt.ILogger):
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity: Any, msg: str) -> None:
                level = getattr(severity, "name", str(severity))
                if "ERROR" in level:
                    errors.append((threading.get_ident(), msg))
                    log.error("TensorRT: %s", msg)
                elif "WARNING" in level:
                    log.warning("TensorRT: %s", msg)
                else:
                    log.debug("TensorRT: %s", msg)

        return Logger()


_LOG = _TensorRTLog()


@dataclass(eq=False)
class _SharedEngine:
    key: tuple[str, int, int, int]
    runtime: Any  # kept alive as long as its engine
    engine: Any
    users: int = 0


class _Engines:
    """Deserialized engines shared by the instances of a version on one GPU (the weights are on the device once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, int, int, int], _SharedEngine] = {}

    def acquire(self, trt: Any, path: Path, device_id: int) -> _SharedEngine:
        try:
            stat = path.stat()
            key = (str(path.resolve()), device_id, stat.st_mtime_ns, stat.st_size)
            with self._lock:
                shared = self._by_key.get(key)
                if shared is None:
                    shared = self._load(trt, path, key)
                    self._by_key[key] = shared
                shared.users += 1
                return shared
        except OSError as exc:
            raise RunnerError(f"{path}: cannot read the TensorRT engine: {exc}") from exc

    def release(self, shared: _SharedEngine) -> None:
        with self._lock:
            shared.users -= 1
            if shared.users <= 0 and self._by_key.get(shared.key) is shared:
                del self._by_key[shared.key]

    def loaded(self) -> int:
        """How many engines are held (for tests)."""
        with self._lock:
            return len(self._by_key)

    @staticmethod
    def _load(trt: Any, path: Path, key: tuple[str, int, int, int]) -> _SharedEngine:
        runtime = trt.Runtime(_LOG.logger(trt))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            version = getattr(trt, "__version__", "?")
            raise RunnerError(f"{path}: TensorRT {version} cannot deserialize this engine "
                              f"({_LOG.last_error() or 'not a TensorRT engine'}); an engine runs only on the TensorRT "
                              "version and GPU model it was built with: build it again on this device (trtexec "
                              "--onnx=model.onnx --saveEngine=model.plan)")  # fmt: skip
        return _SharedEngine(key, runtime, engine)


_ENGINES = _Engines()
