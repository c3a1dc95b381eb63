"""GPU memory and placement: free memory per device (NVML, MIG devices, cudaMemGetInfo, the host's and a Jetson's
RAM), a model's need (estimated from its files, then measured and remembered), the refusals (free memory, the
per-model cap, the agent's GPU budget) and the per-device gauges.

No GPU here: NVML is a hand-written stand-in (`FakeNvml`, shaped as nvidia-ml-py's functions) put in
`sys.modules['pynvml']` or handed to the probe, the CUDA runtime a stand-in with cudaMemGetInfo's ctypes calling
convention, and /proc/meminfo and the Tegra files are files in tmp_path. That is all this verifies: none of it ran
against a real driver here. onnxruntime is real (CPU), and so is the OpenTelemetry SDK."""

from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from edge_agent.config import AgentConfig, GenerationSettings
from edge_agent.generation.load import load_engine
from edge_agent.runtime import gpu
from edge_agent.runtime import runner as runner_module
from edge_agent.runtime.config import ModelConfigError
from edge_agent.runtime.devices import MemoryProbe
from edge_agent.runtime.memory import (
    NEEDS_FILE,
    HostMemoryError,
    MemoryGuard,
    NeedBook,
    check_load_fits,
    model_gpu_mem_limit,
    parse_bytes,
)
from edge_agent.runtime.repository import generative_models, load_repository
from edge_agent.runtime.runner import OrtRunner
from edge_agent.serving.models import LoadedModel, ModelRegistry
from edge_agent.telemetry.probes import Nvml, register_probes
from spillway.demo.tiny_lm import TINY, build_tiny_lm_version

MiB = 1 << 20
GiB = 1 << 30
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]


class NVMLError(Exception):
    pass


class Device:
    def __init__(self, uuid: str, total: int, free: int, *, mig: list[Device | None] | None = None) -> None:
        self.uuid, self.total, self.free, self.mig = uuid, total, free, mig
        self.broken = False  # its memory cannot be read


class Holder:
    """Something that holds a loaded model's memory (weakly referable, as LoadedModel and EnginePool are)."""


class FakeNvml:
    """nvidia-ml-py's functions the agent calls, over a list of devices (a GPU with `mig` is in MIG mode; None is an
    empty MIG slot); init and shutdown are counted."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, *gpus: Device) -> None:
        self.gpus = list(gpus)
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Device:
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: Device) -> bytes:
        return handle.uuid.encode()  # older nvidia-ml-py releases answer bytes

    def nvmlDeviceGetMemoryInfo(self, handle: Device) -> SimpleNamespace:
        if handle.broken:
            raise NVMLError("Not Supported")
        return SimpleNamespace(free=handle.free, total=handle.total, used=handle.total - handle.free)

    def nvmlDeviceGetMigMode(self, handle: Device) -> list[int]:
        if handle.mig is None:
            raise NVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Device) -> int:
        return len(handle.mig or [])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Device, index: int) -> Device:
        found = (handle.mig or [])[index]
        if found is None:
            raise NVMLError("Not Found")
        return found

    def nvmlDeviceGetUtilizationRates(self, handle: Device) -> SimpleNamespace:
        if handle.uuid.startswith("MIG-"):
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=40, memory=10)

    def nvmlDeviceGetTemperature(self, handle: Device, _sensor: int) -> int:
        return 55


class FakeCudart:
    """The CUDA runtime's cudaGetDevice, cudaSetDevice and cudaMemGetInfo as ctypes calls them (byref arguments,
    cudaError_t 0 for success), over (free, total) per ordinal; the thread's current device is tracked."""

    def __init__(self, memory: list[tuple[int, int]]) -> None:
        self.memory, self.current = memory, 0

    def cudaGetDevice(self, device: Any) -> int:
        device._obj.value = self.current
        return 0

    def cudaSetDevice(self, device: ctypes.c_int) -> int:
        if not 0 <= device.value < len(self.memory):
            return 101  # cudaErrorInvalidDevice
        self.current = device.value
        return 0

    def cudaMemGetInfo(self, free: Any, total: Any) -> int:
        free._obj.value, total._obj.value = self.memory[self.current]
        return 0


