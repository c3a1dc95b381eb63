"""The models the agent serves: each loaded version with its worker, looked up by name and version, the route
a request takes when a policy serves a variant in place of a model's default version, and where the models come
from (`ModelSource`), for the repository extension to load and unload them while the agent serves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.runtime.memory import MemoryGuard
from edge_agent.runtime.repository import UnknownModelError
from edge_agent.scheduling.worker import ModelWorker
from spillway.contract.spec import ModelConfig, ModelVersion


@dataclass
class LoadedModel:
    config: ModelConfig
    version: int
    worker: ModelWorker
    providers: tuple[str, ...] = ()
    triton_config: Any = None  # Triton's ModelConfig message as loaded and completed (`GET .../config`)

    @property
    def key(self) -> tuple[str, int]:
        return self.config.name, self.version


@dataclass(frozen=True)
class ModelSource:
    """The repository folder the registry's models were loaded from, and how to load one more version of them."""

    root: Path
    load: Callable[[ModelVersion], LoadedModel]  # instances, warm-up, worker; blocks: off the event loop
    check_fits: Callable[[ModelVersion], object]  # GpuMemoryError / HostMemoryError unless it fits beside the rest
    defaults: Mapping[str, int] = field(default_factory=dict)  # the agent's `default_versions`
    generative: Mapping[str, Any] = field(default_factory=dict)  # each generative model's Triton config, as loaded


