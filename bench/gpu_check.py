"""The one prepared check for a machine with an NVIDIA GPU (issue 16): what the CPU test suite cannot run.

    .venv/bin/python bench/gpu_check.py [--budget-s 420] [--only NAME ...]

Checks, each bounded by what is left of the budget, each reported ok / FAIL / skip with what it measured:
  environment   the driver (NVML), onnxruntime's providers, TensorRT, cuda-python, trtexec
  nvml          every GPU's memory (and MIG devices), as NVML and as the agent (`gpu.free_gpu_memory`) see it
  trt-build     TensorRT engines from the demo `mlp` v1 (FP32 and FP16, batch 1..64): Python builder, else trtexec
  trt-runner    the native runner on them against onnxruntime (CPU) at batch 1, 8, 64; a batch outside the
                profile refused; warm-up timings; device memory the load took (NVML)
  trt-serve     `spillway agent serve` on a repository of the plans, a V2 request answered as onnxruntime answers
  ort-eps       the agent on mlp (v2) + tiny-lm with providers [CUDA, CPU] and [TensorRT, CUDA, CPU]: a V2 request
                and a greedy chat completion each, against the same on the CPU; the TensorRT EP's engine cache
                filled under state_dir (and reused by a second start)
  placement     an instance pinned to the last GPU (`instance_group.gpus`) runs there (NVML's process list); a GPU
                that is not there is refused naming the field
  memory        what loading mlp v1 on the CUDA EP took (NVML, before/after); loads refused for memory: a
                `gpu_mem_limit` below the model, the agent's `gpu_memory_budget_bytes`, and the headroom a variant
                needs beside the loaded models

Where no NVIDIA GPU is present it says so and exits 0 without running anything. Exit 1 when a check failed. With
$OUT set, the report is also written to $OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRT_EP, CUDA_EP, CPU_EP = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
MiB = 2**20


class Skip(Exception):
    """A check that cannot run here (what is missing)."""


@dataclass
class Result:
    name: str
    status: str  # ok, FAIL, skip
    seconds: float
    lines: list[str] = field(default_factory=list)


@dataclass
class Context:
    work: Path
    deadline: float
    facts: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(f"    {line}", flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ---- is there a GPU at all -----------------------------------------------------------------------------------------


def no_gpu_reason() -> str | None:
    """Why there is no NVIDIA GPU to check (None: there is one)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        return None if count > 0 else "NVML sees no GPU"
    except Exception as exc:
        nvml = f"NVML: {type(exc).__name__}: {exc}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return f"no NVIDIA driver ({nvml}; no nvidia-smi)"
    listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    if listing.returncode == 0 and "GPU" in listing.stdout:
        return None
    return f"nvidia-smi lists no GPU ({listing.stdout.strip() or listing.stderr.strip()})"


# ---- helpers ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def nvml() -> Iterator[Any]:
    try:
        import pynvml
    except ImportError as exc:
        raise Skip("nvidia-ml-py is not installed (pip install 'spillway[gpu]')") from exc
    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def gpu_free(index: int = 0) -> int | None:
    try:
        with nvml() as nv:
            return int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).free)
    except Exception:
        return None