def no_library() -> Any:
    raise OSError("not installed")


def meminfo(tmp_path: Path, available: int, total: int = 8 * GiB) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {total // 1024} kB\nMemFree: 1000 kB\nMemAvailable: {available // 1024} kB\n")
    return path


def probe(tmp_path: Path, nvml: FakeNvml | None = None, *, cudart: FakeCudart | None = None, jetson: bool = False,
          available: int = 4 * GiB, env: dict[str, str] | None = None) -> MemoryProbe:  # fmt: skip
    release = tmp_path / "nv_tegra_release"
    if jetson:
        release.write_text("# R36 (release), REVISION: 4.0\n")
    return MemoryProbe(nvml=(lambda: nvml) if nvml is not None else no_library,
                       cudart=(lambda: cudart) if cudart is not None else no_library,
                       meminfo=meminfo(tmp_path, available), tegra_release=release,
                       device_tree=tmp_path / "compatible", environ=env or {})  # fmt: skip


def two_gpus() -> FakeNvml:
    return FakeNvml(Device("GPU-aaaa-0000", 16 * GiB, 10 * GiB), Device("GPU-bbbb-1111", 24 * GiB, 500 * MiB))


def weights(tmp_path: Path, name: str, size: int) -> Path:
    folder = tmp_path / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "model.onnx").open("wb") as file:
        file.truncate(size)  # sparse: its size is what a need is estimated from
    return folder


# ---- free memory per device ----------------------------------------------------------------------------------------


def test_nvml_reads_each_device_through_cuda_visible_devices_as_cuda_numbers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = two_gpus()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the default loader imports it
    plain = MemoryProbe(cudart=no_library, meminfo=meminfo(tmp_path, 3 * GiB), environ={})
    first, second = plain.read(0), plain.read(1)
    assert (first.device, first.free, first.total, first.source) == ("0", 10 * GiB, 16 * GiB, "nvml")
    assert (second.device, second.free, second.describe()) == ("1", 500 * MiB, "GPU 1 (NVML)")
    assert gpu.free_gpu_memory(1, probe=plain) == 500 * MiB and gpu.device_count(plain) == 2
    # No GPU 2: neither NVML nor a CUDA runtime can tell, so the host's memory is what is read (and said).
    assert plain.gpu(2) is None
    host = plain.read(2)
    assert (host.device, host.free, host.source, host.on_gpu) == ("host", 3 * GiB, "meminfo", False)
    assert nvml.inits == nvml.shutdowns > 0  # every reading shuts down what it started
    # CUDA_VISIBLE_DEVICES=1: CUDA's device 0 is NVML's GPU 1 (NVML ignores the variable); by UUID too.
    for visible in ("1", "GPU-bbbb", "GPU-bbbb-1111,0"):
        remapped = MemoryProbe(cudart=no_library, environ={"CUDA_VISIBLE_DEVICES": visible})
        assert (remapped.read(0).device, remapped.read(0).free) == ("1", 500 * MiB), visible
    assert MemoryProbe(cudart=no_library, environ={"CUDA_VISIBLE_DEVICES": "1,-1,0"}).gpu_count() == 1
    assert MemoryProbe(cudart=no_library, environ={"CUDA_VISIBLE_DEVICES": "1"}).gpu(1) is None
    assert plain.read(1, gpu=False).source == "meminfo"  # a CPU session's memory is the host's


