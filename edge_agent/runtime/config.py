"""Read a model's Triton config (`config.pbtxt` or `config.yaml`) with Triton's own protobuf messages.

Parsing goes through `inference.ModelConfig` from the tritonclient wheel, so a field Triton does not know is
refused exactly as Triton would; the result is normalised into `spec.ModelConfig`, and anything the agent
cannot honour is refused at load with a `ModelConfigError` naming the file and the field. Fields that are only
hints to Triton (`optimization`, `model_warmup`, ...) are accepted; `config_hints` says, one line per field, what
the agent does instead, and the agent logs those lines once per model at load. The one optimization the agent honours,
the `tensorrt` GPU execution accelerator, is checked here (`tensorrt_accelerator`): its parameters become the
options of onnxruntime's TensorRT execution provider.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import yaml
from google.protobuf import json_format, text_format

from edge_agent.errors import AgentError
from edge_agent.runtime.gpu import GPU_PROVIDERS
from spillway.contract.spec import (
    DynamicBatching,
    ModelConfig,
    QueuePolicy,
    TensorSpec,
    VersionPolicy,
)

log = logging.getLogger("spillway.agent")

CONFIG_FILENAMES = ("config.pbtxt", "config.yaml")

# A serialized TensorRT engine (`model.plan`), run by the native TensorRT runner.
TENSORRT_PLATFORM = "tensorrt_plan"
# A generative decoder (`genai_config.json` beside its model.onnx in each version): served by the generative engine,
# its inputs and outputs described by genai_config.json rather than the model config.
DECODER_PLATFORM = "onnxruntime_decoder"
# platform -> the model file each version directory must hold
MODEL_FILENAMES = {"onnxruntime_onnx": "model.onnx", TENSORRT_PLATFORM: "model.plan", DECODER_PLATFORM: "model.onnx"}
_BACKEND_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": TENSORRT_PLATFORM}

# Triton's `optimization.execution_accelerators.gpu_execution_accelerator` named "tensorrt" (its onnxruntime backend's
# parameters): precision_mode, and these, each -> onnxruntime's TensorRT execution provider option and its kind.
TENSORRT_ACCELERATOR = "tensorrt"
TENSORRT_PRECISIONS = ("FP32", "FP16", "INT8")
_TENSORRT_PARAMETERS: dict[str, tuple[str, str]] = {
    "max_workspace_size_bytes": ("trt_max_workspace_size", "positive"),
    "trt_max_partition_iterations": ("trt_max_partition_iterations", "positive"),
    "trt_min_subgraph_size": ("trt_min_subgraph_size", "positive"),
    "trt_builder_optimization_level": ("trt_builder_optimization_level", "level"),
    "int8_calibration_table_name": ("trt_int8_calibration_table_name", "text"),
    "int8_use_native_calibration_table": ("trt_int8_use_native_calibration_table", "bool"),
    "trt_engine_cache_enable": ("trt_engine_cache_enable", "bool"),
    "trt_engine_cache_path": ("trt_engine_cache_path", "path"),
    "trt_timing_cache_enable": ("trt_timing_cache_enable", "bool"),
    "trt_dla_enable": ("trt_dla_enable", "bool"),
    "trt_dla_core": ("trt_dla_core", "index"),
    "trt_cuda_graph_enable": ("trt_cuda_graph_enable", "bool"),
}
_TRUE, _FALSE = ("1", "true", "True"), ("0", "false", "False")

# Triton's DataType enum name -> V2 datatype (TYPE_STRING travels as BYTES in the V2 protocol)
TRITON_DATATYPES = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
    "TYPE_BF16": "BF16",
}

# A sanity cap: the scheduler keeps one queue per level.
MAX_PRIORITY_LEVELS = 1024

# ModelConfig fields that change what a request means or how it is run, which the agent does not implement.
# Fields that are only hints (optimization, parameters, model_warmup, metric_tags, model_metrics) are accepted,
# with a hint line at load (`config_hints`).
_UNSUPPORTED_FIELDS = (
    "runtime",
    "batch_input",
    "batch_output",
    "sequence_batching",
    "ensemble_scheduling",
    "default_model_filename",
    "cc_model_filenames",
    "model_operations",
    "model_transaction_policy",
    "model_repository_agents",
    "response_cache",
)
_UNSUPPORTED_TENSOR_FIELDS = ("reshape", "is_shape_tensor", "allow_ragged_batch", "optional", "is_non_linear_format_io")
_UNSUPPORTED_INSTANCE_FIELDS = ("rate_limiter", "secondary_devices", "profile", "passive", "host_policy")


class ModelConfigError(AgentError, ValueError):
    """A model config or model file the agent refuses to serve; the message names the file and the field."""


@dataclass(frozen=True)
class TensorrtAccelerator:
    """The model config's `tensorrt` GPU execution accelerator, checked: what onnxruntime's TensorRT execution provider
    is given for this model (besides `device_id`, and the engine cache's directory, which the runner chooses)."""

    precision: str = "FP32"  # FP32, FP16 or INT8: the precision TensorRT may build its engines in
    # onnxruntime's TensorRT EP option -> value, the precision's included
    options: Mapping[str, str] = dataclass_field(default_factory=dict)
    engine_cache: bool = True  # built engines are kept on disk, so that a restart does not build them again
    engine_cache_path: str | None = None  # the config's own directory for them (absolute); None: the agent's

    @property
    def timing_cache(self) -> bool:
        return self.options.get("trt_timing_cache_enable") == "True"


_Refuse = Callable[[str, str], ModelConfigError]


@functools.cache
def model_config_pb2() -> ModuleType:
    """Triton's `model_config_pb2`, loaded from the tritonclient wheel by file so that grpc is not needed."""
    spec = importlib.util.find_spec("tritonclient")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "grpc" / "model_config_pb2.py"
        if path.is_file():
            module_spec = importlib.util.spec_from_file_location("_spillway_triton_model_config_pb2", path)
            if module_spec is None or module_spec.loader is None:
                break
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    raise ImportError("Triton's model config messages come from the `tritonclient` package: pip install tritonclient")


def find_config_file(model_dir: Path) -> Path:
    """The one config file in `model_dir`; two (ambiguous) or none (auto-complete is not supported) is refused."""
    found = [model_dir / name for name in CONFIG_FILENAMES if (model_dir / name).is_file()]
    if len(found) > 1:
        raise ModelConfigError(f"{model_dir}: both {found[0].name} and {found[1].name} exist; keep one")
    if not found:
        raise ModelConfigError(
            f"{model_dir}: no model config ({' or '.join(CONFIG_FILENAMES)}); the agent does not auto-complete "
            "configs from the model file, so write one in Triton's model config format"
        )
    return found[0]


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse, validate and normalise the config of the model in `model_dir` (its name is the directory's)."""
    path = find_config_file(model_dir)
    message = parse_config_file(path)
    return to_model_config(message, path, expected_name=model_dir.name)


def parse_config_file(path: Path) -> Any:
    """Parse `path` into Triton's `inference.ModelConfig` message, refusing unknown fields and bad values."""
    message = model_config_pb2().ModelConfig()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read the model config: {exc}") from exc
    if path.suffix == ".pbtxt":
        try:
            text_format.Parse(text, message)
        except text_format.ParseError as exc:
            raise ModelConfigError(_describe_text_error(path, exc)) from exc
        return message
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ModelConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise ModelConfigError(f"{path}: the model config must be a mapping of Triton's ModelConfig fields")
    try:
        json_format.ParseDict(document, message)
    except json_format.ParseError as exc:
        # The first line names the field and where it sits; the rest lists every valid field, which is noise here.
        raise ModelConfigError(f"{path}: {str(exc).splitlines()[0]}") from exc
    return message


def _describe_text_error(path: Path, exc: text_format.ParseError) -> str:
    line, column = exc.GetLine(), exc.GetColumn()
    detail = str(exc)
    if line is None:
        return f"{path}: {detail}"
    prefix = f"{line}:{column} : "
    detail = detail.removeprefix(prefix)
    return f"{path}:{line}:{column}: {detail}"


def to_model_config(message: Any, source: Path, *, expected_name: str) -> ModelConfig:
    """Normalise a parsed `inference.ModelConfig` into `spec.ModelConfig`, refusing what the agent can't honour."""

    def refuse(field: str, why: str) -> ModelConfigError:
        return ModelConfigError(f"{source}: field '{field}': {why}")

    for field in _UNSUPPORTED_FIELDS:
        if _is_set(message, field):
            raise refuse(field, "not supported by the Spillway agent")
    if message.name and message.name != expected_name:
        raise refuse("name", f"{message.name!r} differs from the model directory's name {expected_name!r}")
    platform = _platform(message, refuse)
    if message.max_batch_size < 0:
        raise refuse("max_batch_size", f"{message.max_batch_size} is negative")
    inputs = _tensors(message.input, "input", refuse)
    outputs = _tensors(message.output, "output", refuse)
    if platform == DECODER_PLATFORM:
        if inputs or outputs:
            raise refuse("input" if inputs else "output", f"platform {DECODER_PLATFORM!r} takes its inputs and "
                         "outputs from each version's genai_config.json; remove them")  # fmt: skip
    elif not inputs:
        raise refuse("input", "the config declares no inputs")
    elif not outputs:
        raise refuse("output", "the config declares no outputs")
    tensorrt_accelerator(message, source)  # refused here, at load, rather than when the session is created
    batching = message.dynamic_batching if message.HasField("dynamic_batching") else None
    return ModelConfig(
        name=expected_name,
        platform=platform,
        max_batch_size=message.max_batch_size,
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=None if batching is None else _dynamic_batching(batching, message.max_batch_size, refuse),
        instance_count=_instance_count(message.instance_group, refuse),
        version_policy=_version_policy(message.version_policy, refuse),
        source=source,
        parameters={key: value.string_value for key, value in sorted(message.parameters.items())},
    )


def _is_set(message: Any, field: str) -> bool:
    value = getattr(message, field)
    if isinstance(value, bool | int | str):
        return bool(value)
    if hasattr(value, "ListFields"):
        return bool(message.HasField(field))
    return len(value) > 0


def _platform(message: Any, refuse: _Refuse) -> str:
    platform, backend = message.platform, message.backend
    if backend and backend not in _BACKEND_PLATFORMS:
        raise refuse("backend", f"{backend!r} is not supported; use one of {sorted(_BACKEND_PLATFORMS)}")
    if platform and platform not in MODEL_FILENAMES:
        raise refuse("platform", f"{platform!r} is not supported; use one of {sorted(MODEL_FILENAMES)}")
    if backend and platform and _BACKEND_PLATFORMS[backend] != platform:
        raise refuse("backend", f"backend {backend!r} does not run platform {platform!r}")
    if not platform and not backend:
        raise refuse("platform", f"set platform (one of {sorted(MODEL_FILENAMES)}) or backend")
    return platform or _BACKEND_PLATFORMS[backend]


def _tensors(tensors: Iterable[Any], field: str, refuse: _Refuse) -> tuple[TensorSpec, ...]:
    specs: list[TensorSpec] = []
    names: set[str] = set()
    datatype_enum = model_config_pb2().DataType
    for tensor in tensors:
        where = f"{field}[{tensor.name or len(specs)}]"
        if not tensor.name:
            raise refuse(f"{where}.name", "every tensor needs a name")
        if tensor.name in names:
            raise refuse(f"{where}.name", f"{tensor.name!r} is declared twice")
        names.add(tensor.name)
        for unsupported in _UNSUPPORTED_TENSOR_FIELDS:
            if hasattr(tensor, unsupported) and _is_set(tensor, unsupported):
                raise refuse(f"{where}.{unsupported}", "not supported by the Spillway agent")
        triton_type = datatype_enum.Name(tensor.data_type)
        if triton_type not in TRITON_DATATYPES:
            raise refuse(f"{where}.data_type", f"{triton_type} is not a datatype a tensor can have")
        if not tensor.dims:
            raise refuse(f"{where}.dims", "must list the dimensions (without the batch dimension when batching)")
        for dim in tensor.dims:
            if dim == 0 or dim < -1:
                raise refuse(f"{where}.dims", f"{list(tensor.dims)}: each dimension is >= 1, or -1 for variable")
        specs.append(TensorSpec(name=tensor.name, datatype=TRITON_DATATYPES[triton_type], shape=tuple(tensor.dims)))
    return tuple(specs)


def _dynamic_batching(batching: Any, max_batch_size: int, refuse: _Refuse) -> DynamicBatching:
    field = "dynamic_batching"
    if batching.preserve_ordering:
        raise refuse(f"{field}.preserve_ordering", "not supported: responses leave as their batches finish")
    for size in batching.preferred_batch_size:
        if not 1 <= size <= max_batch_size:
            raise refuse(f"{field}.preferred_batch_size", f"{size} is outside 1..max_batch_size ({max_batch_size})")
    levels = batching.priority_levels
    if levels > MAX_PRIORITY_LEVELS:
        raise refuse(f"{field}.priority_levels", f"{levels} is more than the agent's {MAX_PRIORITY_LEVELS}")
    default_level = batching.default_priority_level
    if levels > 0 and not 1 <= default_level <= levels:
        raise refuse(f"{field}.default_priority_level", f"{default_level} is outside 1..priority_levels ({levels})")
    if levels == 0 and default_level != 0:
        raise refuse(f"{field}.default_priority_level", f"{default_level} is set but priority_levels is 0")
    per_level: dict[int, QueuePolicy] = {}
    for level, policy in sorted(batching.priority_queue_policy.items()):
        if not 1 <= level <= levels:
            raise refuse(f"{field}.priority_queue_policy", f"level {level} is outside 1..priority_levels ({levels})")
        per_level[level] = _queue_policy(policy)
    return DynamicBatching(
        preferred_batch_sizes=tuple(sorted(set(batching.preferred_batch_size))),
        max_queue_delay_us=batching.max_queue_delay_microseconds,
        priority_levels=levels,
        default_priority_level=default_level,
        default_queue_policy=_queue_policy(batching.default_queue_policy),
        priority_queue_policy=per_level,
    )


def _queue_policy(policy: Any) -> QueuePolicy:
    action: Literal["REJECT", "DELAY"] = "DELAY" if policy.timeout_action == policy.DELAY else "REJECT"
    return QueuePolicy(
        timeout_action=action,
        default_timeout_us=policy.default_timeout_microseconds,
        allow_timeout_override=policy.allow_timeout_override,
        max_queue_size=policy.max_queue_size,
    )


def _instance_count(groups: Iterable[Any], refuse: _Refuse) -> int:
    """Triton's count: `count` instances (one when unset) per group, and per listed GPU when it lists `gpus`."""
    kinds = model_config_pb2().ModelInstanceGroup.Kind
    total = 0
    for index, group in enumerate(groups):
        for unsupported in _UNSUPPORTED_INSTANCE_FIELDS:
            if _is_set(group, unsupported):
                raise refuse(f"instance_group[{index}].{unsupported}", "not supported by the Spillway agent")
        if group.count < 0:
            raise refuse(f"instance_group[{index}].count", f"{group.count} is negative")
        if group.gpus and group.kind in (kinds.Value("KIND_CPU"), kinds.Value("KIND_MODEL")):
            raise refuse(f"instance_group[{index}].gpus", f"kind {kinds.Name(group.kind)} runs on no GPU; list gpus "
                         "with kind KIND_GPU, or remove them")  # fmt: skip
        if any(device < 0 for device in group.gpus):
            raise refuse(f"instance_group[{index}].gpus", f"{list(group.gpus)}: GPU ids are >= 0")
        total += max(group.count, 1) * max(len(group.gpus), 1)  # Triton's meaning: an unset count is one instance
    return max(total, 1)


def instance_devices(message: Any | None, count: int) -> tuple[int | None, ...]:
    """The GPU each of the model's `count` instances is pinned to (None: the agent's `device_id`), as Triton places
    them: a group's instances go round-robin over its `gpus` (`count` on each). All None without a config message,
    or when the config no longer describes `count` instances (the file changed since it was loaded)."""
    placements = _placements(message, count)
    return tuple(device for _, device in placements) if placements else (None,) * count


def pinning_field(message: Any | None, count: int, instance: int) -> str | None:
    """The config field that pins instance number `instance` to its GPU (`instance_group[i].gpus`; None: unpinned)."""
    placements = _placements(message, count)
    if instance >= len(placements) or placements[instance][1] is None:
        return None
    return f"instance_group[{placements[instance][0]}].gpus"


def _placements(message: Any | None, count: int) -> list[tuple[int, int | None]]:
    """(group index, GPU id or None) of each instance, in Triton's order; [] unless the message places `count`."""
    placements: list[tuple[int, int | None]] = []
    for index, group in enumerate([] if message is None else message.instance_group):
        for _ in range(max(group.count, 1)):
            placements += [(index, device) for device in group.gpus] if group.gpus else [(index, None)]
    return placements if len(placements) == count else []


def placed_devices(message: Any | None, count: int, device_id: int) -> tuple[int, ...]:
    """The GPU id each instance's session is created on: its `instance_group.gpus` placement, else `device_id`."""
    return tuple(device_id if device is None else device for device in instance_devices(message, count))


def check_instance_gpus(message: Any | None, device_count: int, source: Path) -> None:
    """Refuse (ModelConfigError naming `instance_group[i].gpus`) a GPU id that this machine does not have, where the
    model runs on a GPU provider and the number of GPUs is known (`gpu.device_count`)."""
    for index, group in enumerate([] if message is None else message.instance_group):
        absent = sorted({device for device in group.gpus if device >= device_count})
        if absent:
            present = f"ids 0..{device_count - 1}" if device_count else "none"
            raise ModelConfigError(f"{source}: field 'instance_group[{index}].gpus': GPU(s) {absent} are not present "
                                   f"(this machine has {device_count} GPU(s): {present}); list the GPUs it has, or "
                                   "remove gpus to run on the agent's `device_id`")  # fmt: skip


def read_config_message(config: ModelConfig) -> Any | None:
    """The loaded model's config file parsed again into Triton's message (None: it has none, or it no longer parses;
    the agent serves what it loaded)."""
    if not config.source.is_file():
        return None
    try:
        return parse_config_file(config.source)
    except ModelConfigError:
        return None


def config_hints(message: Any, name: str, providers: Sequence[str]) -> list[str]:
    """One line per config field that the agent accepts without honouring it, naming the model, the field and what
    the agent does instead. `providers`: the execution providers the model runs on."""
    generative = message.platform == DECODER_PLATFORM
    on_gpu = any(p in GPU_PROVIDERS for p in providers) or message.platform == TENSORRT_PLATFORM
    where = f"model {name!r}: config field"
    runs = f"it runs on {list(providers)}"
    hints = []
    kinds = model_config_pb2().ModelInstanceGroup.Kind
    for index, group in enumerate(message.instance_group):
        field, kind = f"instance_group[{index}]", kinds.Name(group.kind)
        count = max(group.count, 1) * max(len(group.gpus), 1)
        if kind == "KIND_GPU" and not on_gpu:
            hints.append(f"{where} {field}.kind: {kind} is not honoured: no GPU execution provider is available "
                         f"({runs}); its {count} instance(s) run on the CPU")  # fmt: skip
        elif kind == "KIND_CPU" and on_gpu:
            hints.append(f"{where} {field}.kind: {kind} is not honoured: the agent's execution providers decide "
                         f"({runs}; the agent setting `providers` chooses them)")  # fmt: skip
        if group.gpus and not on_gpu:
            hints.append(f"{where} {field}.gpus: {list(group.gpus)} is not honoured: no GPU execution provider is "
                         f"available ({runs}); its {count} instance(s) run on the CPU")  # fmt: skip
        elif group.gpus and generative:
            hints.append(f"{where} {field}.gpus: {list(group.gpus)} is not honoured: a generative model runs every "
                         "instance on the agent's `device_id`")  # fmt: skip
    if message.HasField("optimization"):
        hints += _optimization_hints(message, where, providers, runs)
    ignored = sorted(key for key in message.parameters if key != "gpu_mem_limit")  # the per-model cap: honoured
    if ignored and not generative:
        hints.append(f"{where} parameters {ignored} is not honoured: parameters configure generative models only "
                     f"(platform {DECODER_PLATFORM!r}), and `gpu_mem_limit` every model; ignored")  # fmt: skip
    if message.model_warmup:
        instead = (
            "the agent does not run configured warm-up requests"
            if generative
            else "the agent warms up with random inputs at batch sizes of its own, to measure its compute profile"
        )
        hints.append(f"{where} model_warmup is not honoured: {instead}")
    if message.metric_tags:
        hints.append(f"{where} metric_tags is not honoured: the agent's metrics carry the model, its version and "
                     "the priority as attributes")  # fmt: skip
    if message.HasField("model_metrics"):
        hints.append(f"{where} model_metrics is not honoured: histogram buckets come from the agent's telemetry "
                     "settings (`latency_buckets_ms`) or the active policy")  # fmt: skip
    for output in message.output:
        if output.label_filename:
            hints.append(f"{where} output[{output.name}].label_filename is not honoured: the agent does not serve "
                         "Triton's classification extension; the output is answered as a tensor")  # fmt: skip
    return hints


def log_config_hints(name: str, message: Any | None, providers: Sequence[str]) -> None:
    """At load: one warning line per config field the agent accepts without honouring it (`config_hints`)."""
    for line in [] if message is None else config_hints(message, name, providers):
        log.warning("%s", line)


def _optimization_hints(message: Any, where: str, providers: Sequence[str], runs: str) -> list[str]:
    """The optimization fields not honoured. The `tensorrt` accelerator is, for an ONNX model on onnxruntime's
    TensorRT execution provider (its options, `tensorrt_accelerator`); nothing is for a TensorRT plan."""
    optimization = message.optimization
    if message.platform == TENSORRT_PLATFORM:
        return [f"{where} optimization ({_optimization_summary(optimization)}) is not honoured: a TensorRT plan runs "
                "as its engine was built (precision, workspace and shapes were fixed when it was built)"]  # fmt: skip
    honoured = message.platform != DECODER_PLATFORM and "TensorrtExecutionProvider" in providers
    rest = _optimization_summary(optimization, without_tensorrt=honoured)
    if rest is None:
        return []
    also = "; its tensorrt accelerator is (the TensorRT execution provider's options)" if honoured else ""
    return [f"{where} optimization ({rest}) is not honoured: the agent's execution providers decide (the agent "
            f"setting `providers`; {runs}){also}"]  # fmt: skip


def _optimization_summary(optimization: Any, *, without_tensorrt: bool = False) -> str | None:
    """The optimization fields set, naming the execution accelerators (`tensorrt`, `openvino`, ...); without the
    `tensorrt` GPU accelerator when it is honoured (None: nothing else is set)."""
    parts = []
    for descriptor, value in optimization.ListFields():
        if descriptor.name == "execution_accelerators":
            gpu = [a.name for a in value.gpu_execution_accelerator
                   if not (without_tensorrt and a.name == TENSORRT_ACCELERATOR)]  # fmt: skip
            names = [*gpu, *(a.name for a in value.cpu_execution_accelerator)]
            if names or not without_tensorrt:
                parts.append(f"execution_accelerators: {', '.join(names) or 'none'}")
        else:
            parts.append(descriptor.name)
    if not parts:
        return None if without_tensorrt else "empty"
    return "; ".join(parts)


def tensorrt_accelerator(message: Any, source: Path) -> TensorrtAccelerator | None:
    """The config's `tensorrt` GPU execution accelerator as onnxruntime's TensorRT execution provider options (None:
    the config names none). ModelConfigError names the field of a parameter the agent does not know, or a bad value.

    Triton's onnxruntime backend parameters: `precision_mode` (FP32, FP16 or INT8) -> trt_fp16_enable /
    trt_int8_enable, `max_workspace_size_bytes` -> trt_max_workspace_size, the engine and timing caches, DLA, ...
    The engine cache is on unless `trt_engine_cache_enable` says "0"/"false": a restart then reuses the engines built.
    """
    if not message.HasField("optimization"):
        return None
    found: TensorrtAccelerator | None = None
    accelerators = message.optimization.execution_accelerators.gpu_execution_accelerator
    for index, accelerator in enumerate(accelerators):
        if accelerator.name != TENSORRT_ACCELERATOR:
            continue  # another accelerator (cuda, ...): a hint, not honoured
        where = f"optimization.execution_accelerators.gpu_execution_accelerator[{index}]"
        if found is not None:
            raise ModelConfigError(f"{source}: field '{where}.name': a second {TENSORRT_ACCELERATOR!r} accelerator; "
                                   "give its parameters once")  # fmt: skip
        found = _tensorrt_parameters(dict(accelerator.parameters), f"{source}: field '{where}.parameters")
    return found


def _tensorrt_parameters(parameters: dict[str, str], where: str) -> TensorrtAccelerator:
    precision = parameters.pop("precision_mode", "FP32")
    if precision not in TENSORRT_PRECISIONS:
        raise ModelConfigError(f"{where}[precision_mode]': {precision!r} is not a precision TensorRT builds in; use "
                               f"one of {list(TENSORRT_PRECISIONS)}")  # fmt: skip
    options = {"trt_fp16_enable": str(precision == "FP16"), "trt_int8_enable": str(precision == "INT8")}
    for key, value in sorted(parameters.items()):
        if key not in _TENSORRT_PARAMETERS:
            raise ModelConfigError(f"{where}[{key}]': not a TensorRT parameter the agent knows; use precision_mode or "
                                   f"one of {sorted(_TENSORRT_PARAMETERS)}")  # fmt: skip
        option, kind = _TENSORRT_PARAMETERS[key]
        options[option] = _tensorrt_value(value, kind, f"{where}[{key}]'")
    if options.get("trt_int8_use_native_calibration_table") == "True" and precision != "INT8":
        raise ModelConfigError(f"{where}[int8_use_native_calibration_table]': needs precision_mode INT8")
    if "trt_int8_calibration_table_name" in options and precision != "INT8":
        raise ModelConfigError(f"{where}[int8_calibration_table_name]': needs precision_mode INT8")
    engine_cache = options.pop("trt_engine_cache_enable", "True") == "True"
    path = options.pop("trt_engine_cache_path", None)
    if path is not None and not engine_cache:
        raise ModelConfigError(f"{where}[trt_engine_cache_path]': set, but trt_engine_cache_enable turns the cache off")
    return TensorrtAccelerator(precision=precision, options=options, engine_cache=engine_cache, engine_cache_path=path)


def _tensorrt_value(value: str, kind: str, where: str) -> str:
    """One parameter's value as onnxruntime's TensorRT execution provider takes it (a bool as True/False)."""
    if kind == "bool":
        if value not in (*_TRUE, *_FALSE):
            raise ModelConfigError(f'{where}: {value!r} is not a boolean; use "1"/"true" or "0"/"false"')
        return str(value in _TRUE)
    if kind == "text":
        if not value:
            raise ModelConfigError(f"{where}: empty")
        return value
    if kind == "path":
        if not Path(value).is_absolute():
            raise ModelConfigError(f"{where}: {value!r} is not an absolute path (by default the agent keeps the "
                                   "engines under its state_dir)")  # fmt: skip
        return value
    lowest, highest = {"positive": (1, None), "index": (0, None), "level": (0, 5)}[kind]
    try:
        number = int(value)
    except ValueError:
        raise ModelConfigError(f"{where}: {value!r} is not a whole number") from None
    if number < lowest or (highest is not None and number > highest):
        bounds = f"{lowest}..{highest}" if highest is not None else f">= {lowest}"
        raise ModelConfigError(f"{where}: {number} is outside {bounds}")
    return str(number)


def _version_policy(policy: Any, refuse: _Refuse) -> VersionPolicy:
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return VersionPolicy(kind="all")
    if choice == "specific":
        versions = tuple(policy.specific.versions)
        if not versions:
            raise refuse("version_policy.specific.versions", "lists no versions")
        if any(v < 0 for v in versions):
            raise refuse("version_policy.specific.versions", f"{list(versions)}: versions are >= 0")
        return VersionPolicy(kind="specific", versions=tuple(sorted(set(versions))))
    if choice == "latest":
        if policy.latest.num_versions < 1:
            raise refuse("version_policy.latest.num_versions", "must be at least 1")
        return VersionPolicy(kind="latest", latest_n=policy.latest.num_versions)
    return VersionPolicy()