def tensorrt_libs_env() -> dict[str, str]:
    """The environment for an agent process, with the pip TensorRT libraries on LD_LIBRARY_PATH (onnxruntime's
    TensorRT EP loads libnvinfer by name)."""
    env = dict(os.environ)
    with contextlib.suppress(ImportError):
        import tensorrt_libs

        folder = str(Path(tensorrt_libs.__file__).parent)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (folder, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def ort_providers() -> list[str]:
    import onnxruntime

    return list(onnxruntime.get_available_providers())


def reference(onnx_path: Path, inputs: dict[str, Any]) -> Any:
    """onnxruntime's answer on the CPU: what every GPU path is compared against."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_path), providers=[CPU_EP])
    return session.run(None, inputs)[0]


def error(a: Any, b: Any) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@dataclass
class Agent:
    url: str
    process: Any
    log: Path


def start_agent(ctx: Context, repo: Path, name: str, timeout_s: float = 150, **settings: Any) -> Agent:
    import yaml

    from spillway.demo.harness import Process, free_port

    port = free_port()
    config = ctx.work / f"{name}.yaml"
    settings = {"state_dir": str(ctx.work / f"state-{name}"), "grpc_port": None, "intra_op_threads": 2, **settings}
    config.write_text(yaml.safe_dump({"model_repository": str(repo), "port": port, **settings}))
    log = ctx.work / f"{name}.log"
    process = Process.start([sys.executable, "-m", "spillway.cli", "agent", "serve", "--config", str(config)],
                            name=f"agent {name}", log=log, env=tensorrt_libs_env(), cwd=REPO)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_ready(f"{url}/v2/health/ready", timeout_s=min(timeout_s, max(ctx.left() - 10, 5)))
    except Exception:
        process.stop()
        raise
    return Agent(url, process, log)


def loaded_lines(log: Path) -> list[str]:
    return [line.split("spillway.agent: ", 1)[-1][:200] for line in log.read_text().splitlines() if " loaded " in line]


# ---- the checks ------------------------------------------------------------------------------------------------------


def check_environment(ctx: Context) -> None:
    with contextlib.suppress(Skip), nvml() as nv:
        ctx.say(f"driver {nv.nvmlSystemGetDriverVersion()}, CUDA {nv.nvmlSystemGetCudaDriverVersion_v2()}")
    import onnxruntime

    ctx.say(f"onnxruntime {onnxruntime.__version__}: {ort_providers()}")
    ctx.facts["providers"] = ort_providers()
    try:
        import tensorrt

        ctx.say(f"tensorrt {tensorrt.__version__}")
        ctx.facts["tensorrt"] = True
    except Exception as exc:
        ctx.say(f"tensorrt: not importable ({type(exc).__name__}: {exc})")
    try:
        import cuda.bindings
        from cuda.bindings import runtime  # noqa: F401

        ctx.say(f"cuda-python (cuda.bindings) {getattr(cuda.bindings, '__version__', '?')}")
    except Exception as exc:
        ctx.say(f"cuda-python: not importable ({type(exc).__name__}: {exc})")
    ctx.say(f"trtexec: {shutil.which('trtexec') or 'not on PATH'}")


def check_nvml(ctx: Context) -> None:
    from edge_agent.runtime import gpu

    with nvml() as nv:
        count = nv.nvmlDeviceGetCount()
        ctx.facts["gpus"] = count
        for index in range(count):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            name = nv.nvmlDeviceGetName(handle)
            mig = "?"
            with contextlib.suppress(Exception):
                mig = "on" if nv.nvmlDeviceGetMigMode(handle)[0] else "off"
            ctx.say(f"GPU {index} {name}: {memory.total / MiB:.0f} MiB, {memory.free / MiB:.0f} free; MIG {mig}")
            if mig == "on":
                for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
                    with contextlib.suppress(Exception):
                        device = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                        info = nv.nvmlDeviceGetMemoryInfo(device)
                        ctx.say(f"  MIG {nv.nvmlDeviceGetUUID(device)}: {info.total / MiB:.0f} MiB, "
                                f"{info.free / MiB:.0f} free")  # fmt: skip
            agent_view = gpu.free_gpu_memory(index)
            ctx.say(f"  the agent reads {None if agent_view is None else f'{agent_view / MiB:.0f} MiB'} free")
            assert agent_view is not None, "the agent cannot read this GPU's free memory"
    ctx.say(f"the agent counts {gpu.device_count()} GPU(s)")


def build_plan(onnx_path: Path, out: Path, *, fp16: bool, ctx: Context) -> str:
    """`out` from `onnx_path` (input [batch, 512], batch 1..64, optimum 8); returns how it was built."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        import tensorrt as trt
    except Exception:
        trtexec = shutil.which("trtexec")
        if trtexec is None:
            raise Skip("neither TensorRT's Python package nor trtexec is here") from None
        args = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={out}", "--minShapes=input:1x512",
                "--optShapes=input:8x512", "--maxShapes=input:64x512", *(["--fp16"] if fp16 else [])]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True, timeout=max(ctx.left() - 10, 10))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return "trtexec"
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(onnx_path)), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    settings = builder.create_builder_config()
    settings.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    if fp16:
        settings.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    profile.set_shape("input", (1, 512), (8, 512), (64, 512))
    settings.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, settings)
    assert serialized is not None, "TensorRT built no engine"
    out.write_bytes(bytes(serialized))
    return f"TensorRT {trt.__version__} Python builder"