def test_mig_devices_are_read_by_uuid_by_cuda_visible_devices_and_as_their_gpus_first(tmp_path: Path) -> None:
    slices = [Device("MIG-1111-aaaa", 10 * GiB, 9 * GiB), None, Device("MIG-2222-bbbb", 20 * GiB, 3 * GiB)]
    nvml = FakeNvml(Device("GPU-cccc", 80 * GiB, 70 * GiB, mig=slices), Device("GPU-dddd", 16 * GiB, 16 * GiB))
    reading = probe(tmp_path, nvml).read("MIG-2222-bbbb")
    assert (reading.device, reading.free, reading.total, reading.source, reading.parent) == (
        "MIG-2222-bbbb", 3 * GiB, 20 * GiB, "nvml-mig", "0")  # fmt: skip
    assert reading.describe() == "MIG device MIG-2222-bbbb of GPU 0 (NVML)" and reading.on_gpu
    remapped = probe(tmp_path, nvml, env={"CUDA_VISIBLE_DEVICES": "MIG-2222"})  # an abbreviated UUID, as CUDA takes
    assert remapped.read(0).device == "MIG-2222-bbbb"
    assert probe(tmp_path, nvml).read(0).device == "MIG-1111-aaaa"  # a GPU in MIG mode: its first MIG device
    assert probe(tmp_path, nvml).read(1).device == "1"  # the other GPU is not in MIG mode
    assert probe(tmp_path, nvml).read("MIG-9999").source == "meminfo"  # no such device: unknown to NVML


def test_without_nvml_cuda_mem_get_info_answers_per_device_and_puts_the_threads_device_back(tmp_path: Path) -> None:
    cudart = FakeCudart([(6 * GiB, 8 * GiB), (1 * GiB, 8 * GiB)])
    cudart.current = 0
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,MIG-5555"}
    reading = probe(tmp_path, cudart=cudart, env=env).read(1)
    assert (reading.device, reading.free, reading.total, reading.source) == ("1", 1 * GiB, 8 * GiB, "cudart")
    assert reading.describe() == "GPU 1 (cudaMemGetInfo)"
    assert cudart.current == 0  # cudaSetDevice(1) for the reading, then the thread's device again
    assert probe(tmp_path, cudart=cudart, env=env).read("MIG-5555").free == 1 * GiB  # its CUDA ordinal: 1
    assert probe(tmp_path, env=env).ordinal("MIG-5555") == 1 and probe(tmp_path).ordinal("MIG-5555") is None
    assert probe(tmp_path, cudart=cudart).read(7).source == "meminfo"  # cudaErrorInvalidDevice: the host's


def test_a_jetson_reads_its_shared_ram_and_a_machine_without_meminfo_refuses_nothing(tmp_path: Path) -> None:
    jetson = probe(tmp_path, two_gpus(), jetson=True, available=5 * GiB)
    reading = jetson.read(0)  # NVML aside (a Jetson's does not report its memory): the RAM its GPU shares
    assert (reading.device, reading.free, reading.source, reading.kind) == ("host", 5 * GiB, "jetson", "host")
    (tmp_path / "dt").mkdir()
    (tmp_path / "dt" / "compatible").write_bytes(b"nvidia,p3768-0000+p3767-0005\0nvidia,tegra234\0")
    by_tree = MemoryProbe(nvml=no_library, cudart=no_library, tegra_release=tmp_path / "none",
                          device_tree=tmp_path / "dt" / "compatible")  # fmt: skip
    (tmp_path / "other").mkdir()
    assert by_tree.jetson and not probe(tmp_path / "other").jetson
    blind = MemoryProbe(nvml=no_library, cudart=no_library, meminfo=tmp_path / "absent", environ={})
    unknown = blind.read(0)
    assert (unknown.free, unknown.source) == (None, "unknown")
    guard = MemoryGuard(blind)
    need = guard.need("m", 1, weights(tmp_path, "m", 4 * MiB), placements=[0], on_gpu=True)
    assert guard.check(need)[0].reading.free is None  # nothing measured: nothing refused


# ---- a model's need: estimated, then measured and remembered --------------------------------------------------------


