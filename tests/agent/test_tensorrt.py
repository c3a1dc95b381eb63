"""TensorRT: the native runner for `model.plan` engines, and the options of onnxruntime's TensorRT execution provider.

No GPU or TensorRT here: the runner is tested at its seam, the `tensorrt` and `cuda.bindings.runtime` imports, with a
fake TensorRT (engines are JSON files describing their tensors and profile; running one doubles its input) and a fake
CUDA runtime whose device memory is host memory, so the runner's real copies, shapes and buffer growth are exercised.
The last test runs a real engine and is skipped where TensorRT or a GPU is absent.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import itertools
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime
import pytest

from edge_agent.config import AgentConfig
from edge_agent.runtime.config import (
    ModelConfigError,
    config_hints,
    load_model_config,
    parse_config_file,
    tensorrt_accelerator,
)
from edge_agent.runtime.repository import load_repository
from edge_agent.runtime.runner import (
    OrtRunner,
    RunnerError,
    create_runner,
    engine_cache_dir,
    runner_providers,
    session_providers,
)
from edge_agent.serving.app import InferenceApp
from edge_agent.serving.server import build_registry
from spillway.demo.models import CONFIG_PBTXT, DemoVariant, build_mlp
from tests.utils.server import serving

TRT_EP, CUDA_EP, CPU_EP = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"

PLAN_CONFIG = """\
platform: "tensorrt_plan"
max_batch_size: 32
input [ {{ name: "input" data_type: {dtype} dims: [ {dims} ] }} ]
output [ {{ name: "output" data_type: {dtype} dims: [ {dims} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
"""


# ---- the fake GPU: a CUDA runtime whose device memory is host memory, and a TensorRT that runs JSON engines ----------


class FakeGpu:
    """What the fake CUDA runtime and the fake engines share: the device's allocations, by address."""

    def __init__(self) -> None:
        self.memory: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.addresses = itertools.count(0x10000, 0x10000)
        self.allocations: list[int] = []  # sizes, in order
        self.streams: set[int] = set()
        self.devices: set[int] = set()
        self.fail_malloc = False

    def view(self, address: int, nbytes: int) -> memoryview:
        block = self.memory[address]
        assert nbytes <= len(block), f"{nbytes} bytes at {address:#x}: the buffer holds {len(block)}"
        return memoryview(block).cast("B")[:nbytes]


class Status(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevice = 101


class MemcpyKind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


def fake_cudart(gpu: FakeGpu, device_count: int = 2) -> types.ModuleType:
    """cuda-python's `cuda.bindings.runtime`, as far as the runner uses it: each call returns (status, *results)."""
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaError_t = Status  # type: ignore[attr-defined]
    rt.cudaMemcpyKind = MemcpyKind  # type: ignore[attr-defined]

    def set_device(device: int) -> tuple[Status]:
        if device >= device_count:
            return (Status.cudaErrorInvalidDevice,)
        gpu.devices.add(device)
        return (Status.cudaSuccess,)

    def malloc(size: int) -> tuple[Status, int]:
        if gpu.fail_malloc:
            return Status.cudaErrorMemoryAllocation, 0
        address = next(gpu.addresses)
        gpu.memory[address] = ctypes.create_string_buffer(size)
        gpu.allocations.append(size)
        return Status.cudaSuccess, address

    def free(address: int) -> tuple[Status]:
        del gpu.memory[address]
        return (Status.cudaSuccess,)

    def memcpy_async(dst: int, src: int, count: int, kind: MemcpyKind, stream: FakeStream) -> tuple[Status]:
        assert int(stream) in gpu.streams
        if kind == MemcpyKind.cudaMemcpyHostToDevice:
            gpu.view(dst, count)[:] = ctypes.string_at(src, count)
        else:
            ctypes.memmove(dst, bytes(gpu.view(src, count)), count)
        return (Status.cudaSuccess,)

    def stream_create() -> tuple[Status, FakeStream]:
        stream = FakeStream(next(gpu.addresses))
        gpu.streams.add(stream.handle)
        return Status.cudaSuccess, stream

    def stream_destroy(stream: FakeStream) -> tuple[Status]:
        gpu.streams.remove(int(stream))
        return (Status.cudaSuccess,)

    rt.cudaSetDevice = set_device  # type: ignore[attr-defined]
    rt.cudaMalloc = malloc  # type: ignore[attr-defined]
    rt.cudaFree = free  # type: ignore[attr-defined]
    rt.cudaMemcpyAsync = memcpy_async  # type: ignore[attr-defined]
    rt.cudaStreamCreate = stream_create  # type: ignore[attr-defined]
    rt.cudaStreamDestroy = stream_destroy  # type: ignore[attr-defined]
    rt.cudaStreamSynchronize = lambda stream: (Status.cudaSuccess,)  # type: ignore[attr-defined]
    rt.cudaGetErrorName = lambda status: (Status.cudaSuccess, status.name.encode())  # type: ignore[attr-defined]
    return rt


DataType = enum.Enum("DataType", "FLOAT HALF BF16 INT8 UINT8 INT32 INT64 BOOL FP8")
TensorIOMode = enum.Enum("TensorIOMode", "NONE INPUT OUTPUT")


class FakeEngine:
    """An engine from a JSON plan: `tensors` [{name, mode, dtype, shape, profile: [min, opt, max]}], and `doubles`
    {output: input}; its context writes 2 * input to the output."""

    def __init__(self, plan: dict[str, Any], gpu: FakeGpu) -> None:
        self.tensors = {t["name"]: t for t in plan["tensors"]}
        self.doubles: dict[str, str] = plan["doubles"]
        self.gpu = gpu
        self.num_io_tensors = len(self.tensors)
        self.num_optimization_profiles = 1
        self.contexts = 0

    def get_tensor_name(self, index: int) -> str:
        return list(self.tensors)[index]

    def get_tensor_mode(self, name: str) -> Any:
        return TensorIOMode[self.tensors[name]["mode"]]

    def get_tensor_dtype(self, name: str) -> Any:
        return DataType[self.tensors[name]["dtype"]]

    def get_tensor_shape(self, name: str) -> list[int]:
        return list(self.tensors[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[list[int]]:
        assert profile == 0 and self.tensors[name]["mode"] == "INPUT"
        return [list(dims) for dims in self.tensors[name]["profile"]]

    def is_shape_inference_io(self, name: str) -> bool:
        return bool(self.tensors[name].get("shape_tensor", False))

    def create_execution_context(self) -> FakeContext:
        self.contexts += 1
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        low, _, high = self.engine.tensors[name]["profile"]
        if not all(a <= s <= b for a, s, b in zip(low, shape, high, strict=True)):
            return False  # as TensorRT: outside the profile, refused
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.engine.doubles[name]]

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        assert isinstance(stream_handle, int) and stream_handle in self.engine.gpu.streams
        for output, source in self.engine.doubles.items():
            dtype = np.dtype(_NUMPY[self.engine.tensors[source]["dtype"]])
            shape = self.shapes[source]
            nbytes = int(np.prod(shape)) * dtype.itemsize
            values = np.frombuffer(bytes(self.engine.gpu.view(self.addresses[source], nbytes)), dtype=dtype)
            self.engine.gpu.view(self.addresses[output], nbytes)[:] = (values * 2).astype(dtype).tobytes()
        return True


_NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32}


def fake_tensorrt(gpu: FakeGpu) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.99.0-fake"  # type: ignore[attr-defined]
    trt.deserialized = []  # type: ignore[attr-defined]

    class ILogger:
        Severity = enum.Enum("Severity", "INTERNAL_ERROR ERROR WARNING INFO VERBOSE")

        def __init__(self) -> None:
            pass

    class Runtime:
        def __init__(self, logger: ILogger) -> None:
            self.logger = logger

        def deserialize_cuda_engine(self, data: bytes) -> FakeEngine | None:
            try:
                plan = json.loads(data)
            except ValueError:
                self.logger.log(ILogger.Severity.ERROR, "IRuntime::deserializeCudaEngine: magic tag does not match")  # type: ignore[attr-defined]
                return None
            trt.deserialized.append(plan)
            return FakeEngine(plan, gpu)

    trt.ILogger = ILogger  # type: ignore[attr-defined]
    trt.Runtime = Runtime  # type: ignore[attr-defined]
    trt.TensorIOMode = TensorIOMode  # type: ignore[attr-defined]
    trt.DataType = DataType  # type: ignore[attr-defined]
    return trt


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    """The fakes in place of `tensorrt` and `cuda.bindings.runtime`, where the runner imports them."""
    fake = FakeGpu()
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    runtime = fake_cudart(fake)
    cuda.bindings, bindings.runtime = bindings, runtime  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(fake))
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    yield fake


def tensor(
    name: str, mode: str, dtype: str, shape: list[int], profile: list[list[int]] | None = None
) -> dict[str, Any]:
    found: dict[str, Any] = {"name": name, "mode": mode, "dtype": dtype, "shape": shape}
    if profile is not None:
        found["profile"] = profile
    return found


def doubler_plan(dtype: str = "FLOAT", width: int | None = 4, max_batch: int = 32) -> dict[str, Any]:
    """An engine doubling `input` [batch, width] (width -1: dynamic, 1..16) into `output`."""
    dims = [-1, width if width is not None else -1]
    profile = [[1, width or 1], [8, width or 8], [max_batch, width or 16]]
    return {"tensors": [tensor("input", "INPUT", dtype, dims, profile), tensor("output", "OUTPUT", dtype, dims)],
            "doubles": {"output": "input"}}  # fmt: skip


def plan_repo(root: Path, plan: dict[str, Any], *, dtype: str = "TYPE_FP32", dims: str = "4", name: str = "doubler",
              config: str | None = None) -> Path:  # fmt: skip
    """`root/<name>/{config.pbtxt, 1/model.plan}`, the plan being the fake engine's JSON."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.plan").write_text(json.dumps(plan))
    (root / name / "config.pbtxt").write_text(config or PLAN_CONFIG.format(dtype=dtype, dims=dims))
    return root


# ---- the native runner ---------------------------------------------------------------------------------------------


def test_a_plan_loads_checked_against_its_config_and_runs_on_device_buffers(gpu: FakeGpu, tmp_path: Path) -> None:
    version = load_repository(plan_repo(tmp_path, doubler_plan())).get("doubler")
    runner = create_runner(version, device_id=1)  # the loader's seam picks TensorRT for platform tensorrt_plan

    assert type(runner).__name__ == "TensorRTRunner" and runner.providers == ["TensorRT"]
    assert gpu.devices == {1}
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    outputs = runner.run({"input": batch})
    assert list(outputs) == ["output"]
    np.testing.assert_array_equal(outputs["output"], batch * 2)
    allocated = len(gpu.allocations)
    runner.run({"input": batch[:1]})  # smaller: the buffers are reused
    assert len(gpu.allocations) == allocated
    big = np.ones((32, 4), dtype=np.float32)  # the profile's max batch: the buffers grow
    np.testing.assert_array_equal(runner.run({"input": big})["output"], big * 2)
    assert len(gpu.allocations) == allocated + 2 and max(gpu.allocations) >= big.nbytes
    profile = runner.warm_up([1, 32], repeats=1)  # the worker's warm-up, through the same path
    assert sorted(profile.snapshot()) == [1, 32]

    runner.close()
    runner.close()  # idempotent
    assert gpu.memory == {} and gpu.streams == set()  # every buffer and the stream freed
    with pytest.raises(RunnerError, match="closed"):
        runner.run({"input": batch})


def test_instances_share_one_engine_each_with_its_own_context(gpu: FakeGpu, tmp_path: Path) -> None:
    from edge_agent.runtime.tensorrt_runner import _ENGINES

    version = load_repository(plan_repo(tmp_path, doubler_plan())).get("doubler")
    first, second = create_runner(version), create_runner(version)
    trt = sys.modules["tensorrt"]

    assert len(trt.deserialized) == 1 and _ENGINES.loaded() == 1
    x = np.ones((2, 4), dtype=np.float32)
    np.testing.assert_array_equal(first.run({"input": x})["output"], second.run({"input": 3 * x})["output"] / 3)
    first.close()
    assert _ENGINES.loaded() == 1  # still used by the second instance
    second.close()
    assert _ENGINES.loaded() == 0


def test_shapes_outside_the_optimization_profile_are_refused_clearly(gpu: FakeGpu, tmp_path: Path) -> None:
    version = load_repository(plan_repo(tmp_path, doubler_plan(width=None), dims="-1")).get("doubler")
    runner = create_runner(version)

    assert runner.example_inputs(2)["input"].shape == (2, 8)  # a dynamic dim takes the profile's optimum
    np.testing.assert_array_equal(runner.run({"input": np.ones((2, 16), np.float32)})["output"], 2)
    with pytest.raises(RunnerError, match=r"input 'input' of shape \[2, 17\] is outside the engine's optimization "
                                          r"profile 0 \(min \[1, 1\], max \[32, 16\]\)"):  # fmt: skip
        runner.run({"input": np.ones((2, 17), np.float32)})
    with pytest.raises(RunnerError, match=r"of shape \[33, 4\] is outside"):
        runner.run({"input": np.ones((33, 4), np.float32)})
    with pytest.raises(RunnerError, match="is float64, the engine takes FP32"):
        runner.run({"input": np.ones((1, 4))})
    with pytest.raises(RunnerError, match="input 'input' is missing"):
        runner.run({})
    np.testing.assert_array_equal(runner.run({"input": np.ones((1, 3), np.float32)})["output"], 2)  # still serves
    runner.close()


@pytest.mark.parametrize(("engine_type", "config_type", "dtype"), [("HALF", "TYPE_FP16", np.float16),
                                                                  ("INT8", "TYPE_INT8", np.int8),
                                                                  ("INT32", "TYPE_INT32", np.int32)])  # fmt: skip
def test_fp16_and_int8_engines_run_in_the_precision_they_were_built_in(
    gpu: FakeGpu, tmp_path: Path, engine_type: str, config_type: str, dtype: Any
) -> None:
    version = load_repository(plan_repo(tmp_path, doubler_plan(engine_type), dtype=config_type)).get("doubler")
    runner = create_runner(version)
    batch = np.arange(8, dtype=dtype).reshape(2, 4)

    out = runner.run({"input": batch})["output"]

    assert out.dtype == dtype
    np.testing.assert_array_equal(out, batch * 2)
    runner.close()


def _edit(plan: dict[str, Any], **changes: Any) -> dict[str, Any]:
    edited = json.loads(json.dumps(plan))
    edited["tensors"][0].update(changes)
    return edited


MISMATCHES = [  # (plan, config dtype, config dims, what the error names)
    (_edit(doubler_plan(), dtype="HALF"), "TYPE_FP32", "4", r"input 'input': field 'data_type': FP32 in the config, "
                                                            r"FP16 in the engine"),
    (_edit(doubler_plan(), name="pixels"), "TYPE_FP32", "4", r"input 'input': field 'name': the engine .* has no such"),
    (_edit(doubler_plan(), shape=[-1, 4, 1]), "TYPE_FP32", "4", r"field 'dims': \[4\] plus the batch dimension is "
                                                                r"rank 2, but the engine .* has rank 3"),
    (_edit(doubler_plan(), shape=[8, 4]), "TYPE_FP32", "4", r"field 'max_batch_size': 32 needs a dynamic first"),
    (doubler_plan(max_batch=16), "TYPE_FP32", "4", r"field 'max_batch_size': batches of 1\.\.32 are served, but the "
                                                   r"engine .* takes 1\.\.16"),
    (doubler_plan(), "TYPE_FP32", "5", r"field 'dims': \[5\] in the config, \[4\] in the engine"),
    (doubler_plan(width=None), "TYPE_FP32", "20", r"dimension 0 is 20 in the config, but the engine .* takes 1\.\.16"),
    (_edit(doubler_plan(), dtype="FP8"), "TYPE_FP32", "4", r"input 'input' is TensorRT FP8, which has no datatype"),
    (_edit(doubler_plan(), dtype="BF16"), "TYPE_BF16", "4", r"is TensorRT BF16, which has no datatype .* bfloat16"),
    (_edit(doubler_plan(), shape_tensor=True), "TYPE_FP32", "4", r"input 'input' is a shape tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("plan", "dtype", "dims", "error"), MISMATCHES)
def test_an_engine_that_disagrees_with_its_config_is_refused_naming_the_field(
    gpu: FakeGpu, tmp_path: Path, plan: dict[str, Any], dtype: str, dims: str, error: str
) -> None:
    version = load_repository(plan_repo(tmp_path, plan, dtype=dtype, dims=dims)).get("doubler")

    with pytest.raises(ModelConfigError, match=error):
        create_runner(version)
    assert gpu.streams == set()  # nothing left behind by a refused load


def test_an_engine_input_the_config_lacks_is_refused(gpu: FakeGpu, tmp_path: Path) -> None:
    plan = doubler_plan()
    plan["tensors"].append(tensor("mask", "INPUT", "FLOAT", [-1, 4], [[1, 4], [1, 4], [32, 4]]))
    version = load_repository(plan_repo(tmp_path, plan)).get("doubler")
    with pytest.raises(ModelConfigError, match=r"field 'input': the engine .* also needs input\(s\) \['mask'\]"):
        create_runner(version)


def test_a_plan_tensorrt_cannot_deserialize_is_refused_with_its_reason(gpu: FakeGpu, tmp_path: Path) -> None:
    version = load_repository(plan_repo(tmp_path, doubler_plan())).get("doubler")
    version.path.write_bytes(b"\x00 an engine from another TensorRT")

    refused = r"TensorRT 10\.99\.0-fake cannot deserialize this engine \(IRuntime::deserializeCudaEngine: magic tag"
    with pytest.raises(RunnerError, match=refused + r" does not match\).*build it again"):
        create_runner(version)


def test_a_gpu_cuda_refuses_is_a_runner_error_naming_the_call(gpu: FakeGpu, tmp_path: Path) -> None:
    version = load_repository(plan_repo(tmp_path, doubler_plan())).get("doubler")
    with pytest.raises(RunnerError, match="GPU 7: cudaSetDevice failed: cudaErrorInvalidDevice"):
        create_runner(version, device_id=7)
    runner = create_runner(version)
    gpu.fail_malloc = True
    with pytest.raises(RunnerError, match="cudaMalloc failed: cudaErrorMemoryAllocation"):
        runner.run({"input": np.ones((1, 4), np.float32)})
    runner.close()


def test_without_tensorrt_a_plan_is_refused_saying_what_to_install(tmp_path: Path, monkeypatch: Any) -> None:
    version = load_repository(plan_repo(tmp_path, doubler_plan())).get("doubler")
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as where it is not installed

    with pytest.raises(RunnerError, match=r"TensorRT's Python package.*pip install 'spillway\[tensorrt\]'.*NVIDIA GPUs"
                                          r".*JetPack"):  # fmt: skip
        create_runner(version)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(FakeGpu()))
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RunnerError, match=r"needs cuda-python .*spillway\[tensorrt\]"):
        create_runner(version)


# ---- served by the agent -----------------------------------------------------------------------------------------


def test_the_agent_serves_a_plan_through_the_fakes_and_a_v2_request_gets_its_answer(gpu: FakeGpu,
                                                                                   tmp_path: Path) -> None:  # fmt: skip
    repo = plan_repo(tmp_path / "models", doubler_plan())
    config = AgentConfig(model_repository=repo, intra_op_threads=1, state_dir=tmp_path / "state")
    registry = build_registry(config)  # the agent's own loader: load_model -> create_runner -> TensorRTRunner
    try:
        (loaded,) = registry.of("doubler")
        assert loaded.providers == ("TensorRT",)
        with serving(InferenceApp(registry)) as url:  # type: ignore[arg-type]
            body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4], "data": list(range(8))}]}
            answer = httpx.post(f"{url}/v2/models/doubler/infer", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            (output,) = answer.json()["outputs"]
            assert (output["name"], output["shape"], output["data"]) == ("output", [2, 4], [2 * i for i in range(8)])
            wrong = httpx.post(f"{url}/v2/models/doubler/infer", timeout=30,
                               json={"inputs": [{**body["inputs"][0], "shape": [2, 3], "data": [0] * 6}]})  # fmt: skip
            assert wrong.status_code == 400, wrong.text  # the config's dims: refused before the engine
    finally:
        for worker in registry.workers():
            worker.close()


# ---- onnxruntime's TensorRT execution provider gets the config's options ------------------------------------------

TRT_OPTIMIZATION = """optimization { %s execution_accelerators { gpu_execution_accelerator: [
  { name: "tensorrt" %s } ] } }
"""


def trt_config(tmp_path: Path, *parameters: tuple[str, str], inside: str = "", extra: str = "") -> Path:
    """mlp's demo config with a `tensorrt` accelerator of these parameters (and `inside` the optimization, `extra`
    fields), in tmp_path/mlp."""
    text = " ".join(f'parameters {{ key: "{k}" value: "{v}" }}' for k, v in parameters)
    folder = tmp_path / "mlp"
    folder.mkdir(exist_ok=True)
    (folder / "config.pbtxt").write_text(CONFIG_PBTXT + (TRT_OPTIMIZATION % (inside, text)) + extra)
    return folder


def test_the_tensorrt_accelerator_becomes_the_execution_providers_options(tmp_path: Path) -> None:
    folder = trt_config(tmp_path, ("precision_mode", "FP16"), ("max_workspace_size_bytes", "1073741824"),
                        ("trt_timing_cache_enable", "true"), ("trt_builder_optimization_level", "3"))  # fmt: skip
    accelerator = tensorrt_accelerator(parse_config_file(folder / "config.pbtxt"), folder / "config.pbtxt")
    assert accelerator is not None and accelerator.precision == "FP16" and accelerator.engine_cache

    version = dataclasses.replace(_onnx_version(tmp_path), config=load_model_config(folder))
    cache = engine_cache_dir(version, accelerator, tmp_path / "state")
    assert cache == tmp_path / "state" / "tensorrt-engines" / "mlp" and cache.is_dir()  # per model, under state_dir
    options = dict(session_providers([TRT_EP, CUDA_EP, CPU_EP], 1 << 30, 1, tensorrt=accelerator, cache_dir=cache))
    assert options[TRT_EP] == {
        "device_id": "1", "trt_fp16_enable": "True", "trt_int8_enable": "False", "trt_max_workspace_size": "1073741824",
        "trt_timing_cache_enable": "True", "trt_builder_optimization_level": "3", "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache), "trt_timing_cache_path": str(cache),
    }  # fmt: skip
    assert options[CUDA_EP]["device_id"] == "1" and options[CPU_EP] == {}

    int8 = trt_config(tmp_path, ("precision_mode", "INT8"), ("trt_engine_cache_enable", "0"))
    accelerator = tensorrt_accelerator(parse_config_file(int8 / "config.pbtxt"), int8 / "config.pbtxt")
    assert accelerator is not None and engine_cache_dir(version, accelerator, tmp_path) is None  # turned off
    assert dict(session_providers([TRT_EP], None, 0, tensorrt=accelerator))[TRT_EP] == {
        "device_id": "0", "trt_fp16_enable": "False", "trt_int8_enable": "True"}  # fmt: skip


def _onnx_version(tmp_path: Path) -> Any:
    """A small ONNX mlp (the demo's config and tensors) at tmp_path/mlp/1/model.onnx."""
    (tmp_path / "mlp" / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(build_mlp(DemoVariant(version=1, label="tiny", hidden=(8,))), str(tmp_path / "mlp" / "1" / "model.onnx"))
    if not (tmp_path / "mlp" / "config.pbtxt").exists():
        (tmp_path / "mlp" / "config.pbtxt").write_text(CONFIG_PBTXT)
    return load_repository(tmp_path).get("mlp", 1)


def test_the_onnx_runner_hands_the_options_to_onnxruntime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trt_config(tmp_path, ("precision_mode", "FP16"))
    version = _onnx_version(tmp_path)
    sessions: list[Any] = []
    real = onnxruntime.InferenceSession

    def session(path: str, *, sess_options: Any, providers: list[Any]) -> Any:
        sessions.append(providers)  # what the runner asked for; the session itself runs on the CPU here
        return real(path, sess_options=sess_options, providers=[CPU_EP])

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [TRT_EP, CUDA_EP, CPU_EP])
    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    monkeypatch.setattr("edge_agent.runtime.gpu.check_fits", lambda *args, **kwargs: None)  # no GPU to measure
    runner = OrtRunner(version, state_dir=tmp_path / "state", device_id=1)

    (providers,) = sessions
    assert [name for name, _ in providers] == [TRT_EP, CUDA_EP, CPU_EP]
    trt_options = providers[0][1]
    assert trt_options["trt_fp16_enable"] == "True" and trt_options["device_id"] == "1"
    assert trt_options["trt_engine_cache_path"] == str(tmp_path / "state" / "tensorrt-engines" / "mlp")
    assert runner.run(runner.example_inputs(2))["output"].shape == (2, 1000)


REFUSED = [
    ((("precision_mode", "FP8"),), r"\[precision_mode\]': 'FP8' is not a precision TensorRT builds in"),
    ((("max_workspace", "1"),), r"\[max_workspace\]': not a TensorRT parameter the agent knows"),
    ((("max_workspace_size_bytes", "lots"),), r"\[max_workspace_size_bytes\]': 'lots' is not a whole"),
    ((("max_workspace_size_bytes", "0"),), r"\[max_workspace_size_bytes\]': 0 is outside >= 1"),
    ((("trt_engine_cache_enable", "yes"),), r"\[trt_engine_cache_enable\]': 'yes' is not a boolean"),
    ((("trt_engine_cache_path", "cache"),), r"\[trt_engine_cache_path\]': 'cache' is not an absolute"),
    ((("trt_builder_optimization_level", "9"),), r"\[trt_builder_optimization_level\]': 9 is outside 0\.\.5"),
    ((("int8_calibration_table_name", "t.cache"),), r"\[int8_calibration_table_name\]': needs precision_mode INT8"),
]  # fmt: skip


@pytest.mark.parametrize(("parameters", "error"), REFUSED)
def test_unknown_tensorrt_parameters_and_bad_values_are_refused_at_load_naming_the_field(
    tmp_path: Path, parameters: tuple[tuple[str, str], ...], error: str
) -> None:
    folder = trt_config(tmp_path, *parameters)
    with pytest.raises(ModelConfigError, match=r"field 'optimization\.execution_accelerators\."
                                               r"gpu_execution_accelerator\[0\]\.parameters" + error):  # fmt: skip
        load_model_config(folder)


def test_a_second_tensorrt_accelerator_is_refused(tmp_path: Path) -> None:
    folder = trt_config(tmp_path, ("precision_mode", "FP16"))
    text = (
        (folder / "config.pbtxt").read_text().replace('{ name: "tensorrt"', '{ name: "tensorrt" }, { name: "tensorrt"')
    )
    (folder / "config.pbtxt").write_text(text)
    with pytest.raises(ModelConfigError, match=r"gpu_execution_accelerator\[1\]\.name': a second 'tensorrt'"):
        load_model_config(folder)


def test_the_hints_stop_saying_the_accelerator_is_ignored_when_it_is_honoured(tmp_path: Path) -> None:
    message = parse_config_file(trt_config(tmp_path, ("precision_mode", "FP16")) / "config.pbtxt")
    assert not [h for h in config_hints(message, "mlp", [TRT_EP, CUDA_EP, CPU_EP]) if "optimization" in h]
    (cpu_hint,) = [h for h in config_hints(message, "mlp", [CPU_EP]) if "optimization" in h]
    assert "optimization (execution_accelerators: tensorrt) is not honoured" in cpu_hint

    graph = parse_config_file(trt_config(tmp_path, ("precision_mode", "FP16"), inside="priority: PRIORITY_MAX")
                              / "config.pbtxt")  # fmt: skip
    (rest,) = [h for h in config_hints(graph, "mlp", [TRT_EP, CPU_EP]) if "optimization" in h]
    assert "optimization (priority) is not honoured" in rest and "its tensorrt accelerator is" in rest

    folder = trt_config(tmp_path, ("precision_mode", "FP16"))
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("onnxruntime_onnx", "tensorrt_plan"))
    plan = parse_config_file(config)
    plan.instance_group[0].kind = plan.instance_group[0].KIND_GPU
    hints = config_hints(plan, "mlp", ["TensorRT"])
    assert next(h for h in hints if "optimization" in h).endswith("a TensorRT plan runs as its engine was built "
                                                                 "(precision, workspace and shapes were fixed when it "
                                                                 "was built)")  # fmt: skip
    assert not [h for h in hints if "kind" in h]  # a plan runs on the GPU: KIND_GPU is honoured


def test_what_a_version_runs_on_is_known_before_it_loads(tmp_path: Path) -> None:
    plan = load_repository(plan_repo(tmp_path / "a", doubler_plan())).get("doubler")
    onnx_version = _onnx_version(tmp_path / "b")
    assert runner_providers(plan, [CPU_EP]) == ["TensorRT"]
    assert runner_providers(onnx_version, [TRT_EP, CPU_EP], [CPU_EP]) == [CPU_EP]
    assert isinstance(create_runner(onnx_version), OrtRunner)


# ---- on a real GPU --------------------------------------------------------------------------------------------------


def _real_gpu() -> str | None:
    """Why a real TensorRT run is not possible here (None: it is)."""
    try:
        import tensorrt  # noqa: F401
        from cuda.bindings import runtime as cudart
    except Exception as exc:
        return (
            f"TensorRT or cuda-python is not installed ({type(exc).__name__}: {exc}); pip install 'spillway[tensorrt]'"
        )
    status, count = cudart.cudaGetDeviceCount()
    if int(getattr(status, "value", status)) != 0 or count < 1:
        return f"no CUDA GPU ({status})"
    return None


def test_a_real_engine_built_from_mlp_answers_as_onnxruntime(tmp_path: Path) -> None:
    reason = _real_gpu()
    if reason is not None:
        pytest.skip(f"needs a GPU with TensorRT: {reason}")
    import tensorrt as trt

    variant = DemoVariant(version=1, label="tiny", hidden=(64,))
    model = build_mlp(variant)
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, builder.logger)
    assert parser.parse(model.SerializeToString()), [parser.get_error(i) for i in range(parser.num_errors)]
    settings = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("input", (1, 512), (8, 512), (64, 512))
    settings.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, settings)
    repo = tmp_path / "models"
    (repo / "mlp" / "1").mkdir(parents=True)
    (repo / "mlp" / "1" / "model.plan").write_bytes(bytes(engine))
    (repo / "mlp" / "config.pbtxt").write_text(CONFIG_PBTXT.replace("onnxruntime_onnx", "tensorrt_plan"))
    runner = create_runner(load_repository(repo).get("mlp", 1))
    inputs = runner.example_inputs(5, seed=3)
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=[CPU_EP]).run(None, inputs)[0]

    np.testing.assert_allclose(runner.run(inputs)["output"], expected, rtol=1e-3, atol=1e-3)
    runner.close()


@pytest.fixture(autouse=True)
def _no_registry_leak() -> Iterator[None]:
    """Drop the engines a test's runners still share (the agent's workers do not close their runners)."""
    yield
    from edge_agent.runtime.tensorrt_runner import _ENGINES

    with _ENGINES._lock:
        _ENGINES._by_key.clear()