def check_trt_build(ctx: Context) -> None:
    from spillway.demo.models import CONFIG_PBTXT

    plans = ctx.work / "plans" / "mlp"
    for version, fp16 in ((1, False), (2, True)):
        started = time.monotonic()
        how = build_plan(ctx.facts["repo"] / "mlp" / "1" / "model.onnx", plans / str(version) / "model.plan",
                         fp16=fp16, ctx=ctx)  # fmt: skip
        size = (plans / str(version) / "model.plan").stat().st_size
        ctx.say(f"mlp v1 {'FP16' if fp16 else 'FP32'} -> plans/mlp/{version}/model.plan: {size / MiB:.0f} MiB in "
                f"{time.monotonic() - started:.1f} s ({how})")  # fmt: skip
    (plans / "config.pbtxt").write_text(CONFIG_PBTXT.replace('"onnxruntime_onnx"', '"tensorrt_plan"')
                                        .replace("kind: KIND_CPU", "kind: KIND_GPU"))  # fmt: skip
    ctx.facts["plans"] = plans.parent


def check_trt_runner(ctx: Context) -> None:
    if "plans" not in ctx.facts:
        raise Skip("no engine was built (trt-build)")
    from edge_agent.runtime.repository import load_repository
    from edge_agent.runtime.runner import RunnerError, create_runner

    onnx_path = ctx.facts["repo"] / "mlp" / "1" / "model.onnx"
    repo = load_repository(ctx.facts["plans"])
    for version, tolerance in ((1, 1e-3), (2, 5e-2)):
        before = gpu_free()
        runner = create_runner(repo.get("mlp", version))
        after = gpu_free()
        took = "?" if before is None or after is None else f"{(before - after) / MiB:.0f} MiB"
        errors = {}
        for batch in (1, 8, 64):
            inputs = runner.example_inputs(batch, seed=batch)
            errors[batch] = error(runner.run(inputs)["output"], reference(onnx_path, inputs))
        profile = runner.warm_up([1, 8, 64], repeats=5).snapshot()
        timings = ", ".join(f"{b}: {s * 1e3:.2f} ms" for b, s in sorted(profile.items()))
        ctx.say(f"v{version} ({'FP32' if version == 1 else 'FP16'}) on {runner.providers}: loading took {took}; "
                f"max |TensorRT - onnxruntime CPU| {max(errors.values()):.2e}; {timings}")  # fmt: skip
        assert max(errors.values()) < tolerance * 10, errors
        try:
            runner.run(runner.example_inputs(65))
            raise AssertionError("a batch of 65 ran, outside the profile 1..64")
        except RunnerError as exc:
            ctx.say(f"batch 65 refused: {str(exc)[-110:]}")
        runner.close()