def test_what_a_load_took_is_measured_per_instance_remembered_and_used_for_the_next_load(tmp_path: Path) -> None:
    nvml = two_gpus()
    book = tmp_path / "state" / NEEDS_FILE
    guard = MemoryGuard(probe(tmp_path, nvml), NeedBook(book), headroom=0)
    folder = weights(tmp_path, "m", 100 * MiB)
    need = guard.need("m", 1, folder, placements=[0, 0], on_gpu=True)
    assert (need.per_instance, need.basis) == (150 * MiB, "estimated as 1.5 x its files' 100 MiB")
    holder = SimpleNamespace()
    with guard.loading(need) as load:
        nvml.gpus[0].free -= 700 * MiB  # what the two instances really took: weights, activations, workspace
        holding = load.done(holder)
    assert holding.per_device == {"0": 700 * MiB} and holding.on_gpu
    # A fresh guard (the agent restarted, or the version comes back as a variant) reads the book.
    again = MemoryGuard(probe(tmp_path, nvml), NeedBook(book), headroom=0)
    remembered = again.need("m", 1, folder, placements=[1], on_gpu=True)
    assert (remembered.per_instance, remembered.basis) == (350 * MiB, "measured at its last load")
    assert again.need("m", 1, folder, placements=[1], on_gpu=False).basis.startswith("estimated")  # host: not known
    weights(tmp_path, "m", 120 * MiB)  # new files under the same version: estimated again
    assert again.need("m", 1, folder, placements=[1], on_gpu=True).per_instance == 180 * MiB
    # A reading disturbed by another process (memory freed meanwhile) is not taken as the model's need.
    with again.loading(again.need("n", 1, weights(tmp_path, "n", MiB), placements=[0], on_gpu=True)) as load:
        nvml.gpus[0].free += 50 * MiB
        load.done(SimpleNamespace())
    assert NeedBook(book).measured("n", "1", "gpu", MiB) is None


def test_the_need_of_a_generative_model_adds_its_kv_budget_as_loaded(tmp_path: Path) -> None:
    folder = build_tiny_lm_version(tmp_path / "repo" / "lm", 1, TINY)
    (tmp_path / "repo" / "lm" / "config.pbtxt").write_text(
        'platform: "onnxruntime_decoder"\nparameters { key: "gpu_mem_limit" value { string_value: "1GiB" } }\n'
    )
    config = generative_models(tmp_path / "repo")["lm"].config  # its cap is no generation setting: not refused
    assert model_gpu_mem_limit(config)[0] == GiB
    guard = MemoryGuard(probe(tmp_path, available=2 * GiB), headroom=0)
    settings = GenerationSettings(kv_budget_bytes=8 * MiB)
    pool = load_engine("lm", folder, settings, model=config, providers=CPU, memory=guard)
    try:
        (holding,) = guard.held()
        kv = sum(engine.scheduler.blocks.total for engine in pool.instances) * settings.block_size * \
            pool.instances[0].runner.kv.bytes_per_token  # fmt: skip
        assert 0 < kv <= 8 * MiB and holding.label == "lm v1" and not holding.on_gpu
        files = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        assert holding.per_device == {"host": int(files * 1.5) + kv}  # nothing measured (the file did not change)
    finally:
        pool.close()
    # The KV budget alone does not fit the RAM left: refused before anything loads, naming the KV part.
    tight = MemoryGuard(probe(tmp_path, available=8 * MiB), headroom=0)
    with pytest.raises(HostMemoryError, match=r"lm v1 needs about \d+ MiB \(1 instance x \d+ MiB, estimated .* "
                       r"\+ 8 MiB of KV budget\) .* only 8 MiB of host memory are available"):  # fmt: skip
        load_engine("lm", folder, settings, providers=CPU, memory=tight)
    assert tight.held() == []


def test_a_real_onnxruntime_load_is_measured_on_the_host_and_held_until_released(tmp_path: Path) -> None:
    version = load_repository(tiny_repository(tmp_path)).get("add", 1)
    info = meminfo(tmp_path, 2 * GiB)
    guard = MemoryGuard(MemoryProbe(nvml=no_library, cudart=no_library, meminfo=info, environ={}),
                        NeedBook(tmp_path / NEEDS_FILE), headroom=0)  # fmt: skip
    need = guard.need_of(version, placements=[0], providers=CPU)
    assert not need.on_gpu
    with guard.loading(need) as load:
        runner = OrtRunner(version, providers=CPU)
        meminfo(tmp_path, 2 * GiB - 40 * MiB)  # what /proc/meminfo says after the session is made
        load.done(runner)
    out = runner.run({"x": np.ones((2, 4), np.float32)})["y"]
    assert out.tolist() == [[2.0] * 4] * 2
    assert NeedBook(tmp_path / NEEDS_FILE).measured("add", "1", "host", need.weights) == 40 * MiB
    assert [h.per_device for h in guard.held()] == [{"host": 40 * MiB}]
    guard.release(runner)
    guard.release(runner)  # idempotent
    assert guard.held() == []