class ModelRegistry:
    """Name -> loaded versions, each model's default version, and the variant that replaces it (if any).

    A request without a version goes to the model's default version (`defaults`, else the newest loaded one, as in
    Triton). While a variant is set, requests without a version and requests for the default version go to the
    variant instead; requests naming any other version get that version. Changes happen on the event loop, so a
    request resolved and admitted in one step never sees half a change.
    """

    def __init__(self, models: list[LoadedModel], defaults: dict[str, int] | None = None) -> None:
        self._by_name: dict[str, dict[int, LoadedModel]] = {}
        for model in models:
            self._by_name.setdefault(model.config.name, {})[model.version] = model
        self._default: dict[str, int] = {name: max(versions) for name, versions in self._by_name.items()}
        for name, version in (defaults or {}).items():
            if version not in self._by_name.get(name, {}):
                served = sorted(self._by_name.get(name, {}))
                raise UnknownModelError(f"default version {version} of model {name!r} is not served (served: {served})")
            self._default[name] = version
        self._variant: dict[str, int] = {}
        self.retiring: list[LoadedModel] = []  # taken out of routing; answering what they had queued
        self._unloaded: set[str] = set()  # taken out through the repository extension: their 404 says so
        # One change of the loaded versions at a time: a policy's (apply.py), a load's or an unload's (repository_api).
        self.changing = asyncio.Lock()
        self.source: ModelSource | None = None  # None: models cannot be loaded while the agent serves
        # What the loaded versions hold against the agent's GPU budget; a version that has answered its queue and
        # closed (`retired`) releases it.
        self.memory: MemoryGuard | None = None

    def get(self, name: str, version: str | None = None) -> LoadedModel:
        """The loaded model a request for `name` (and `version`) is served by."""
        return self.route(name, version)[0]

    def route(self, name: str, version: str | None = None) -> tuple[LoadedModel, bool]:
        """The loaded model that serves a request for `name` (and `version`), and whether a variant redirected it."""
        default = self._default.get(name)
        versions = self._by_name.get(name)
        if default is None or not versions:
            if name in self._unloaded:
                raise UnknownModelError(f"unknown model '{name}': it was unloaded (POST /v2/repository/models/{name}"
                                        "/load loads it again)")  # fmt: skip
            raise UnknownModelError(f"unknown model '{name}'")
        variant = self._variant.get(name)
        if version is None or version == "":
            wanted = default
        else:
            try:
                wanted = int(version)
            except ValueError:
                raise UnknownModelError(f"unknown version '{version}' of model '{name}'") from None
        redirected = variant is not None and wanted == default and variant != default
        found = versions.get(variant if redirected and variant is not None else wanted)
        if found is None:
            raise UnknownModelError(f"unknown version '{version}' of model '{name}'")
        return found, redirected

    def loaded(self, name: str, version: int) -> LoadedModel | None:
        """The loaded version itself, without routing (None when it is not loaded)."""
        return self._by_name.get(name, {}).get(version)

    def of(self, name: str) -> list[LoadedModel]:
        """The loaded versions of one model, oldest first."""
        return [m for _, m in sorted(self._by_name.get(name, {}).items())]

    def versions(self, name: str) -> list[int]:
        return sorted(self._by_name.get(name, {}))

    def names(self) -> list[str]:
        return sorted(self._default)

    def default_version(self, name: str) -> int:
        return self._default[name]

    def variant(self, name: str) -> int | None:
        return self._variant.get(name)

    def all(self) -> list[LoadedModel]:
        return [m for versions in self._by_name.values() for _, m in sorted(versions.items())]

    def workers(self) -> list[ModelWorker]:
        """Every worker that may still hold requests: the routable ones and those retiring."""
        return [m.worker for m in self.all()] + [m.worker for m in self.retiring]

    # ---- changes (on the event loop) ---------------------------------------------------------

    def add(self, model: LoadedModel) -> None:
        versions = self._by_name.setdefault(model.config.name, {})
        if model.version in versions:
            raise ValueError(f"{model.config.name} v{model.version} is already loaded")
        versions[model.version] = model

    def set_variant(self, name: str, version: int | None) -> None:
        """Serve `version` in place of the default version (None: the default again); it must be loaded."""
        if version is None or version == self._default.get(name):
            self._variant.pop(name, None)
            return
        if version not in self._by_name.get(name, {}):
            raise ValueError(f"{name} v{version} is not loaded")
        self._variant[name] = version

    def retire(self, name: str, version: int) -> LoadedModel:
        """Take a version out of routing; it stays in `retiring` until `retired` once its queue is empty."""
        model = self._by_name[name].pop(version)
        self.retiring.append(model)
        return model

    def retired(self, model: LoadedModel) -> None:
        """A version taken out of routing has answered its queue and closed: its memory is free again."""
        self.retiring.remove(model)
        if self.memory is not None:
            self.memory.release(model)

    def install(self, models: list[LoadedModel], default: int, variant: int | None = None) -> list[LoadedModel]:
        """Serve `models`, every version of one model, in place of the versions loaded now (a reload), with `default`
        as its default version and `variant` (one of `models`) served in its place; the default need not be among
        `models` while a variant replaces it (in memory too). The versions replaced leave routing into `retiring`
        and are returned, for the caller to close once they have answered their queues."""
        name = models[0].config.name
        if any(m.config.name != name for m in models):
            raise ValueError(f"install takes the versions of one model, got {sorted({m.config.name for m in models})}")
        numbers = {m.version for m in models}
        if variant is not None and variant not in numbers:
            raise ValueError(f"{name} v{variant} is not among the versions installed ({sorted(numbers)})")
        if default not in numbers and variant is None:
            raise ValueError(f"{name}: the default v{default} is not among the versions installed ({sorted(numbers)})")
        replaced = self._take_out(name)
        self._by_name[name] = {m.version: m for m in models}
        self._default[name] = default
        if variant is not None and variant != default:
            self._variant[name] = variant
        self._unloaded.discard(name)
        return replaced

    def remove(self, name: str) -> list[LoadedModel]:
        """Take every version of `name` out of routing (new requests get 404 saying it was unloaded) into
        `retiring`; returns them, for the caller to drain and close."""
        if name not in self._default:
            raise UnknownModelError(f"unknown model '{name}'")
        self._unloaded.add(name)
        return self._take_out(name)

    def _take_out(self, name: str) -> list[LoadedModel]:
        taken = [m for _, m in sorted(self._by_name.pop(name, {}).items())]
        self._default.pop(name, None)
        self._variant.pop(name, None)
        self.retiring.extend(taken)
        return taken
