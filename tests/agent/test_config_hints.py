"""Config hints: each config.pbtxt field the agent accepts without honouring it is said once at load, naming the
model, the field and what the agent does instead; `instance_group.gpus` is accepted and places the instances as
Triton does (round-robin over the listed GPUs, `count` on each), with a hint where no GPU runs them."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import httpx
import pytest

from edge_agent.config import AgentConfig
from edge_agent.runtime.config import (
    ModelConfigError,
    check_instance_gpus,
    config_hints,
    instance_devices,
    parse_config_file,
    pinning_field,
    placed_devices,
)
from edge_agent.runtime.repository import load_repository
from edge_agent.runtime.runner import session_providers
from edge_agent.serving.server import build_registry
from spillway.demo.models import CONFIG_PBTXT, TINY_LM_CONFIG
from tests.agent.conftest import start_agent, stop_agent

CPU = ["CPUExecutionProvider"]
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
GPU_GROUP = "count: 1\n    kind: KIND_GPU\n    gpus: [ 0, 1 ]"
TENSORRT = """optimization { execution_accelerators { gpu_execution_accelerator: [
  { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ] } }
"""
PARAMETERS = 'parameters { key: "threshold" value: { string_value: "0.5" } }\n'
WARMUP = """model_warmup [ { name: "zeros" batch_size: 8
  inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 512 ] zero_data: true } } } ]
"""
METRICS = """model_metrics { metric_control: [ { metric_identifier: { family: "nv_inference_request_duration" }
  histogram_options: { buckets: [ 1, 10, 100 ] } } ] }
