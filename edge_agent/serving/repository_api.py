"""Triton's model configuration and model repository endpoints on the agent:

- `GET /v2/models/{m}[/versions/{v}]/config`: the model's config as Triton returns it (`config_json` of the message
  the model was loaded with, completed as Triton completes it: `completed_config`, `generative_config`);
- `POST /v2/repository/index`, `/v2/repository/models/{m}/load` and `/unload` (`ModelControl`): the models of the
  repository folder and their state; loading (or reloading) one while the agent serves, after the memory check and
  with the warm-up of a start, the versions it replaces answering what they have queued before they close;
  unloading one: it leaves routing at once (new requests get 404 saying so), what it has queued is answered, then
  its instances close. One load or unload at a time, and none while a policy changes the loaded versions
  (`ModelRegistry.changing`); their blocking parts run off the event loop.

Generative models are listed and their config is served, but they are not loaded or unloaded at run time: their
engines are wired into the OpenAI API, the policy applier and telemetry at start (refused with 400 saying so).

Refusals are `RepositoryError`s carrying their status: 400 a bad body or a model that cannot load, 404 no such model,
409 a model that would not fit in the memory free now (naming what it needs and what is free), 500 a load that
failed for a reason of onnxruntime's or ours (logged with its trace).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from edge_agent.errors import AgentError
from edge_agent.runtime.config import (
    DECODER_PLATFORM,
    TRITON_DATATYPES,
    ModelConfigError,
    config_hints,
    model_config_pb2,
    read_config_message,
)
from edge_agent.runtime.gpu import GPU_PROVIDERS, GpuMemoryError
from edge_agent.runtime.memory import HostMemoryError
from edge_agent.runtime.repository import UnknownModelError, is_generative, load_model, model_dirs
from edge_agent.runtime.runner import RunnerError
from spillway.contract.spec import ModelConfig, QueuePolicy

if TYPE_CHECKING:
    from pathlib import Path

    from edge_agent.generation.pool import EnginePool
    from edge_agent.serving.models import LoadedModel, ModelRegistry, ModelSource
    from edge_agent.serving.pipeline import PolicyGate

log = logging.getLogger("spillway.agent")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
_BACKENDS = {"onnxruntime_onnx": "onnxruntime", "tensorrt_plan": "tensorrt"}
_TRITON_TYPES = {v2: triton for triton, v2 in TRITON_DATATYPES.items()}
_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}  # fmt: skip


class RepositoryError(AgentError):
    """A repository request refused; `status` is its HTTP answer (400, 404 or 409) and the message says why."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# ---- the model config, as Triton returns it -------------------------------------------------------------------


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
    if not done.HasField("version_policy"):
        done.version_policy.latest.num_versions = 1
    on_gpu = any(p in GPU_PROVIDERS for p in providers)
    kinds = pb2.ModelInstanceGroup.Kind
    if not done.instance_group:
        done.instance_group.add(count=1)
    for group in done.instance_group:
        group.count = max(group.count, 1)
        if group.kind == kinds.Value("KIND_AUTO"):
            group.kind = kinds.Value("KIND_GPU" if group.gpus or on_gpu else "KIND_CPU")
    return done


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
    if not done.HasField("version_policy"):
        done.version_policy.latest.num_versions = 1
    on_gpu = any(p in GPU_PROVIDERS for p in providers)
    if not done.instance_group:
        done.instance_group.add(count=1)
    for group in done.instance_group:
        group.count = max(group.count, 1)
        if group.kind == pb2.ModelInstanceGroup.Kind.Value("KIND_AUTO"):
            group.kind = pb2.ModelInstanceGroup.Kind.Value("KIND_GPU" if on_gpu else "KIND_CPU")
    return done


def log_config_hints(name: str, message: Any | None, providers: Sequence[str]) -> None:
    """At load: one line per config field the agent accepts without honouring it (runtime.config.config_hints)."""
    for line in [] if message is None else config_hints(message, name, providers):
        log.warning("%s", line)


# ---- request bodies -------------------------------------------------------------------------------------------


def parse_index_body(body: bytes) -> bool:
    """`POST /v2/repository/index`: an empty body, or {"ready": bool} (Triton's; `repository_name` "" accepted).
    Returns whether only the ready models are asked for."""
    document = _object(body, "the repository index")
    unknown = sorted(set(document) - {"ready", "repository_name"})
    if unknown:
        raise RepositoryError(f'the repository index takes {{"ready": true|false}}; unknown field(s) {unknown}')
    ready = document.get("ready", False)
    if not isinstance(ready, bool):
        raise RepositoryError(f'the repository index: "ready" is true or false, not {json.dumps(ready)}')
    if document.get("repository_name", "") not in ("", None):
        raise RepositoryError("the repository index: this agent has one repository; leave repository_name empty")
    return ready