def check_trt_serve(ctx: Context) -> None:
    if "plans" not in ctx.facts:
        raise Skip("no engine was built (trt-build)")
    import httpx
    import numpy as np

    agent = start_agent(ctx, ctx.facts["plans"], "trt-serve")
    try:
        ctx.say("; ".join(loaded_lines(agent.log)))
        rng = np.random.default_rng(5)
        x = rng.standard_normal((4, 512)).astype(np.float32)
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [4, 512], "data": x.ravel().tolist()}]}
        started = time.perf_counter()
        answer = httpx.post(f"{agent.url}/v2/models/mlp/versions/1/infer", json=body, timeout=60)
        elapsed = time.perf_counter() - started
        assert answer.status_code == 200, answer.text
        got = np.asarray(answer.json()["outputs"][0]["data"], dtype=np.float32).reshape(4, 1000)
        gap = error(got, reference(ctx.facts["repo"] / "mlp" / "1" / "model.onnx", {"input": x}))
        ctx.say(f"V2 infer mlp v1 (plan, batch 4): 200 in {elapsed * 1e3:.1f} ms, max |served - onnxruntime| {gap:.2e}")
        assert gap < 1e-2, gap
    finally:
        agent.process.stop()


def small_repo(ctx: Context) -> Path:
    """mlp v2 alone (batches up to 8: few shapes for the TensorRT EP to build) and tiny-lm."""
    from spillway.demo.models import CONFIG_PBTXT

    repo = ctx.work / "small"
    if not repo.exists():
        (repo / "mlp" / "2").mkdir(parents=True)
        shutil.copy(ctx.facts["repo"] / "mlp" / "2" / "model.onnx", repo / "mlp" / "2" / "model.onnx")
        config = (CONFIG_PBTXT.replace("max_batch_size: 64", "max_batch_size: 8")
                  .replace("preferred_batch_size: [ 8, 16, 32 ]", "preferred_batch_size: [ 8 ]")
                  .replace("kind: KIND_CPU", "kind: KIND_GPU"))  # fmt: skip
        (repo / "mlp" / "config.pbtxt").write_text(config)
        shutil.copytree(ctx.facts["repo"] / "tiny-lm", repo / "tiny-lm")
    return repo