def tiny_repository(tmp_path: Path, parameters: str = "") -> Path:
    """`add`: y = x + 1 over [-1, 4] floats, with its config."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    root = tmp_path / "repo"
    (root / "add" / "1").mkdir(parents=True)
    onnx.save(model, root / "add" / "1" / "model.onnx")
    (root / "add" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [4] }]\noutput [{ name: "y" data_type: TYPE_FP32 dims: [4] }]\n'
        + parameters
    )
    return root


# ---- refusals ------------------------------------------------------------------------------------------------------


def test_a_load_that_does_not_fit_a_devices_free_memory_is_refused_naming_model_device_need_and_free(
    tmp_path: Path,
) -> None:
    nvml = two_gpus()
    book = NeedBook()
    book.remember("m", "2", "gpu", 100 * MiB, 300 * MiB)
    guard = MemoryGuard(probe(tmp_path, nvml), book)
    folder = weights(tmp_path, "m", 100 * MiB)
    on_both = guard.need("m", 2, folder, placements=[0, 1, 0], on_gpu=True)
    with pytest.raises(gpu.GpuMemoryError) as refused:
        guard.check(on_both)
    assert str(refused.value) == (
        "m v2 needs about 300 MiB (1 instance x 300 MiB, measured at its last load) on GPU 1 (NVML) plus 256 MiB "
        "headroom, but only 500 MiB are free there; free memory, place its instances on another device "
        "(instance_group.gpus) or serve a lighter variant"
    )
    checked = guard.check(guard.need("m", 2, folder, placements=[0, 0], on_gpu=True))  # GPU 0: 2 x 300 of 10 GiB
    assert [(r.device, count, n) for r, count, n in checked] == [("0", 2, 600 * MiB)]
    # The same on a Jetson (the RAM its GPU shares) and on a CPU (the host's): each instance adds up.
    jetson = MemoryGuard(probe(tmp_path, jetson=True, available=700 * MiB), book)
    with pytest.raises(HostMemoryError, match=r"m v2 needs about 450 MiB \(3 instances x 150 MiB, estimated .*\) "
                       r"plus 256 MiB .* only 700 MiB of the Jetson's RAM \(shared by its CPU and GPU\)"):  # fmt: skip
        jetson.check(jetson.need("m", 2, folder, placements=[0, 1, 0], on_gpu=True))


def test_the_per_model_cap_refuses_weights_it_cannot_hold_and_bounds_the_estimate(tmp_path: Path) -> None:
    root = tiny_repository(tmp_path, 'parameters { key: "gpu_mem_limit" value { string_value: "64" } }\n')
    version = load_repository(root).get("add", 1)
    where = f"parameters['gpu_mem_limit'] of {version.config.source}"
    assert model_gpu_mem_limit(version.config, 5 * GiB) == (64, where)
    assert model_gpu_mem_limit(None, 5 * GiB) == (5 * GiB, "the agent's gpu_mem_limit")
    guard = MemoryGuard(probe(tmp_path, two_gpus()))
    need = guard.need_of(version, placements=[0], providers=CUDA, agent_cap=5 * GiB)
    with pytest.raises(gpu.GpuMemoryError, match=r"add v1: its files alone take \d+ MiB, more than its gpu_mem_limit "
                       r"of 0 MiB \(parameters\['gpu_mem_limit'\] of .*config.pbtxt\), which bounds each session's "
                       "CUDA arena"):  # fmt: skip
        guard.check(need)
    guard.check(guard.need_of(version, placements=[0], providers=CPU, agent_cap=None))  # no arena on a CPU
    capped = guard.need("m", 1, weights(tmp_path, "m", 100 * MiB), placements=[0], on_gpu=True, cap=120 * MiB)
    assert capped.per_instance == 120 * MiB  # 1.5 x 100 MiB, but the arena stops at the cap
    assert [parse_bytes(v) for v in ("1073741824", "2GiB", "512MiB", "64 M", "3kb")] == [GiB, 2 * GiB, 512 * MiB,
                                                                                          64 * MiB, 3072]  # fmt: skip
    bad = tiny_repository(tmp_path / "bad", 'parameters { key: "gpu_mem_limit" value { string_value: "lots" } }\n')
    with pytest.raises(ModelConfigError, match=r"config.pbtxt: parameters\['gpu_mem_limit'\]: 'lots' is not a size"):
        guard.need_of(load_repository(bad).get("add", 1), placements=[0], providers=CUDA)


def test_the_agent_wide_gpu_budget_counts_what_the_loaded_models_hold_until_they_are_released(tmp_path: Path) -> None:
    nvml = two_gpus()
    guard = MemoryGuard(probe(tmp_path, nvml), headroom=0, budget=1 * GiB)
    first = LoadedModel(SimpleNamespace(name="a"), 1, worker=None)  # type: ignore[arg-type]
    with guard.loading(guard.need("a", 1, weights(tmp_path, "a", 10 * MiB), placements=[0], on_gpu=True)) as load:
        nvml.gpus[0].free -= 700 * MiB
        load.done(first)
    need = guard.need("b", 3, weights(tmp_path, "b", 200 * MiB), placements=[0, 0], on_gpu=True)
    with pytest.raises(gpu.GpuBudgetError) as refused:
        guard.check(need)
    assert str(refused.value) == (
        "b v3 needs about 600 MiB of GPU memory (2 instances x 300 MiB, estimated as 1.5 x its files' 200 MiB), but "
        "the agent's gpu_memory_budget_bytes of 1024 MiB has 324 MiB left (held: a v1 700 MiB); unload a model, serve "
        "a lighter variant or raise gpu_memory_budget_bytes"
    )
    assert isinstance(refused.value, gpu.GpuMemoryError)  # the repository API and policies refuse it the same way
    assert guard.json()["gpu_bytes_held"] == 700 * MiB
    guard.check(guard.need("c", 1, weights(tmp_path, "c", 10 * MiB), placements=[0], on_gpu=False))  # host: not GPU
    # The registry releases a version once it has answered its queue and closed (a switch away, an unload).
    registry = ModelRegistry([first])
    registry.memory = guard
    registry.retired(registry.retire("a", 1))
    assert guard.held() == [] and guard.check(need)
    # A version loaded and then dropped without being served (a policy refused for a later load) is released too.
    dropped = guard.load(guard.need("d", 1, weights(tmp_path, "d", MiB), placements=[0], on_gpu=True), Holder)
    assert len(guard.held()) == 1 and isinstance(dropped, Holder)
    del dropped
    gc.collect()
    assert guard.held() == []


def test_the_agents_guard_takes_its_headroom_budget_and_state_dir(tmp_path: Path) -> None:
    agent = AgentConfig(model_repository=tmp_path, state_dir=tmp_path / "state", load_headroom_bytes=MiB,
                        gpu_memory_budget_bytes=3 * GiB)  # fmt: skip
    guard = MemoryGuard.for_agent(agent, probe(tmp_path))
    assert (guard.headroom, guard.budget, guard.book.path) == (MiB, 3 * GiB, tmp_path / "state" / NEEDS_FILE)


def test_the_check_beside_a_running_version_keeps_its_words_and_reads_the_gpu_first(tmp_path: Path) -> None:
    version = load_repository(tiny_repository(tmp_path)).get("add", 1)
    info = meminfo(tmp_path, 300 * MiB)
    assert check_load_fits(version, CPU, headroom=0, meminfo=info) == "host"
    with pytest.raises(HostMemoryError, match=r"add v1 needs about 0 MiB .* only 300 MiB of host memory are available"):
        check_load_fits(version, CPU, headroom=300 * MiB, meminfo=info)


# ---- per-device gauges ---------------------------------------------------------------------------------------------


def gauges(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], float]]]:
    data = reader.get_metrics_data()
    found: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points = metric.data.data_points
                found[metric.name] = [
                    (dict(p.attributes or {}), p.value) for p in points if isinstance(p, NumberDataPoint)
                ]
    return found


def test_gpu_memory_gauges_per_device_and_per_mig_device() -> None:
    slices = [Device("MIG-1111", 10 * GiB, 9 * GiB), None, Device("MIG-2222", 20 * GiB, 3 * GiB)]
    nvml = FakeNvml(Device("GPU-a", 80 * GiB, 50 * GiB, mig=slices), Device("GPU-b", 16 * GiB, 12 * GiB))
    reader = InMemoryMetricReader()
    register_probes(MeterProvider(metric_readers=[reader]).get_meter("t"), nvml=Nvml(lambda: nvml))
    found = gauges(reader)
    usage = {a["hw.id"]: (a.get("hw.parent"), v) for a, v in found["hw.gpu.memory.usage"]}
    # GPU 0 is in MIG mode: its memory is its MIG devices' (its own reading would count them twice in a sum).
    assert usage == {"MIG-1111": ("0", GiB), "MIG-2222": ("0", 17 * GiB), "1": (None, 4 * GiB)}
    limit = {a["hw.id"]: v for a, v in found["hw.gpu.memory.limit"]}
    assert limit == {"MIG-1111": 10 * GiB, "MIG-2222": 20 * GiB, "1": 16 * GiB}
    assert all(a["hw.type"] == "gpu" for a, _ in found["hw.gpu.memory.usage"])
    assert {a["hw.id"] for a, _ in found["hw.gpu.utilization"]} == {"0", "1"}  # a MIG device has no rate of its own
    assert {a["hw.id"] for a, _ in found["hw.temperature"]} == {"0", "1"}
    slices[0].broken = True  # type: ignore[union-attr]  # one device that cannot answer leaves the others
    assert {a["hw.id"] for a, _ in gauges(reader)["hw.gpu.memory.usage"]} == {"MIG-2222", "1"}


def test_a_jetson_without_jetson_stats_reports_its_shared_ram_as_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jtop", None)
    reader = InMemoryMetricReader()
    register_probes(MeterProvider(metric_readers=[reader]).get_meter("t"), nvml=Nvml(no_library), jetson=True)
    found = gauges(reader)
    ((usage_attributes, usage),) = found["hw.gpu.memory.usage"]
    ((_, limit),) = found["hw.gpu.memory.limit"]
    assert usage_attributes == {"hw.id": "0", "hw.type": "gpu"} and 0 < usage <= limit
    assert "hw.gpu.utilization" not in found


def test_a_version_loading_beside_its_models_running_version_keeps_the_agents_whole_headroom(tmp_path: Path) -> None:
    guard = MemoryGuard(probe(tmp_path, two_gpus()), headroom=10 * GiB)  # GPU 0: 10 GiB free
    folder = weights(tmp_path, "m", 100 * MiB)
    running = guard.load(guard.need("m", 1, folder, placements=[0], on_gpu=True), Holder)  # a first load: 256 MiB
    with pytest.raises(gpu.GpuMemoryError, match=r"m v2 needs about 150 MiB .* plus 10240 MiB headroom, but only"):
        guard.check(guard.need("m", 2, folder, placements=[0], on_gpu=True))  # a variant beside v1
    guard.check(guard.need("other", 1, folder, placements=[0], on_gpu=True))  # another model's first load
    guard.release(running)
    guard.check(guard.need("m", 2, folder, placements=[0], on_gpu=True))


def test_a_runner_the_guard_placed_checks_only_its_cap_not_free_memory_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard counts every instance's need on each device before a load; the runner's own estimate (1.5 x files
    against what is free now) would count the instances loaded before it a second time."""
    version = load_repository(tiny_repository(tmp_path)).get("add", 1)
    full = FakeNvml(Device("GPU-full-0000", 16 * GiB, 0))  # nothing free: any free-memory check refuses
    monkeypatch.setattr(gpu, "default_probe", lambda: probe(tmp_path, full))
    with pytest.raises(gpu.GpuMemoryError, match="only 0 MiB are free"):
        runner_module.check_gpu_memory(version, None, 0)
    runner_module.check_gpu_memory(version, None, 0, free_memory=False)  # the guard has checked: only the cap
    with pytest.raises(gpu.GpuMemoryError, match="its files alone take"):
        runner_module.check_gpu_memory(version, 10, 0, free_memory=False)