def check_load_body(name: str, body: bytes) -> None:
    """`POST .../load`: an empty body or {"parameters": {}}; a config or files sent with it are refused (the agent
    loads what the repository folder holds)."""
    parameters = _parameters(body, f"loading {name!r}")
    if "config" in parameters or any(key.startswith("file:") for key in parameters):
        raise RepositoryError(f"loading {name!r}: a config or files sent with the request are not supported; "
                              "the agent loads what the repository folder holds (edit it, then load)")  # fmt: skip
    if parameters:
        raise RepositoryError(f"loading {name!r}: unknown parameter(s) {sorted(parameters)}")


def check_unload_body(name: str, body: bytes) -> None:
    """`POST .../unload`: an empty body or {"parameters": {"unload_dependents": bool}} (no model depends on another
    here, so it changes nothing)."""
    parameters = _parameters(body, f"unloading {name!r}")
    dependents = parameters.pop("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise RepositoryError(f"unloading {name!r}: parameters.unload_dependents is true or false")
    if parameters:
        raise RepositoryError(f"unloading {name!r}: unknown parameter(s) {sorted(parameters)}")


def _parameters(body: bytes, what: str) -> dict[str, Any]:
    document = _object(body, what)
    unknown = sorted(set(document) - {"parameters"})
    if unknown:
        raise RepositoryError(f'{what}: the body takes {{"parameters": {{...}}}}; unknown field(s) {unknown}')
    parameters = document.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise RepositoryError(f'{what}: "parameters" is a JSON object')
    return dict(parameters)


def _object(body: bytes, what: str) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RepositoryError(f"{what}: the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise RepositoryError(f"{what}: the body is a JSON object")
    return document


# ---- loading and unloading ------------------------------------------------------------------------------------


class ModelControl:
    """The repository extension: which models the repository folder holds and their state; load and unload."""

    def __init__(
        self,
        registry: ModelRegistry,
        source: ModelSource | None,
        *,
        policy: PolicyGate | None = None,
        engines: Callable[[], Mapping[str, EnginePool]] = dict,
    ) -> None:
        """Args:
        registry: the served V2 models (changed here on load and unload).
        source: the repository folder and how to load a version (None: nothing can be loaded at run time).
        policy: the active policy; a reloaded model takes its variant and batching again.
        engines: the generative models' pools by name, read at each call.
        """
        self.registry = registry
        self.source = source
        self.policy = policy
        self._engines = engines
        self._moving: dict[str, str] = {}  # LOADING or UNLOADING, by model
        self._unavailable: dict[str, tuple[list[str], str]] = {}  # model -> (the versions it had, why)
        self._listeners: dict[str, dict[int, Any]] = {}  # unloaded model -> its versions' telemetry hooks
        self._tasks: set[asyncio.Task[Any]] = set()
        self.on_loaded: list[Callable[[LoadedModel], None]] = []  # e.g. telemetry's `attach`

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: each version of each model with its state, models not loaded UNAVAILABLE."""
        on_disk = [d.name for d in model_dirs(self.source.root)] if self.source and self.source.root.is_dir() else []
        engines = self._engines()
        served = set(self.registry.names())
        rows: list[dict[str, str]] = []

        def row(name: str, version: str, state: str, reason: str = "") -> None:
            rows.append({"name": name, "version": version, "state": state, "reason": reason})

        for name in sorted({*on_disk, *served, *engines, *self._unavailable}):
            moving = self._moving.get(name)
            if name in served:
                for number in self.registry.versions(name):
                    row(name, str(number), moving or READY)
            elif name in engines:
                row(name, engines[name].version, READY)
            else:
                versions, why = self._unavailable.get(name, ([""], "not loaded"))
                for version in versions:
                    row(name, version, moving or UNAVAILABLE, "" if moving else why)
        return [r for r in rows if r["state"] == READY] if ready_only else rows

    async def load(self, name: str) -> list[LoadedModel]:
        """Load (or reload) `name` from the repository folder; returns its versions, serving once this returns."""
        return await self._shielded(self._load_locked(name))

    async def unload(self, name: str) -> None:
        """Stop routing to `name`, answer what it has queued, close its instances."""
        await self._shielded(self._unload_locked(name))

    async def _shielded(self, work: Coroutine[Any, Any, Any]) -> Any:
        """Run `work` to its end even when the request that asked for it goes away (a load half done would leak its
        sessions; an unload half done would never close them)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    def _on_disk(self, name: str) -> bool:
        """Whether the repository folder holds a model directory by that name (never a path outside it)."""
        root = None if self.source is None else self.source.root
        return root is not None and root.is_dir() and name in {d.name for d in model_dirs(root)}

    def _model_dir(self, name: str) -> Path:
        if self.source is None:
            raise RepositoryError("this agent was given its models without a repository folder: nothing to load")
        if not self._on_disk(name):
            raise RepositoryError(f"no model {name!r} in the model repository {self.source.root}", 404)
        return self.source.root / name

    def _refuse_generative(self, name: str) -> NoReturn:
        raise RepositoryError(f"{name!r} is a generative model: generative models are loaded at start only (their "
                              "engines are wired into the OpenAI API, the policy and telemetry then); restart the "
                              "agent to load it or its changes")  # fmt: skip

    async def _load_locked(self, name: str) -> list[LoadedModel]:
        if name in self._engines():
            self._refuse_generative(name)
        model_dir = self._model_dir(name)
        assert self.source is not None
        async with self.registry.changing:
            self._moving[name] = LOADING
            try:
                loaded = await self._load_versions(name, model_dir)
                message = await asyncio.to_thread(read_config_message, loaded[0].config)  # for its hints
            except RepositoryError as exc:
                if name not in self.registry.names():  # a failed reload leaves the running versions serving
                    self._unavailable[name] = (self._unavailable.get(name, ([""], ""))[0], str(exc))
                raise
            finally:
                self._moving.pop(name, None)
            self._commit(name, loaded, message)
        return loaded

    async def _load_versions(self, name: str, model_dir: Path) -> list[LoadedModel]:
        """Each version the config serves, after its memory check, warmed up; on a failure, those loaded close."""
        assert self.source is not None
        try:
            if await asyncio.to_thread(is_generative, model_dir):
                self._refuse_generative(name)
            versions = await asyncio.to_thread(load_model, model_dir)
        except (ModelConfigError, UnknownModelError) as exc:
            raise RepositoryError(f"cannot load {name!r}: {exc}") from None
        loaded: list[LoadedModel] = []
        try:
            for version in versions:
                what = f"cannot load {name!r} v{version.version}"
                try:
                    await asyncio.to_thread(self.source.check_fits, version)
                    loaded.append(await asyncio.to_thread(self.source.load, version))
                except (GpuMemoryError, HostMemoryError) as exc:
                    raise RepositoryError(f"{what}: {exc}", 409) from None
                except (ModelConfigError, RunnerError) as exc:
                    raise RepositoryError(f"{what}: {exc}") from None
                except Exception as exc:  # onnxruntime's own errors, or a bug of ours: said, never a trace
                    log.exception("loading %s v%d failed", name, version.version)
                    raise RepositoryError(f"{what}: {type(exc).__name__}: {exc}", 500) from None
        except RepositoryError:
            await asyncio.gather(*(asyncio.to_thread(m.worker.close) for m in loaded))
            raise
        return loaded

    def _commit(self, name: str, loaded: list[LoadedModel], message: Any | None) -> None:
        """On the event loop, in one step: the new versions serve, with the active policy's variant and batching."""
        assert self.source is not None
        replaced = self.registry.install(loaded, self.source.defaults.get(name))
        hooks = {**self._listeners.pop(name, {}), **{m.version: m.worker.stats.listener for m in replaced}}
        plan = None if self.policy is None else self.policy.plan_for(name)
        if plan is not None and plan.variant is not None and plan.variant.version in self.registry.versions(name):
            self.registry.set_variant(name, plan.variant.version)
        for model in loaded:
            if plan is not None and (plan.max_queue_delay_us is not None or plan.preferred_batch_sizes is not None):
                delay = None if plan.max_queue_delay_us is None else plan.max_queue_delay_us / 1e6
                model.worker.retune(max_queue_delay_s=delay, preferred_batch_sizes=plan.preferred_batch_sizes)
            model.worker.stats.listener = model.worker.stats.listener or hooks.get(model.version)
            for hook in self.on_loaded:
                hook(model)
        self._unavailable.pop(name, None)
        if replaced:
            self._background(self._close(replaced))
        log_config_hints(name, message, loaded[0].providers)
        log.info("loaded %s v%s from the repository%s", name, ", v".join(str(m.version) for m in loaded),
                 f"; v{', v'.join(str(m.version) for m in replaced)} answer their queues, then unload"
                 if replaced else "")  # fmt: skip

    async def _unload_locked(self, name: str) -> None:
        if name in self._engines():
            self._refuse_generative(name)
        async with self.registry.changing:
            if name not in self.registry.names():
                if name in self._unavailable or self._on_disk(name):
                    return  # not loaded: nothing to do (as Triton)
                raise RepositoryError(f"unknown model {name!r}", 404)
            self._moving[name] = UNLOADING
            try:
                taken = self.registry.remove(name)
                self._unavailable[name] = ([str(m.version) for m in taken], "unloaded")
                self._listeners[name] = {m.version: m.worker.stats.listener for m in taken}
                log.info("unloading %s: new requests are refused; answering what it has queued", name)
                await self._close(taken)
            finally:
                self._moving.pop(name, None)
        log.info("unloaded %s", name)

    async def _close(self, models: list[LoadedModel]) -> None:
        """Answer what each version has queued or running, then close its instances and forget it."""
        try:
            await asyncio.gather(*(m.worker.drain() for m in models))
            await asyncio.gather(*(asyncio.to_thread(m.worker.close) for m in models))
        finally:
            for model in models:
                if model in self.registry.retiring:
                    self.registry.retired(model)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