def ask(agent: Agent) -> tuple[Any, str]:
    """mlp's answer to a fixed batch and tiny-lm's greedy completion of a fixed prompt."""
    import httpx
    import numpy as np

    x = np.random.default_rng(9).standard_normal((2, 512)).astype(np.float32)
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 512], "data": x.ravel().tolist()}]}
    answer = httpx.post(f"{agent.url}/v2/models/mlp/infer", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    chat = {"model": "tiny-lm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    completion = httpx.post(f"{agent.url}/v1/chat/completions", json=chat, timeout=300)
    assert completion.status_code == 200, completion.text
    return np.asarray(answer.json()["outputs"][0]["data"]), completion.json()["choices"][0]["message"]["content"]


def check_ort_eps(ctx: Context) -> None:
    available = ctx.facts.get("providers", [])
    if CUDA_EP not in available:
        raise Skip(f"onnxruntime has no CUDA EP here ({available}): pip install 'spillway[gpu]'")
    repo = small_repo(ctx)
    baseline = start_agent(ctx, repo, "cpu", providers=[CPU_EP])
    try:
        want_mlp, want_text = ask(baseline)
    finally:
        baseline.process.stop()
    runs = [("cuda", [CUDA_EP, CPU_EP])]
    if TRT_EP in available:
        runs += [("tensorrt", [TRT_EP, CUDA_EP, CPU_EP]), ("tensorrt", [TRT_EP, CUDA_EP, CPU_EP])]
    else:
        ctx.say(f"no TensorRT EP in this onnxruntime ({available}): only the CUDA EP runs")
    for index, (name, providers) in enumerate(runs):
        if ctx.left() < 60:
            raise AssertionError(f"out of time before the {name} run")
        started = time.monotonic()
        agent = start_agent(
            ctx, repo, f"{name}-{index}", providers=providers, state_dir=str(ctx.work / f"state-{name}")
        )
        ready = time.monotonic() - started
        try:
            got_mlp, got_text = ask(agent)
            ctx.say(f"{name}: ready in {ready:.1f} s; {' | '.join(loaded_lines(agent.log))}")
            ctx.say(
                f"  mlp max |{name} - cpu| {error(got_mlp, want_mlp):.2e}; tiny-lm {got_text!r} (cpu {want_text!r})"
            )
            assert error(got_mlp, want_mlp) < 5e-2
        finally:
            agent.process.stop()
        if name == "tensorrt":
            cache = ctx.work / "state-tensorrt" / "tensorrt-engines"
            files = sorted(p.name for p in cache.rglob("*") if p.is_file()) if cache.exists() else []
            ctx.say(f"  engine cache {cache}: {len(files)} file(s) {files[:4]}")
            assert files, "the TensorRT EP cached no engine under state_dir"


def check_placement(ctx: Context) -> None:
    from edge_agent.config import AgentConfig
    from edge_agent.runtime.config import ModelConfigError
    from edge_agent.serving.server import build_registry

    available = ctx.facts.get("providers", [])
    if CUDA_EP not in available:
        raise Skip("onnxruntime has no CUDA EP here")
    count = ctx.facts.get("gpus", 1)
    repo = small_repo(ctx)
    config_path = repo / "mlp" / "config.pbtxt"
    original = config_path.read_text()
    last = count - 1
    try:
        config_path.write_text(original.replace("kind: KIND_GPU", f"kind: KIND_GPU\n    gpus: [ {last} ]"))
        before = [gpu_free(index) or 0 for index in range(count)]
        registry = build_registry(AgentConfig(model_repository=repo, providers=[CUDA_EP, CPU_EP], intra_op_threads=2,
                                              state_dir=ctx.work / "state-placement"))  # fmt: skip
        try:
            drop = [(before[index] - (gpu_free(index) or 0)) / MiB for index in range(count)]
            with nvml() as nv:
                on = [[p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(index))]
                      for index in range(count)]  # fmt: skip
            listed = [index for index, pids in enumerate(on) if os.getpid() in pids]
            ctx.say(f"mlp pinned to GPU {last} of {count}: free memory fell by {[f'{d:.0f}' for d in drop]} MiB per "
                    f"GPU; NVML lists this process on GPUs {listed}"
                    + (" (one GPU: placement elsewhere cannot be shown)" if count == 1 else ""))  # fmt: skip
            assert max(range(count), key=lambda index: drop[index]) == last or last in listed, (drop, listed)
        finally:
            for worker in registry.workers():
                worker.close()
        config_path.write_text(original.replace("kind: KIND_GPU", f"kind: KIND_GPU\n    gpus: [ {count} ]"))
        try:
            build_registry(AgentConfig(model_repository=repo, providers=[CUDA_EP, CPU_EP],
                                       state_dir=ctx.work / "state-placement"))  # fmt: skip
            raise AssertionError(f"GPU {count} (absent) was not refused")
        except ModelConfigError as exc:
            ctx.say(f"GPU {count} refused: {str(exc)[-150:]}")
            assert "instance_group[0].gpus" in str(exc)
    finally:
        config_path.write_text(original)


def check_memory(ctx: Context) -> None:
    from edge_agent.config import AgentConfig
    from edge_agent.runtime.repository import load_repository
    from edge_agent.runtime.runner import OrtRunner
    from edge_agent.serving.server import build_registry, check_variant_fits

    available = ctx.facts.get("providers", [])
    if CUDA_EP not in available:
        raise Skip("onnxruntime has no CUDA EP here")
    v1 = load_repository(ctx.facts["repo"]).get("mlp", 1)
    size = v1.path.stat().st_size
    before = gpu_free()
    runner = OrtRunner(v1, providers=[CUDA_EP, CPU_EP])
    runner.run(runner.example_inputs(64))
    after = gpu_free()
    took = "?" if before is None or after is None else f"{(before - after) / MiB:.0f} MiB"
    ctx.say(f"mlp v1 ({size / MiB:.0f} MiB file) on {runner.providers}: took {took} of GPU memory after batch 64")
    refusals = 0
    repo = ctx.facts["repo"]
    for label, settings in (("gpu_mem_limit 16 MiB", {"gpu_mem_limit": 16 * MiB}),
                            ("gpu_memory_budget_bytes 16 MiB", {"gpu_memory_budget_bytes": 16 * MiB})):  # fmt: skip
        try:
            registry = build_registry(AgentConfig(model_repository=repo, providers=[CUDA_EP, CPU_EP],
                                                  state_dir=ctx.work / "state-memory", **settings))  # fmt: skip
            for worker in registry.workers():
                worker.close()
            ctx.say(f"{label}: NOT refused")
        except Exception as exc:
            refusals += 1
            ctx.say(f"{label}: refused, {type(exc).__name__}: {str(exc)[:160]}")
    free = gpu_free() or 0
    try:
        check_variant_fits(v1, AgentConfig(model_repository=repo, providers=[CUDA_EP, CPU_EP], load_headroom_bytes=free,
                                           state_dir=ctx.work / "state-memory"))  # fmt: skip
        ctx.say("a variant needing more than the free memory: NOT refused")
    except Exception as exc:
        refusals += 1
        ctx.say(f"a variant beside {free / MiB:.0f} MiB of headroom: refused, {type(exc).__name__}: {str(exc)[:160]}")
    assert refusals == 3, f"{refusals} of 3 loads refused"


CHECKS: list[tuple[str, Callable[[Context], None]]] = [
    ("environment", check_environment),
    ("nvml", check_nvml),
    ("trt-build", check_trt_build),
    ("trt-runner", check_trt_runner),
    ("trt-serve", check_trt_serve),
    ("ort-eps", check_ort_eps),
    ("placement", check_placement),
    ("memory", check_memory),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting checks after this long")
    parser.add_argument("--only", nargs="*", choices=[name for name, _ in CHECKS], help="run these checks only")
    parser.add_argument("--work", type=Path, default=None, help="folder for models and logs (default: a temporary)")
    args = parser.parse_args(argv)
    why = no_gpu_reason()
    if why is not None:
        print(f"gpu_check: no NVIDIA GPU on this machine: {why}. Nothing was run; run this where a GPU is.")
        return 0
    start = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="spillway-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(work, start + args.budget_s)
    from spillway.demo.models import build_demo_repository

    ctx.facts["repo"] = build_demo_repository(work / "models")
    print(f"gpu_check: demo models built in {time.monotonic() - start:.1f} s under {work}", flush=True)
    results = []
    for name, check in CHECKS:
        if args.only and name not in args.only:
            continue
        print(f"[{name}]", flush=True)
        ctx.lines = []
        began = time.monotonic()
        if ctx.left() < 20:
            status, ctx.lines = "skip", [f"out of time ({args.budget_s:g} s budget)"]
        else:
            try:
                check(ctx)
                status = "ok"
            except Skip as exc:
                status = "skip"
                ctx.say(str(exc))
            except Exception as exc:
                status = "FAIL"
                ctx.say(f"{type(exc).__name__}: {exc}"[:600])
                where = traceback.extract_tb(exc.__traceback__)[-1]
                ctx.say(f"at {Path(where.filename).name}:{where.lineno} ({where.name})")
        results.append(Result(name, status, time.monotonic() - began, list(ctx.lines)))
    print("\ngpu_check report")
    for result in results:
        first = result.lines[0] if result.lines else ""
        print(f"  {result.status:4} {result.name:12} {result.seconds:6.1f} s  {first[:90]}")
    out = os.environ.get("OUT")
    if out:
        report = [{"check": r.name, "status": r.status, "seconds": round(r.seconds, 1), "lines": r.lines}
                  for r in results]  # fmt: skip
        Path(out, "gpu_check.json").write_text(json.dumps(report, indent=2))
        for log in work.glob("*.log"):
            shutil.copy(log, Path(out, log.name))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
