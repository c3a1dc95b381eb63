"""A model's configuration as Triton returns it (`GET /v2/models/{m}[/versions/{v}]/config`): `config_json` of the
message the model was loaded with, completed as Triton completes it (`completed_config`, `generative_config`), or
derived from the normalised config of a model the agent holds without its file (`derived_config`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from edge_agent.runtime.config import DECODER_PLATFORM, TRITON_DATATYPES, model_config_pb2
from edge_agent.runtime.gpu import GPU_PROVIDERS
from spillway.contract.spec import ModelConfig, QueuePolicy

_BACKENDS = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt"}
_TRITON_TYPES = {v2: triton for triton, v2 in TRITON_DATATYPES.items()}
_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}  # fmt: skip


def config_json(message: Any) -> dict[str, Any]:
    """Triton's JSON of a ModelConfig: proto field names, the fields without presence printed with their defaults
    (Triton's `always_print_primitive_fields`), and 64-bit integers as numbers, as Triton prints them (protobuf's
    JSON writes them as strings)."""
    try:
        body = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)  # fmt: skip
    except TypeError:  # protobuf before 5.26 names that option differently
        body = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         including_default_value_fields=True)  # fmt: skip
    return _int64_as_numbers(message.DESCRIPTOR, body)


def _int64_as_numbers(descriptor: Any, body: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.name not in body:
            continue
        value = body[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            body[field.name] = {key: _number_value(entry, item) for key, item in value.items()}
        elif _repeated(field):
            body[field.name] = [_number_value(field, item) for item in value]
        else:
            body[field.name] = _number_value(field, value)
    return body


def _number_value(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        return _int64_as_numbers(field.message_type, value)
    return int(value) if field.type in _INT64 else value


def _repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf 6 deprecates `label`
    return bool(flag) if flag is not None else bool(field.label == FieldDescriptor.LABEL_REPEATED)


def completed_config(message: Any | None, config: ModelConfig, providers: Sequence[str]) -> Any:
    """The model's config message (derived from `config` without one) with what Triton fills in itself: the name,
    the backend and platform, the version policy, and each instance group's count and kind (from the execution
    providers it runs on, where the config leaves the kind to the server)."""
    pb2 = model_config_pb2()
    done = pb2.ModelConfig()
    done.CopyFrom(message if message is not None else derived_config(config))
    done.name = config.name
    done.platform = done.platform or config.platform
    if not done.backend and done.platform in _BACKENDS:
        done.backend = _BACKENDS[done.platform]
    _complete_instances(done, providers, pinned_on_gpu=True)
    return done


def generative_config(name: str, version: str, message: Any | None, providers: Sequence[str]) -> Any:
    """A generative model's config: its config file's, completed, or for one without a file, what the agent derives
    (the decoder platform, no batching dimension, the version it serves, one instance)."""
    pb2 = model_config_pb2()
    if message is None:
        message = pb2.ModelConfig(name=name, platform=DECODER_PLATFORM)
        if version.isdigit():
            message.version_policy.specific.versions.append(int(version))
    done = pb2.ModelConfig()
    done.CopyFrom(message)
    done.name = name
    _complete_instances(done, providers, pinned_on_gpu=False)  # (a decoder runs on the agent's device_id)
    return done


def _complete_instances(done: Any, providers: Sequence[str], *, pinned_on_gpu: bool) -> None:
    """Triton's defaults: the newest version served, at least one instance per group, and a kind for each group
    that leaves it to the server (GPU where it runs on a GPU provider, or lists gpus when `pinned_on_gpu`)."""
    if not done.HasField("version_policy"):
        done.version_policy.latest.num_versions = 1
    on_gpu = any(p in GPU_PROVIDERS for p in providers)
    kinds = model_config_pb2().ModelInstanceGroup.Kind
    if not done.instance_group:
        done.instance_group.add(count=1)
    for group in done.instance_group:
        group.count = max(group.count, 1)
        if group.kind == kinds.Value("KIND_AUTO"):
            group.kind = kinds.Value("KIND_GPU" if on_gpu or (pinned_on_gpu and group.gpus) else "KIND_CPU")


def derived_config(config: ModelConfig) -> Any:
    """Triton's ModelConfig message for a normalised config (a model the agent holds without its file)."""
    pb2 = model_config_pb2()
    message = pb2.ModelConfig(name=config.name, platform=config.platform, max_batch_size=config.max_batch_size)
    for specs, tensors in ((config.inputs, message.input), (config.outputs, message.output)):
        for spec in specs:
            tensors.add(name=spec.name, data_type=pb2.DataType.Value(_TRITON_TYPES[spec.datatype]), dims=spec.shape)
    batching = config.dynamic_batching
    if batching is not None:
        target = message.dynamic_batching
        target.preferred_batch_size.extend(batching.preferred_batch_sizes)
        target.max_queue_delay_microseconds = batching.max_queue_delay_us
        target.priority_levels = batching.priority_levels
        target.default_priority_level = batching.default_priority_level
        _queue_policy(batching.default_queue_policy, target.default_queue_policy)
        for level, policy in batching.priority_queue_policy.items():
            _queue_policy(policy, target.priority_queue_policy[level])
    message.instance_group.add(count=config.instance_count)
    versions = config.version_policy
    if versions.kind == "all":
        message.version_policy.all.SetInParent()
    elif versions.kind == "specific":
        message.version_policy.specific.versions.extend(versions.versions)
    else:
        message.version_policy.latest.num_versions = versions.latest_n
    for key, value in config.parameters.items():
        message.parameters[key].string_value = value
    return message


def _queue_policy(policy: QueuePolicy, target: Any) -> None:
    target.timeout_action = target.DELAY if policy.timeout_action == "DELAY" else target.REJECT
    target.default_timeout_microseconds = policy.default_timeout_us
    target.allow_timeout_override = policy.allow_timeout_override
    target.max_queue_size = policy.max_queue_size
