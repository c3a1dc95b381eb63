"""Triton's model repository extension on the agent (`ModelControl`): `POST /v2/repository/index`,
`/v2/repository/models/{m}/load` and `/unload`. The models of the repository folder and their state; loading (or
reloading) one while the agent serves, after the memory check and with the warm-up of a start, the versions it
replaces answering what they have queued before they close; unloading one: it leaves routing at once (new requests
get 404 saying so), what it has queued is answered, then its instances close. One load or unload at a time, and none
while a policy changes the loaded versions (`ModelRegistry.changing`); their blocking parts run off the event loop.

A loaded model follows the active policy (`PolicyFollower`, the agent's PolicyApplier): the load takes the versions
the policy serves (its variant too, in place of the default where the config does not list it), its variant and
batching are in force from the step that installs it, and the next documents are checked against it as loaded.

Generative models are listed, but they are not loaded or unloaded at run time: their engines are wired into the
OpenAI API, the policy applier and telemetry at start (refused, saying so).

Refusals, mapped onto HTTP statuses by the app's repository route:

    RepositoryError          a bad body, a generative model, a model that cannot load (its config, its graph)
    ├── NotInRepository      no such model in the repository folder (or loaded)
    ├── LoadConflict         it would not fit in the memory free now (naming the need and what is free), or the
    │                        active policy does not fit it as its folder holds it now
    └── LoadFailed           onnxruntime's own error, or a bug of ours (logged with its trace)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, runtime_checkable

from edge_agent.errors import AgentError
from edge_agent.policy.apply import Reload
from edge_agent.policy.plan import ModelPlan, PolicyRefused, ServedModel
from edge_agent.runtime.config import ModelConfigError, log_config_hints, read_config_message
from edge_agent.runtime.gpu import GpuMemoryError
from edge_agent.runtime.memory import HostMemoryError
from edge_agent.runtime.repository import UnknownModelError, check_onnx_graph, is_generative, load_model, model_dirs
from edge_agent.runtime.runner import RunnerError

if TYPE_CHECKING:
    from pathlib import Path

    from edge_agent.generation.pool import EnginePool
    from edge_agent.serving.models import LoadedModel, ModelRegistry, ModelSource
    from edge_agent.serving.pipeline import PolicyGate
    from spillway.contract.spec import ModelVersion

log = logging.getLogger("spillway.agent")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


class RepositoryError(AgentError):
    """A repository request refused; the message says why."""


class NotInRepository(RepositoryError):
    """No model by that name in the repository folder (or, to unload, loaded)."""


class LoadConflict(RepositoryError):
    """The model cannot load now: it would not fit in the memory free, or the active policy does not fit it."""


class LoadFailed(RepositoryError):
    """onnxruntime failed for a reason of its own, or the agent for a bug of its own (logged with its trace)."""


@runtime_checkable
class PolicyFollower(Protocol):
    """The active policy, kept in step with the models loaded and unloaded here (edge_agent/policy/apply.py)."""

    def plan_reload(self, configured: Sequence[ModelVersion], default_version: int, repository: Path) -> Reload: ...

    def reloaded(self, reload: Reload) -> None: ...

    def unloaded(self, name: str) -> None: ...


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
        policy: the active policy; where it is a PolicyFollower (the agent's applier), loads and unloads follow it.
        engines: the generative models' pools by name, read at each call.
        """
        self.registry = registry
        self.source = source
        self.follower = policy if isinstance(policy, PolicyFollower) else None
        self._engines = engines
        self._moving: dict[str, str] = {}  # LOADING or UNLOADING, by model
        self._unavailable: dict[str, tuple[list[str], str]] = {}  # model -> (the versions it had, why)
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
            raise NotInRepository(f"no model {name!r} in the model repository {self.source.root}")
        return self.source.root / name

    def _refuse_generative(self, name: str) -> NoReturn:
        raise RepositoryError(f"{name!r} is a generative model: generative models are loaded at start only (their "
                              "engines are wired into the OpenAI API, the policy and telemetry then); restart the "
                              "agent to load it or its changes")  # fmt: skip

    async def _load_locked(self, name: str) -> list[LoadedModel]:
        if name in self._engines():
            self._refuse_generative(name)
        model_dir = self._model_dir(name)
        async with self.registry.changing:
            self._moving[name] = LOADING
            try:
                reload = await self._plan(name, model_dir)
                loaded = await self._load_versions(name, reload)
                message = await asyncio.to_thread(read_config_message, loaded[0].config)  # for its hints
            except RepositoryError as exc:
                if name not in self.registry.names():  # a failed reload leaves the running versions serving
                    self._unavailable[name] = (self._unavailable.get(name, ([""], ""))[0], str(exc))
                raise
            finally:
                self._moving.pop(name, None)
            self._commit(reload, loaded, message)
        return loaded

    async def _plan(self, name: str, model_dir: Path) -> Reload:
        """The versions the model's config serves now, and which of them (with the policy's variant) to load."""
        assert self.source is not None
        try:
            if await asyncio.to_thread(is_generative, model_dir):
                self._refuse_generative(name)
            configured = await asyncio.to_thread(load_model, model_dir)
        except (ModelConfigError, UnknownModelError) as exc:
            raise RepositoryError(f"cannot load {name!r}: {exc}") from None
        numbers = tuple(v.version for v in configured)
        wanted = self.source.defaults.get(name)  # the agent's default_versions, where it still serves that one
        default = wanted if wanted in numbers else max(numbers)
        if self.follower is None:
            return Reload(ServedModel(configured[0].config, default, numbers, self.source.root), ModelPlan(name),
                          configured)  # fmt: skip
        try:
            return self.follower.plan_reload(configured, default, self.source.root)
        except PolicyRefused as exc:
            raise LoadConflict(f"cannot load {name!r}: the active policy does not fit it as its folder holds it now: "
                               f"{exc}") from None  # fmt: skip

    async def _load_versions(self, name: str, reload: Reload) -> list[LoadedModel]:
        """Each version to load, after its memory check, warmed up; on a failure, those loaded close."""
        assert self.source is not None
        loaded: list[LoadedModel] = []
        try:
            for version in reload.versions:
                what = f"cannot load {name!r} v{version.version}"
                try:
                    if version.version not in reload.served.configured_versions and version.path.name == "model.onnx":
                        await asyncio.to_thread(check_onnx_graph, version.config, version.path)  # a variant's graph
                    await asyncio.to_thread(self.source.check_fits, version)
                    loaded.append(await asyncio.to_thread(self.source.load, version))
                except (GpuMemoryError, HostMemoryError) as exc:
                    raise LoadConflict(f"{what}: {exc}") from None
                except (ModelConfigError, RunnerError) as exc:
                    raise RepositoryError(f"{what}: {exc}") from None
                except Exception as exc:  # onnxruntime's own errors, or a bug of ours: said, never a trace
                    log.exception("loading %s v%d failed", name, version.version)
                    raise LoadFailed(f"{what}: {type(exc).__name__}: {exc}") from None
        except RepositoryError:
            await asyncio.gather(*(asyncio.to_thread(m.worker.close) for m in loaded))
            raise
        return loaded

    def _commit(self, reload: Reload, loaded: list[LoadedModel], message: Any | None) -> None:
        """On the event loop, in one step: the new versions serve, with the active policy's variant and batching."""
        name = reload.name
        replaced = self.registry.install(loaded, reload.served.default_version, reload.variant)
        if self.follower is not None:
            self.follower.reloaded(reload)
        for model in loaded:
            for hook in self.on_loaded:
                hook(model)
        self._unavailable.pop(name, None)
        if replaced:
            self._background(self._close(replaced))
        log_config_hints(name, message, loaded[0].providers)
        variant = "" if reload.variant is None else f" (v{reload.variant} serving as the policy's variant)"
        log.info("loaded %s v%s from the repository%s%s", name, ", v".join(str(m.version) for m in loaded), variant,
                 f"; v{', v'.join(str(m.version) for m in replaced)} answer their queues, then unload"
                 if replaced else "")  # fmt: skip

    async def _unload_locked(self, name: str) -> None:
        if name in self._engines():
            self._refuse_generative(name)
        async with self.registry.changing:
            if name not in self.registry.names():
                if name in self._unavailable or self._on_disk(name):
                    return  # not loaded: nothing to do (as Triton)
                raise NotInRepository(f"unknown model {name!r}")
            self._moving[name] = UNLOADING
            try:
                taken = self.registry.remove(name)
                if self.follower is not None:
                    self.follower.unloaded(name)
                self._unavailable[name] = ([str(m.version) for m in taken], "unloaded")
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