"""

# Every field, its hint on the line, and what that line says the agent does instead.
HINTED = [
    ("KIND_GPU without a GPU", CONFIG_PBTXT.replace("kind: KIND_CPU", "kind: KIND_GPU"), CPU,
     "instance_group[0].kind: KIND_GPU", "its 1 instance(s) run on the CPU"),
    ("KIND_CPU on a GPU", CONFIG_PBTXT, CUDA, "instance_group[0].kind: KIND_CPU", "execution providers decide"),
    ("gpus without a GPU", CONFIG_PBTXT.replace("count: 1\n    kind: KIND_CPU", GPU_GROUP), CPU,
     "instance_group[0].gpus: [0, 1]", "its 2 instance(s) run on the CPU"),
    ("optimization", CONFIG_PBTXT + TENSORRT, CPU, "optimization (execution_accelerators: tensorrt)",
     "the agent setting `providers`"),
    ("parameters", CONFIG_PBTXT + PARAMETERS, CPU, "parameters ['threshold']", "generative models only"),
    ("model_warmup", CONFIG_PBTXT + WARMUP, CPU, "model_warmup", "batch sizes of its own"),
    ("metric_tags", CONFIG_PBTXT + 'metric_tags { key: "team" value: "vision" }\n', CPU, "metric_tags",
     "attributes"),
    ("model_metrics", CONFIG_PBTXT + METRICS, CPU, "model_metrics", "`latency_buckets_ms`"),
    ("label_filename", CONFIG_PBTXT.replace("dims: [ 1000 ]", 'dims: [ 1000 ]\n    label_filename: "labels.txt"'),
     CPU, "output[output].label_filename", "answered as a tensor"),
]  # fmt: skip


def write_config(tmp_path: Path, text: str, name: str = "config.pbtxt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "providers", "field", "instead"), [pytest.param(*h[1:], id=h[0]) for h in HINTED])
def test_each_accepted_field_not_honoured_gets_one_line(
    tmp_path: Path, text: str, providers: list[str], field: str, instead: str
) -> None:
    hints = config_hints(parse_config_file(write_config(tmp_path, text)), "mlp", providers)

    lines = [line for line in hints if field in line]
    assert len(lines) == 1, hints
    assert lines[0].startswith(f"model 'mlp': config field {field}") and "is not honoured" in lines[0]
    assert instead in lines[0]


def test_a_config_the_agent_honours_whole_gets_no_hint(tmp_path: Path) -> None:
    assert config_hints(parse_config_file(write_config(tmp_path, CONFIG_PBTXT)), "mlp", CPU) == []
    on_gpu = CONFIG_PBTXT.replace("count: 1\n    kind: KIND_CPU", GPU_GROUP)
    assert config_hints(parse_config_file(write_config(tmp_path, on_gpu)), "mlp", CUDA) == []
    # A generative model's parameters are its generation settings: honoured.
    decoder = TINY_LM_CONFIG + 'parameters { key: "max_num_seqs" value: { string_value: "4" } }\n'
    assert config_hints(parse_config_file(write_config(tmp_path, decoder)), "tiny-lm", CPU) == []


def test_gpus_place_instances_round_robin_as_triton_does(tmp_path: Path) -> None:
    two_each = parse_config_file(write_config(tmp_path, CONFIG_PBTXT.replace("count: 1\n", "count: 2\n").replace(
        "kind: KIND_CPU", "kind: KIND_GPU\n    gpus: [ 0, 1 ]")))  # fmt: skip
    assert instance_devices(two_each, 4) == (0, 1, 0, 1)  # `count` instances on each listed GPU
    mixed = CONFIG_PBTXT.replace("  {\n    count: 1\n    kind: KIND_CPU\n  }",
                                 "  { count: 1 kind: KIND_GPU gpus: [ 3 ] },\n  { count: 2 }")  # fmt: skip
    assert instance_devices(parse_config_file(write_config(tmp_path, mixed)), 3) == (3, None, None)
    assert instance_devices(two_each, 3) == (None, None, None)  # the file changed since: the agent's device_id
    assert instance_devices(None, 2) == (None, None)


def test_each_instance_session_is_created_on_its_pinned_gpu(tmp_path: Path) -> None:
    mixed = CONFIG_PBTXT.replace("  {\n    count: 1\n    kind: KIND_CPU\n  }",
                                 "  { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] },\n  { count: 1 }")  # fmt: skip
    message = parse_config_file(write_config(tmp_path, mixed))
    devices = placed_devices(message, 5, device_id=3)  # unpinned: the agent's device_id
    assert devices == (0, 1, 0, 1, 3)
    for providers in (CUDA, ["TensorrtExecutionProvider", *CUDA]):
        sessions = [dict(session_providers(providers, 1 << 30, device)) for device in devices]
        for name in providers[:-1]:  # each GPU provider of each instance's session gets its instance's GPU
            assert [options[name]["device_id"] for options in sessions] == ["0", "1", "0", "1", "3"]
        assert all(options["CPUExecutionProvider"] == {} for options in sessions)
    assert dict(session_providers(CUDA, 1 << 30, 1))["CUDAExecutionProvider"]["gpu_mem_limit"] == str(1 << 30)
    assert [pinning_field(message, 5, i) for i in range(5)] == ["instance_group[0].gpus"] * 4 + [None]
    assert pinning_field(message, 4, 0) is None  # the file changed since it was loaded: nothing pinned


def test_gpus_this_machine_does_not_have_are_refused_naming_the_field(tmp_path: Path) -> None:
    two = CONFIG_PBTXT.replace("  {\n    count: 1\n    kind: KIND_CPU\n  }",
                               "  { count: 1 },\n  { count: 1 kind: KIND_GPU gpus: [ 0, 2, 1 ] }")  # fmt: skip
    path = write_config(tmp_path, two)
    message = parse_config_file(path)
    check_instance_gpus(message, 3, path)  # ids 0..2 are there
    with pytest.raises(ModelConfigError, match=r"config.pbtxt: field 'instance_group\[1\].gpus'") as refused:
        check_instance_gpus(message, 1, path)  # a one-GPU machine
    assert "GPU(s) [1, 2] are not present (this machine has 1 GPU(s): ids 0..0)" in str(refused.value)
    with pytest.raises(ModelConfigError, match="has 0 GPU"):
        check_instance_gpus(message, 0, path)
    check_instance_gpus(None, 0, path)  # a model without its file: nothing pinned


def test_gpus_are_accepted_and_count_instances_as_triton(tmp_path: Path, demo_repo: Path) -> None:
    repo = Path(shutil.copytree(demo_repo / "mlp", tmp_path / "mlp")).parent
    text = CONFIG_PBTXT.replace("count: 1\n    kind: KIND_CPU", "count: 2\n    kind: KIND_GPU\n    gpus: [ 0, 1 ]")
    (repo / "mlp" / "config.pbtxt").write_text(text)

    assert load_repository(repo).get("mlp").config.instance_count == 4


@pytest.mark.parametrize(
    ("group", "why"),
    [
        ("kind: KIND_CPU\n    gpus: [ 0 ]", "kind KIND_CPU runs on no GPU"),
        ("kind: KIND_MODEL\n    gpus: [ 0 ]", "kind KIND_MODEL runs on no GPU"),
        ("kind: KIND_GPU\n    gpus: [ 0, -1 ]", "GPU ids are >= 0"),
    ],
)
def test_gpus_that_cannot_mean_anything_are_refused_naming_the_field(
    tmp_path: Path, demo_repo: Path, group: str, why: str
) -> None:
    repo = Path(shutil.copytree(demo_repo / "mlp", tmp_path / "mlp")).parent
    (repo / "mlp" / "config.pbtxt").write_text(CONFIG_PBTXT.replace("kind: KIND_CPU", group))

    with pytest.raises(ModelConfigError, match=r"config.pbtxt: field 'instance_group\[0\].gpus'") as refused:
        load_repository(repo)
    assert why in str(refused.value)


@pytest.mark.parametrize(
    "field",
    ["response_cache { enable: true }", "model_transaction_policy { decoupled: true }", "sequence_batching { }"],
)
def test_fields_refused_before_stay_refused(tmp_path: Path, demo_repo: Path, field: str) -> None:
    repo = Path(shutil.copytree(demo_repo / "mlp", tmp_path / "mlp")).parent
    text = CONFIG_PBTXT.split("dynamic_batching")[0] if field.startswith("sequence") else CONFIG_PBTXT
    (repo / "mlp" / "config.pbtxt").write_text(text + field + "\n")

    with pytest.raises(ModelConfigError, match=f"field '{field.split()[0]}': not supported"):
        load_repository(repo)


HINTED_MLP = (
    CONFIG_PBTXT.replace("kind: KIND_CPU", "kind: KIND_GPU\n    gpus: [ 0, 1 ]") + TENSORRT + PARAMETERS + WARMUP
)
HINT_FIELDS = ["instance_group[0].kind", "instance_group[0].gpus", "optimization", "parameters", "model_warmup"]


@pytest.fixture
def hinted_repo(tmp_path: Path, demo_repo: Path) -> Path:
    """mlp (both versions) with a config full of fields the agent accepts without honouring them."""
    repo = Path(shutil.copytree(demo_repo / "mlp", tmp_path / "models" / "mlp")).parent
    (repo / "mlp" / "config.pbtxt").write_text(HINTED_MLP)
    return repo


def test_the_load_says_each_hint_once_per_model(hinted_repo: Path, tmp_path: Path, demo_repo: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    shutil.copytree(demo_repo / "tiny-lm", hinted_repo / "tiny-lm")
    decoder = hinted_repo / "tiny-lm" / "config.pbtxt"
    decoder.write_text(decoder.read_text() + WARMUP + TENSORRT)
    caplog.set_level(logging.WARNING, logger="spillway.agent")

    registry = build_registry(AgentConfig(model_repository=hinted_repo, intra_op_threads=1, state_dir=tmp_path))
    try:
        lines = [r.getMessage() for r in caplog.records if "is not honoured" in r.getMessage()]
        for field in HINT_FIELDS:  # mlp serves two versions: still one line a field
            assert len([line for line in lines if f"model 'mlp': config field {field}" in line]) == 1, (field, lines)
        decoder_lines = [line for line in lines if line.startswith("model 'tiny-lm'")]
        assert len(decoder_lines) == 2, decoder_lines  # model_warmup and optimization; its parameters are honoured
        assert registry.versions("mlp") == [1, 2]
        assert all(m.worker.scheduler.config.instances == 2 for m in registry.of("mlp"))  # one a listed GPU
    finally:
        for worker in registry.workers():
            worker.close()


def test_a_running_agent_logs_the_hints_at_start_and_at_each_load(hinted_repo: Path, tmp_path: Path) -> None:
    running = start_agent(hinted_repo, tmp_path, intra_op_threads=1)
    try:

        def count(field: str) -> int:
            return running.log.read_text().count(f"model 'mlp': config field {field}")

        assert [count(field) for field in HINT_FIELDS] == [1] * len(HINT_FIELDS)
        config = httpx.get(f"{running.url}/v2/models/mlp/config", timeout=10).json()
        assert config["instance_group"][0]["gpus"] == [0, 1] and config["instance_group"][0]["kind"] == "KIND_GPU"
        assert httpx.post(f"{running.url}/v2/repository/models/mlp/load", timeout=120).status_code == 200
        assert [count(field) for field in HINT_FIELDS] == [2] * len(HINT_FIELDS)
    finally:
        stop_agent(running)
