"""The models the agent serves: each loaded version with its worker, looked up by name and version."""

from __future__ import annotations

from dataclasses import dataclass

from edge_agent.runtime.repository import UnknownModelError
from edge_agent.runtime.spec import ModelConfig
from edge_agent.scheduling.worker import ModelWorker


@dataclass
class LoadedModel:
    config: ModelConfig
    version: int
    worker: ModelWorker
    providers: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, int]:
        return self.config.name, self.version


class ModelRegistry:
    """Name -> versions; without a version a request goes to the newest loaded one."""

    def __init__(self, models: list[LoadedModel]) -> None:
        self._by_name: dict[str, dict[int, LoadedModel]] = {}
        for model in models:
            self._by_name.setdefault(model.config.name, {})[model.version] = model

    def get(self, name: str, version: str | None = None) -> LoadedModel:
        versions = self._by_name.get(name)
        if not versions:
            raise UnknownModelError(f"unknown model '{name}'")
        if version is None or version == "":
            return versions[max(versions)]
        try:
            return versions[int(version)]
        except (ValueError, KeyError):
            raise UnknownModelError(f"unknown version '{version}' of model '{name}'") from None

    def versions(self, name: str) -> list[int]:
        return sorted(self._by_name.get(name, {}))

    def all(self) -> list[LoadedModel]:
        return [m for versions in self._by_name.values() for _, m in sorted(versions.items())]
