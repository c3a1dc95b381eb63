"""The model repository, config refusals, the onnxruntime runner, compute profiles and the GPU probe, for real."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import yaml

from edge_agent.runtime import (
    ComputeProfile,
    ModelConfigError,
    OrtRunner,
    RunnerError,
    UnknownModelError,
    check_fits,
    choose_providers,
    free_gpu_memory,
    load_repository,
    warmup_batch_sizes,
)
from edge_agent.runtime.gpu import device_count
from spillway.demo.models import CONFIG_PBTXT, DemoVariant, build_demo_repository, build_mlp

TINY = DemoVariant(version=1, label="tiny", hidden=(8,))


@pytest.fixture(scope="module")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_repository(tmp_path_factory.mktemp("models"))


def make_tiny_repo(root: Path, config: str = CONFIG_PBTXT, versions: tuple[int, ...] = (1,)) -> Path:
    """A repository shaped like the demo (same config and tensors) with small, fast models."""
    model_dir = root / "mlp"
    for version in versions:
        (model_dir / str(version)).mkdir(parents=True)
        variant = dataclasses.replace(TINY, version=version)
        onnx.save(build_mlp(variant), str(model_dir / str(version) / "model.onnx"))
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir / "config.pbtxt"


def edited(old: str, new: str) -> str:
    assert old in CONFIG_PBTXT, old
    return CONFIG_PBTXT.replace(old, new, 1)


# --- the demo repository -------------------------------------------------------------------------------------


def test_demo_repository_loads_both_versions_with_their_config(demo_repo: Path) -> None:
    repo = load_repository(demo_repo)

    assert list(repo.models) == ["mlp"]
    assert [v.version for v in repo.models["mlp"]] == [1, 2]
    assert repo.get("mlp").version == 2
    v1 = repo.get("mlp", 1)
    assert v1.path == demo_repo / "mlp" / "1" / "model.onnx"
    config = v1.config
    assert (config.platform, config.max_batch_size, config.instance_count) == ("onnxruntime_onnx", 64, 1)
    assert [(t.name, t.datatype, t.shape) for t in config.inputs] == [("input", "FP32", (512,))]
    assert [(t.name, t.datatype, t.shape) for t in config.outputs] == [("output", "FP32", (1000,))]
    batching = config.dynamic_batching
    assert batching is not None
    assert batching.preferred_batch_sizes == (8, 16, 32)
    assert (batching.max_queue_delay_us, batching.priority_levels, batching.default_priority_level) == (2000, 3, 2)
    assert batching.default_queue_policy.max_queue_size == 256
    assert set(batching.priority_queue_policy) == {3}
    assert batching.priority_queue_policy[3].max_queue_size < batching.default_queue_policy.max_queue_size
    assert config.version_policy.kind == "all"


def test_demo_models_have_the_promised_shapes(demo_repo: Path) -> None:
    widths = {}
    for version in (1, 2):
        graph = onnx.load(str(demo_repo / "mlp" / str(version) / "model.onnx")).graph
        widths[version] = [tuple(t.dims) for t in graph.initializer if t.name.startswith("w")]
        (batch_dim, feature_dim) = graph.input[0].type.tensor_type.shape.dim
        assert batch_dim.dim_param and feature_dim.dim_value == 512
    assert widths[1] == [(512, 4096), (4096, 4096), (4096, 1000)]
    assert widths[2] == [(512, 1024), (1024, 1024), (1024, 1000)]


def test_rebuilding_the_demo_repository_is_idempotent(tmp_path: Path) -> None:
    build_demo_repository(tmp_path)
    first = (tmp_path / "mlp" / "2" / "model.onnx").read_bytes()
    build_demo_repository(tmp_path)

    assert (tmp_path / "mlp" / "2" / "model.onnx").read_bytes() == first
    assert sorted(p.name for p in (tmp_path / "mlp").iterdir()) == ["1", "2", "config.pbtxt"]
    assert [p.name for p in (tmp_path / "mlp" / "1").iterdir()] == ["model.onnx"]  # no temporary files left


# --- the runner ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_runner_outputs_equal_a_direct_onnxruntime_run(demo_repo: Path, version: int) -> None:
    model = load_repository(demo_repo).get("mlp", version)
    runner = OrtRunner(model, intra_op_threads=2)
    direct = onnxruntime.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    inputs = runner.example_inputs(5, seed=7)

    outputs = runner.run(inputs)

    assert runner.providers == ["CPUExecutionProvider"]
    assert list(outputs) == ["output"]
    assert outputs["output"].shape == (5, 1000) and outputs["output"].dtype == np.float32
    (expected,) = direct.run(None, inputs)
    np.testing.assert_array_equal(outputs["output"], expected)
    assert np.isfinite(expected).all() and expected.std() > 0.01  # the seeded weights do not vanish or explode


def test_warm_up_profiles_each_batch_size_and_reports_v1_timings(demo_repo: Path) -> None:
    runner = OrtRunner(load_repository(demo_repo).get("mlp", 1), intra_op_threads=2)

    profile = runner.warm_up([32, 1, 32], repeats=10)

    timings = profile.snapshot()
    assert sorted(timings) == [1, 32]
    assert all(seconds > 0 for seconds in timings.values())
    with pytest.raises(ValueError, match=r"1\.\.64"):
        runner.warm_up([1, 128])  # beyond max_batch_size: never served, so never profiled
    # A measurement for the report, not a test: the issue expects about 3 ms and 9 ms on two cores.
    print(f"\nmlp v1, 2 intra-op threads: batch 1 {timings[1] * 1e3:.2f} ms, batch 32 {timings[32] * 1e3:.2f} ms")


def test_runner_refuses_what_onnxruntime_cannot_run(demo_repo: Path) -> None:
    import onnxruntime

    model = load_repository(demo_repo).get("mlp", 2)
    missing = [p for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider")
               if p not in onnxruntime.get_available_providers()]  # fmt: skip
    with pytest.raises(RunnerError, match=missing[0]):
        OrtRunner(model, providers=missing[:1])  # a provider this machine's onnxruntime does not have
    plan = dataclasses.replace(model, config=dataclasses.replace(model.config, platform="tensorrt_plan"))
    with pytest.raises(RunnerError, match="tensorrt_plan"):
        OrtRunner(plan)


def test_a_session_onnxruntime_cannot_create_is_a_runner_error_naming_the_file(tmp_path: Path) -> None:
    make_tiny_repo(tmp_path)
    model = load_repository(tmp_path).get("mlp", 1)
    model.path.write_bytes(b"not an onnx graph")  # after the graph check: what onnxruntime alone refuses
    with pytest.raises(RunnerError, match="cannot create a session on CPUExecutionProvider") as refused:
        OrtRunner(model, providers=["CPUExecutionProvider"])
    assert str(model.path) in str(refused.value)


def test_providers_are_tried_tensorrt_then_cuda_then_cpu() -> None:
    installed = ["CPUExecutionProvider", "AzureExecutionProvider", "CUDAExecutionProvider"]
    assert choose_providers(installed) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(installed, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(RunnerError):
        choose_providers(["AzureExecutionProvider"])


def test_importing_the_runtime_does_not_import_onnxruntime() -> None:
    code = "import sys, edge_agent.runtime; print('onnxruntime' in sys.modules, 'onnx' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


# --- config refusals -----------------------------------------------------------------------------------------

ConfigEdit = Callable[[Path], object]


def _write(text: str) -> ConfigEdit:
    return lambda config: config.write_text(text)


def _yaml_with_unknown_field(config: Path) -> None:
    config.unlink()
    document = {"name": "mlp", "platform": "onnxruntime_onnx", "max_batch_size": 8,
                "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": [512]}],
                "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [1000]}],
                "dynamic_batching": {"max_queue_delay_microseconds": 100, "max_queue_delay_ms": 1}}  # fmt: skip
    config.with_name("config.yaml").write_text(yaml.safe_dump(document))


def _plan_instead_of_onnx(config: Path) -> None:
    (config.parent / "1" / "model.onnx").rename(config.parent / "1" / "model.plan")


def _replacing(old: str, new: str) -> ConfigEdit:
    return _write(edited(old, new))


REFUSALS = [
    # (case, edit, file named in the message, field named in the message)
    ("unknown field in config.pbtxt", _write(CONFIG_PBTXT + "max_sequence_length: 4\n"), "config.pbtxt",
     "max_sequence_length"),
    ("unknown field in config.yaml", _yaml_with_unknown_field, "config.yaml", "max_queue_delay_ms"),
    ("input name differs from the graph", _replacing('name: "input"', 'name: "tokens"'), "config.pbtxt", "name"),
    ("input dtype differs from the graph", _replacing("TYPE_FP32", "TYPE_FP16"), "config.pbtxt", "data_type"),
    ("input rank differs from the graph", _replacing("dims: [ 512 ]", "dims: [ 2, 256 ]"), "config.pbtxt", "dims"),
    ("fixed dim differs from the graph", _replacing("dims: [ 512 ]", "dims: [ 256 ]"), "config.pbtxt", "dims"),
    ("output missing from the graph", _replacing('name: "output"', 'name: "logits"'), "config.pbtxt", "name"),
    ("missing model.onnx", lambda config: (config.parent / "1" / "model.onnx").unlink(), "1/model.onnx",
     "model.onnx"),
    ("model.plan for onnxruntime", _plan_instead_of_onnx, "config.pbtxt", "platform"),
    ("default_priority_level above priority_levels",
     _replacing("default_priority_level: 2", "default_priority_level: 4"), "config.pbtxt", "default_priority_level"),
    ("default_priority_level 0 with levels",
     _replacing("default_priority_level: 2", "default_priority_level: 0"), "config.pbtxt", "default_priority_level"),
    ("priority_queue_policy for a level that does not exist", _replacing("key: 3", "key: 7"), "config.pbtxt",
     "priority_queue_policy"),
    ("preferred batch size above max_batch_size", _replacing("[ 8, 16, 32 ]", "[ 8, 128 ]"), "config.pbtxt",
     "preferred_batch_size"),
    ("negative max_batch_size", _replacing("max_batch_size: 64", "max_batch_size: -1"), "config.pbtxt",
     "max_batch_size"),
    ("negative queue delay",
     _replacing("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: -5"), "config.pbtxt",
     "max_queue_delay_microseconds"),
    ("negative instance count", _replacing("count: 1", "count: -2"), "config.pbtxt", "count"),
    ("unsupported platform", _replacing("onnxruntime_onnx", "pytorch_libtorch"), "config.pbtxt", "platform"),
    ("name differs from the directory", _replacing('name: "mlp"', 'name: "other"'), "config.pbtxt", "name"),
    ("sequence batching", _write(CONFIG_PBTXT.split("dynamic_batching")[0] + "sequence_batching { }\n"),
     "config.pbtxt", "sequence_batching"),
    ("no config at all", lambda config: config.unlink(), "", "config.pbtxt"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "file_named", "field_named"), [pytest.param(*r[1:], id=r[0]) for r in REFUSALS])
def test_a_config_the_agent_cannot_honour_is_refused_naming_file_and_field(
    tmp_path: Path, edit: ConfigEdit, file_named: str, field_named: str
) -> None:
    config = make_tiny_repo(tmp_path)
    edit(config)

    with pytest.raises(ModelConfigError) as refused:
        load_repository(tmp_path)

    message = str(refused.value)
    assert str(config.parent / file_named) in message
    assert field_named in message.replace(str(tmp_path), "")


def test_parse_errors_point_at_the_line(tmp_path: Path) -> None:
    config = make_tiny_repo(tmp_path, CONFIG_PBTXT + "bogus_field: 1\n")
    line = CONFIG_PBTXT.count("\n") + 1
    with pytest.raises(ModelConfigError, match=f"config.pbtxt:{line}:1: .*bogus_field"):
        load_repository(config.parent.parent)


def test_config_yaml_reads_like_the_pbtxt(tmp_path: Path) -> None:
    make_tiny_repo(tmp_path / "a")
    pbtxt = load_repository(tmp_path / "a").get("mlp").config
    config = make_tiny_repo(tmp_path / "b")
    config.unlink()
    document = {
        "name": "mlp", "platform": "onnxruntime_onnx", "max_batch_size": 64,
        "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": [512]}],
        "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": [1000]}],
        "dynamic_batching": {
            "preferred_batch_size": [8, 16, 32], "max_queue_delay_microseconds": 2000,
            "priority_levels": 3, "default_priority_level": 2,
            "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": 100000,
                                     "allow_timeout_override": True, "max_queue_size": 256},
            "priority_queue_policy": {3: {"timeout_action": "REJECT", "default_timeout_microseconds": 1000000,
                                          "allow_timeout_override": True, "max_queue_size": 64}},
        },
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "version_policy": {"all": {}},
    }  # fmt: skip
    (config.parent / "config.yaml").write_text(yaml.safe_dump(document))

    from_yaml = load_repository(tmp_path / "b").get("mlp").config

    assert dataclasses.replace(from_yaml, source=pbtxt.source) == pbtxt


def test_queue_policy_delay_and_instance_groups_keep_tritons_meaning(tmp_path: Path) -> None:
    text = edited("timeout_action: REJECT\n      default_timeout_microseconds: 1000000",
                  "timeout_action: DELAY\n      default_timeout_microseconds: 1000000")  # fmt: skip
    text = text.replace(
        "instance_group [\n  {\n    count: 1\n", "instance_group [\n  { kind: KIND_CPU },\n  {\n    count: 2\n"
    )
    make_tiny_repo(tmp_path, text)

    config = load_repository(tmp_path).get("mlp").config

    assert config.instance_count == 3  # a group without a count is one instance
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.priority_queue_policy[3].timeout_action == "DELAY"
    assert config.dynamic_batching.default_queue_policy.timeout_action == "REJECT"


# --- version policy ------------------------------------------------------------------------------------------

VERSION_POLICY = "version_policy { all { } }"


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("version_policy { latest { num_versions: 1 } }", [2]),
        ("version_policy { latest { num_versions: 5 } }", [1, 2]),
        ("version_policy { specific { versions: [1] } }", [1]),
        ("", [2]),  # Triton's default: the latest one
        (VERSION_POLICY, [1, 2]),
    ],
)
def test_version_policy_selects_the_served_versions(tmp_path: Path, policy: str, served: list[int]) -> None:
    make_tiny_repo(tmp_path, edited(VERSION_POLICY, policy), versions=(1, 2))
    (tmp_path / "mlp" / "notes").mkdir()  # not a version: ignored, as Triton does

    repo = load_repository(tmp_path)

    assert [v.version for v in repo.models["mlp"]] == served
    assert repo.get("mlp").version == served[-1]


def test_a_specific_version_without_a_directory_is_refused(tmp_path: Path) -> None:
    config = make_tiny_repo(tmp_path, edited(VERSION_POLICY, "version_policy { specific { versions: [1, 3] } }"))
    with pytest.raises(ModelConfigError, match=r"version_policy\.specific\.versions") as refused:
        load_repository(tmp_path)
    assert str(config) in str(refused.value)


def test_unknown_models_and_versions_are_lookup_errors(tmp_path: Path) -> None:
    make_tiny_repo(tmp_path)
    repo = load_repository(tmp_path)
    with pytest.raises(UnknownModelError):
        repo.get("resnet")
    with pytest.raises(UnknownModelError, match="served: 1"):
        repo.get("mlp", 2)


# --- compute profile -----------------------------------------------------------------------------------------


def test_profile_interpolates_between_measured_batch_sizes() -> None:
    profile = ComputeProfile({1: 0.002, 4: 0.004, 32: 0.018})

    assert profile.predict(1) == 0.002
    assert profile.predict(2) == pytest.approx(0.002 + (1 / 3) * 0.002)
    assert profile.predict(18) == pytest.approx(0.004 + 0.5 * 0.014)
    assert profile.predict(64) == pytest.approx(0.018 + 32 * 0.014 / 28)  # the last segment's slope, continued
    assert ComputeProfile({4: 0.004}).predict(2) == 0.004  # below the smallest measurement: never less
    assert ComputeProfile({4: 0.004}).predict(8) == pytest.approx(0.008)
    with pytest.raises(ValueError):
        profile.predict(0)


def test_profile_refines_each_batch_size_with_an_ewma() -> None:
    profile = ComputeProfile({1: 0.002, 32: 0.010}, alpha=0.25)

    profile.observe(32, 0.014)
    assert profile.predict(32) == pytest.approx(0.75 * 0.010 + 0.25 * 0.014)
    assert profile.predict(1) == 0.002  # other sizes keep their estimate

    before = profile.predict(16)
    profile.observe(16, 0.004)  # a new size starts from its interpolated prior
    assert profile.predict(16) == pytest.approx(0.75 * before + 0.25 * 0.004)
    assert sorted(profile.snapshot()) == [1, 16, 32]

    for _ in range(200):
        profile.observe(1, 0.003)
    assert profile.predict(1) == pytest.approx(0.003)


def test_profile_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        ComputeProfile({})
    with pytest.raises(ValueError):
        ComputeProfile({1: 0.001}, alpha=0)
    profile = ComputeProfile({1: 0.001})
    for batch_size, seconds in [(0, 0.001), (1, -0.001), (1, float("nan")), (1, float("inf"))]:
        with pytest.raises(ValueError):
            profile.observe(batch_size, seconds)
    assert profile.snapshot() == {1: 0.001}


def test_warm_up_batch_sizes_double_up_to_the_maximum() -> None:
    assert warmup_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert warmup_batch_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert warmup_batch_sizes(1) == warmup_batch_sizes(0) == (1,)


# --- GPU probe -----------------------------------------------------------------------------------------------


def test_gpu_probe_never_raises_and_checks_nothing_it_cannot_measure() -> None:
    assert free_gpu_memory(device_id=10_000) is None  # no such GPU anywhere
    count = device_count()
    assert count is None or count >= 0  # None: no NVML (then pinned GPUs are checked by their sessions)
    free = free_gpu_memory()
    if free is None:  # no NVML or no GPU, as on the CPU-only CI machine
        assert check_fits(10**15) is None
    else:
        assert free > 0
        assert check_fits(1) == pytest.approx(free, rel=0.1)
        with pytest.raises(RuntimeError, match="MiB"):
            check_fits(free * 2)


def test_a_version_beside_the_running_one_is_checked_against_available_host_memory(
    demo_repo: Path, tmp_path: Path
) -> None:
    from edge_agent.runtime import HostMemoryError, available_host_memory, check_load_fits, version_on_disk

    lite = load_repository(demo_repo).get("mlp", 2)
    size = (demo_repo / "mlp" / "2" / "model.onnx").stat().st_size
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree:         100000 kB\nMemAvailable:    300000 kB\n")
    assert available_host_memory(meminfo) == 300000 * 1024
    # 1.5 x the files plus the headroom must be available: just enough passes, a byte more is refused.
    fits = 300000 * 1024 - int(size * 1.5)
    assert check_load_fits(lite, ["CPUExecutionProvider"], headroom=fits, meminfo=meminfo) == "host"
    with pytest.raises(HostMemoryError, match=r"mlp v2 needs about .* only 293 MiB of host memory are available"):
        check_load_fits(lite, ["CPUExecutionProvider"], headroom=fits + 1, meminfo=meminfo)
    assert available_host_memory(tmp_path / "absent") is None  # not Linux: nothing is refused
    assert check_load_fits(lite, ["CPUExecutionProvider"], headroom=1 << 60, meminfo=tmp_path / "absent") == (
        "unmeasured"
    )
    assert available_host_memory() is not None  # this machine's /proc/meminfo
    # Any version on disk can be a variant, served by the version policy or not; others are unknown.
    assert version_on_disk(demo_repo, lite.config, 1).path == demo_repo / "mlp" / "1" / "model.onnx"
    with pytest.raises(UnknownModelError, match=r"no version 7 .* \(it has: \[1, 2\]\)"):
        version_on_disk(demo_repo, lite.config, 7)
