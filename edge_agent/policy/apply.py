"""Apply policy documents to the running agent, without a restart and without dropping a request.

A document is applied whole or not at all:
  1. it is checked against the served models (`build_plan`); a misfit is refused;
  2. variant versions that are not loaded are loaded beside the running ones, off the event loop, each after a
     memory check (GPU via NVML where it measures, else host memory); a version that does not fit or fails to
     load refuses the document, and whatever was loaded for it is closed again;
  3. in one step on the event loop (no request can observe half of it): new versions join the registry, routes
     move to the variants, batching parameters are retuned, shed and fallback change for the next admission;
  4. versions no longer wanted leave routing at once and are closed once everything they had queued is answered;
  5. telemetry is rebuilt if its buckets or interval changed, and a document from the control plane is cached.

Tenants: a document's `tenants` are merged over the agent config's (None: the config's alone) in the commit step,
so the next request authenticates, is admitted and is weighted under them; tenants that cannot be merged (a token
the operator's, or shared by two tenants) refuse the document. Versions and pools it loads get the weights then.
     A cache write the disk refuses (full, say) is remembered and tried again on every poll tick (`sync_cache`)
     until it succeeds, so that a restart without the control plane never runs an older policy than the one that
     was active; meanwhile the status says the cache is behind, and the streak is logged once (and its end once).

Which versions stay loaded: those the model's configuration serves, plus the variant; when the variant is not one
of those, it replaces the default version in memory (the device was sized for one), and reverting loads the
default again first.

A V2 model loaded or unloaded through the repository extension (serving/repository_api.py) follows the active
policy, under `registry.changing`: `plan_reload` says which versions the load takes (the variant in place of the
default where the policy serves one the config does not list) and the policy's settings for the model as its folder
holds it now (refused, PolicyRefused, when the document does not fit it), `reloaded` puts them in force in the step
that installs the versions, and the next documents are checked against that model; `unloaded` forgets it.

Generative models (decoders) serve one version at a time, as one `EnginePool` in the `engines` dict that the
OpenAI API, the app and the telemetry share (the same dict object, changed in place):
- a variant (or reverting from one) loads the other version's pool off the event loop (the load checks the memory
  as at start: the weights beside what runs, the KV budget's working copies against the free memory); a failed
  load refuses the document and the running pool stays. The new pool takes the model's key in `engines` in the
  commit step, so new streams go to it; the old one drains (its running streams finish on it) and is closed;
- `max_num_seqs` and `max_num_batched_tokens` lower the served pool's scheduler limits from its next step
  (`EnginePool.limit`; never above the configured ones, None restores them); `max_tokens_cap`, overflow, shed and
  fallback are read by admission through `plan_for`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from edge_agent.failures import FailureStreak
from edge_agent.policy.cache import CachedPolicy, CacheUnreadable, CacheUnwritable, PolicyCache
from edge_agent.policy.plan import (
    ModelPlan,
    Plan,
    PolicyRefused,
    ServedDecoder,
    ServedModel,
    Source,
    build_plan,
    local_plan,
)
from edge_agent.runtime.repository import UnknownModelError, version_on_disk
from spillway.contract.policy import Overflow, PolicyDocument
from spillway.contract.spec import ModelVersion

if TYPE_CHECKING:
    from pathlib import Path

    from edge_agent.generation.pool import EnginePool
    from edge_agent.serving.models import LoadedModel, ModelRegistry
    from edge_agent.telemetry.live import LiveTelemetry
    from edge_agent.tenants import TenantRegistry

log = logging.getLogger("spillway.agent.policy")
RETIRED_WAIT_S = 60.0  # longest a decoder switch waits for the same model's previous pool to finish and close


@dataclass(frozen=True)
class Refusal:
    at: float  # wall-clock seconds
    message: str
    version: int | None
    source: str

    def json(self) -> dict[str, Any]:
        return {"at": isoformat_utc(self.at), "message": self.message, "version": self.version, "source": self.source}


@dataclass(frozen=True)
class Reload:
    """A V2 model (re)loaded through the repository extension, as the active policy serves it."""

    served: ServedModel  # what the next documents are checked against: the model as its folder holds it now
    plan: ModelPlan  # the active document's settings for it
    versions: tuple[ModelVersion, ...]  # to load: the configured ones, the variant in place of the default if unlisted

    @property
    def name(self) -> str:
        return self.served.config.name

    @property
    def variant(self) -> int | None:
        return None if self.plan.variant is None else self.plan.variant.version


class PolicyApplier:
    """Holds the active policy and moves the agent from one to the next; `plan_for` is read on every request."""

    def __init__(
        self,
        registry: ModelRegistry,
        served: Mapping[str, ServedModel],
        *,
        load: Callable[[ModelVersion], LoadedModel],
        check_fits: Callable[[ModelVersion], object] = lambda version: None,
        cache: PolicyCache | None = None,
        telemetry: LiveTelemetry | None = None,
        agent_id: str | None = None,
        clock: Callable[[], float] = time.time,
        engines: dict[str, EnginePool] | None = None,
        decoders: Mapping[str, ServedDecoder] | None = None,
        load_engine: Callable[[str, int], EnginePool] | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        """Args:
        registry: the served models (routes and loaded versions change here).
        served: per model, what a document is checked against.
        load: loads one version (with warm-up); runs on a worker thread.
        check_fits: raises if a version would not fit in memory beside the loaded ones; runs on a worker thread.
        cache: where the last good document from the control plane is kept.
        telemetry: counts refusals and is rebuilt when a document changes buckets or interval.
        agent_id: documents for another agent are refused (None: not checked).
        engines: the generative models' pools by name, the dict the APIs read (a variant switch changes it in place).
        decoders: per generative model, what a document is checked against.
        load_engine: loads a decoder version's pool (name, version) after its memory check; runs on a worker thread.
        tenants: the agent's tenants, which a document's `tenants` change (None: documents' tenants are ignored).
        """
        self.registry = registry
        self.served = dict(served)
        self._load = load
        self._check_fits = check_fits
        self.cache = cache
        self.telemetry = telemetry
        self.agent_id = agent_id
        self._clock = clock
        self.engines: dict[str, EnginePool] = engines if engines is not None else {}
        self.decoders = dict(decoders or {})
        self._load_engine = load_engine
        self.tenants = tenants
        self.retiring_engines: list[EnginePool] = []  # switched away from, finishing their running streams
        self.plan: Plan = local_plan(self.served, self.decoders)
        # The agent's own overflow setting, for a model loaded after start (build_agent gives it to every model).
        overflows = [m.overflow for m in self.served.values()] + [d.overflow for d in self.decoders.values()]
        self.overflow: Overflow | None = overflows[0] if overflows else None
        self.etag: str | None = None
        self.applied_at: float | None = None
        self.refusals = 0
        self.last_refusal: Refusal | None = None
        self.transitions: dict[str, str] = {}  # model -> what is under way ("loading v2")
        self.closing = False
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        # The policy cache on disk: what it holds as far as this process knows, and what it is behind on.
        self.cached_version: int | None = None
        self._cache_behind: CachedPolicy | None = None  # the latest document from the control plane, not yet written
        self._cache_lock = asyncio.Lock()  # one write at a time, so an older document never lands after a newer one
        self.cache_writes = FailureStreak(
            log,
            "could not cache policy version {version}: {error}; the cache holds {held} and is written on the next "
            "poll tick that can (logged again once it is)",
            "cached policy version {version} after {failures} failed write(s)",
        )

    # ---- the hot path ------------------------------------------------------------------------

    def plan_for(self, name: str) -> ModelPlan | None:
        """The active policy of a served model, V2 or generative (None: not served)."""
        return self.plan.models.get(name)

    # ---- applying ----------------------------------------------------------------------------

    async def apply(self, document: PolicyDocument, source: Source, etag: str | None = None) -> bool:
        """Apply `document` whole, or refuse it (recorded, counted, logged) and keep the active policy."""
        async with self._lock, self.registry.changing:  # (changing: not while a model loads or unloads)
            if self.closing:
                return False
            try:
                if self.agent_id is not None and document.agent != self.agent_id:
                    raise PolicyRefused(f"agent: the document is for agent {document.agent!r}, not {self.agent_id!r}")
                plan = build_plan(document, source, self.served, self.decoders)
                if self.tenants is not None:
                    try:
                        self.tenants.check(document.tenants)
                    except ValueError as exc:
                        raise PolicyRefused(f"tenants: {exc}") from None
            except PolicyRefused as exc:
                self.refuse(str(exc), document.version, source)
                return False
            try:
                loads, unloads = self._version_changes(plan)
                switches = self._engine_switches(plan)
                loaded = await self._load_all(loads)
                try:
                    engines = await self._load_engines(switches)
                except PolicyRefused:
                    await asyncio.gather(*(asyncio.to_thread(m.worker.close) for m in loaded))
                    raise
            except PolicyRefused as exc:
                self.refuse(str(exc), document.version, source)
                return False
            if self.closing:  # the agent began draining while versions loaded: they will serve nobody
                await asyncio.gather(*(asyncio.to_thread(m.worker.close) for m in loaded),
                                     *(asyncio.to_thread(pool.close) for pool in engines.values()))  # fmt: skip
                return False
            self._commit(plan, loaded, unloads, etag, engines)
            if self.telemetry is not None:
                try:
                    await self.telemetry.reconfigure(plan.latency_buckets_ms, plan.export_interval_s)
                except Exception:  # telemetry never takes the agent down; the running pipeline stays
                    log.exception("rebuilding telemetry for policy version %d failed", document.version)
            log.info("applied policy version %d from %s%s", document.version, source.replace("_", " "),
                     "".join(f"; {name}: {plan.models[name].json()}" for name in sorted(plan.models)))  # fmt: skip
        if source == "control_plane" and self.cache is not None:
            self._cache_behind = CachedPolicy(document, etag)
            await self.sync_cache()
        return True

    async def sync_cache(self) -> bool:
        """Write the latest document from the control plane to the cache if the cache is behind it; True when the
        cache is up to date. Run after each apply and on every poll tick, so that a refused write is retried."""
        if self.cache is None:
            return True
        async with self._cache_lock:
            behind = self._cache_behind
            if behind is None:
                return True
            try:
                await asyncio.to_thread(self.cache.store, behind.document, behind.etag)
            except CacheUnwritable as exc:
                held = "nothing" if self.cached_version is None else f"version {self.cached_version}"
                self.cache_writes.failed(exc, version=behind.document.version, held=held)
                return False
            self.cache_writes.worked(version=behind.document.version)
            self.cached_version = behind.document.version
            if self._cache_behind is behind:
                self._cache_behind = None
            return self._cache_behind is None

    async def apply_cached(self) -> bool:
        """At start, before serving: the cached document if there is a valid one (else the local configuration)."""
        if self.cache is None:
            return False
        try:
            cached = self.cache.load()
        except CacheUnreadable as exc:
            self.refuse(str(exc), None, "cache")
            return False
        if cached is None:
            return False
        self.cached_version = cached.document.version
        return await self.apply(cached.document, "cache", cached.etag)

    def confirmed(self) -> None:
        """The control plane answered 304 to the active document's ETag: a cached policy is its policy now."""
        if self.plan.source == "cache":
            self.plan = replace(self.plan, source="control_plane")

    def refuse(self, message: str, version: int | None, source: str) -> None:
        """Record a refused document: status, metric, one log line."""
        self.refusals += 1
        self.last_refusal = Refusal(self._clock(), message, version, source)
        if self.telemetry is not None:
            self.telemetry.refused(source)
        shown = "a document" if version is None else f"policy version {version}"
        log.warning("refused %s from %s: %s (keeping the active policy)", shown, source.replace("_", " "), message)

    # ---- models loaded and unloaded through the repository extension (under registry.changing) ---------------

    def plan_reload(self, configured: Sequence[ModelVersion], default_version: int, repository: Path) -> Reload:
        """The versions a (re)load of a V2 model takes and the active policy's settings for it, from the versions
        its config serves now (`configured`, one model's). PolicyRefused when the active document does not fit it."""
        config = configured[0].config
        served = ServedModel(config, default_version, tuple(v.version for v in configured), repository, self.overflow)
        document = self.plan.document
        if document is None:
            plan = ModelPlan(config.name, overflow=served.overflow)
        else:
            plan = build_plan(document, self.plan.source, {config.name: served}).models[config.name]
        by_number = {v.version: v for v in configured}
        versions = []
        for number in sorted(self._target_versions(served, plan)):
            version = by_number.get(number, plan.variant)  # (the only version it may lack is the variant)
            assert version is not None and version.version == number
            versions.append(version)
        return Reload(served, plan, tuple(versions))

    def reloaded(self, reload: Reload) -> None:
        """On the event loop, in the step that installs the reloaded versions: the active policy's settings for the
        model are in force, and the next documents are checked against the model as loaded now."""
        self.served[reload.name] = reload.served
        self.plan = replace(self.plan, models={**self.plan.models, reload.name: reload.plan})
        self._serve_as_planned(reload.name, reload.plan)

    def unloaded(self, name: str) -> None:
        """A model left routing: documents are no longer checked against it (a load brings it back)."""
        self.served.pop(name, None)
        self.plan = replace(self.plan, models={n: p for n, p in self.plan.models.items() if n != name})

    # ---- what a plan changes ---------------------------------------------------------------------------------

    def _target_versions(self, served: ServedModel, plan: ModelPlan) -> set[int]:
        configured = set(served.configured_versions)
        if plan.variant is None or plan.variant.version in configured:
            return configured
        return (configured - {served.default_version}) | {plan.variant.version}

    def _version_changes(self, plan: Plan) -> tuple[list[ModelVersion], list[tuple[str, int]]]:
        loads: list[ModelVersion] = []
        unloads: list[tuple[str, int]] = []
        for name, model_plan in plan.models.items():
            if name not in self.served or name not in self.registry.names():  # generative, or unloaded: as is
                continue
            target = self._target_versions(self.served[name], model_plan)
            loaded = set(self.registry.versions(name))
            for version in sorted(target - loaded):
                if model_plan.variant is not None and model_plan.variant.version == version:
                    loads.append(model_plan.variant)
                else:  # a configured version, coming back as the variant goes
                    served = self.served[name]
                    try:
                        loads.append(version_on_disk(served.repository, served.config, version))
                    except UnknownModelError as exc:
                        raise PolicyRefused(f"models[{name!r}]: cannot load v{version} again: {exc}") from None
            unloads += [(name, version) for version in sorted(loaded - target)]
        return loads, unloads

    def _engine_switches(self, plan: Plan) -> list[tuple[str, int]]:
        """The decoders whose served version changes: (name, the version to load)."""
        switches = []
        for name, decoder in self.decoders.items():
            pool = self.engines.get(name)
            model_plan = plan.models.get(name)
            if pool is None or model_plan is None:
                continue
            target = decoder.default_version if model_plan.decoder_variant is None else model_plan.decoder_variant
            if _version_number(pool.version) != target:
                if self._load_engine is None:
                    raise PolicyRefused(f"models[{name!r}].variant: this agent cannot load decoder versions")
                switches.append((name, target))
        return switches

    async def _load_engines(self, switches: list[tuple[str, int]]) -> dict[str, EnginePool]:
        """Each decoder version's pool, loaded off the event loop; a failure closes what was loaded and refuses."""
        loaded: dict[str, EnginePool] = {}
        load = self._load_engine
        try:
            for name, version in switches:
                assert load is not None  # _engine_switches refuses a switch without it
                self.transitions[name] = f"loading v{version}"
                await self._retired(name)
                try:
                    loaded[name] = await asyncio.to_thread(load, name, version)
                except Exception as exc:  # the memory check, a bad graph or config: all refuse the document
                    raise PolicyRefused(f"models[{name!r}]: cannot load v{version}: {exc}") from None
        except PolicyRefused:
            await asyncio.gather(*(asyncio.to_thread(pool.close) for pool in loaded.values()))
            raise
        finally:
            for name, _ in switches:
                self.transitions.pop(name, None)
        return loaded

    async def _retired(self, name: str) -> None:
        """Wait (at most RETIRED_WAIT_S) until no pool of `name` is still finishing its streams after a switch: it
        holds its memory until it closes, and a switch back soon after a switch would otherwise load a third copy
        beside it, which a device sized for one is refused for memory (then the document is retried a minute later)."""
        deadline = time.monotonic() + RETIRED_WAIT_S
        while any(pool.name == name for pool in self.retiring_engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _load_all(self, versions: list[ModelVersion]) -> list[LoadedModel]:
        loaded: list[LoadedModel] = []
        try:
            for version in versions:
                name = version.config.name
                self.transitions[name] = f"loading v{version.version}"
                try:
                    await asyncio.to_thread(self._check_fits, version)
                    loaded.append(await asyncio.to_thread(self._load, version))
                except Exception as exc:  # a memory check, a bad graph, a runner error: all refuse the document
                    raise PolicyRefused(f"models[{name!r}]: cannot load v{version.version}: {exc}") from None
        except PolicyRefused:
            await asyncio.gather(*(asyncio.to_thread(m.worker.close) for m in loaded))
            raise
        finally:
            for version in versions:
                self.transitions.pop(version.config.name, None)
        return loaded

    def _commit(self, plan: Plan, loaded: list[LoadedModel], unloads: list[tuple[str, int]], etag: str | None,
                engines: Mapping[str, EnginePool] | None = None) -> None:  # fmt: skip
        """Everything that changes routing and admission, in one step on the event loop."""
        weights = None
        if self.tenants is not None:  # (its callbacks give the running workers and pools the new weights)
            self.tenants.apply(None if plan.document is None else plan.document.tenants)
            weights = self.tenants.weights()
        for model in loaded:
            if weights is not None:
                model.worker.set_weights(weights)
            self.registry.add(model)
            if self.telemetry is not None:
                self.telemetry.attach(model)
        for name, model_plan in plan.models.items():
            if name in self.served and name in self.registry.names():
                self._serve_as_planned(name, model_plan)
        for name, pool in (engines or {}).items():
            if weights is not None:
                pool.set_weights(weights)
            old = self.engines[name]
            if self.telemetry is not None:  # (it puts `pool` in its dict, the same one, under its collection lock)
                self.telemetry.engine_swapped(name, pool, old)
            self.engines[name] = pool  # in place: the APIs read this dict, so the next stream goes to `pool`
            self.retiring_engines.append(old)
            self._background(self._retire_engine(old))
            log.info("%s: new streams go to v%s; v%s finishes its %d stream(s), then unloads", name, pool.version,
                     old.version, old.active)  # fmt: skip
        for name, pool in self.engines.items():
            limits = plan.models.get(name)
            if limits is not None:
                pool.limit(limits.max_num_seqs, limits.max_num_batched_tokens)
        self.plan = plan
        self.etag = etag
        self.applied_at = self._clock()
        for name, version in unloads:
            retired = self.registry.retire(name, version)
            self._background(self._unload(retired))

    def _serve_as_planned(self, name: str, plan: ModelPlan) -> None:
        """Route a V2 model to the plan's variant (loaded already) and retune its batching."""
        self.registry.set_variant(name, None if plan.variant is None else plan.variant.version)
        delay = plan.max_queue_delay_us
        for model in self.registry.of(name):
            model.worker.retune(max_queue_delay_s=None if delay is None else delay / 1e6,
                                preferred_batch_sizes=plan.preferred_batch_sizes)  # fmt: skip

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire_engine(self, pool: EnginePool) -> None:
        """Close a decoder pool switched away from once its streams (running and waiting) have ended."""
        try:
            await pool.drain()
            await asyncio.to_thread(pool.close)
            if self.registry.memory is not None:
                self.registry.memory.release(pool)
            log.info("unloaded %s v%s", pool.name, pool.version)
        finally:
            self.retiring_engines.remove(pool)
            if self.telemetry is not None:
                self.telemetry.engine_retired(pool)

    async def _unload(self, model: LoadedModel) -> None:
        """Close a version once everything it had queued or running has been answered."""
        try:
            await model.worker.drain()
            await asyncio.to_thread(model.worker.close)
            log.info("unloaded %s v%d", model.config.name, model.version)
        finally:
            self.registry.retired(model)

    async def close(self) -> None:
        """Stop applying (the agent is draining); unloads under way still finish their queues."""
        self.closing = True
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    # ---- status ------------------------------------------------------------------------------

    def json(self) -> dict[str, Any]:
        document = self.plan.document
        models: dict[str, Any] = {}
        for name in sorted(set(self.served) & set(self.registry.names())):  # (not those unloaded meanwhile)
            plan = self.plan.models.get(name)
            first = next(iter(self.registry.of(name)), None)
            batching = None
            if first is not None and self.served[name].config.dynamic_batching is not None:
                config = first.worker.scheduler.config
                batching = {
                    "max_queue_delay_us": round(config.max_queue_delay_s * 1e6),
                    "preferred_batch_sizes": list(config.preferred_batch_sizes),
                    "from_policy": plan is not None
                    and (plan.max_queue_delay_us is not None or plan.preferred_batch_sizes is not None),
                }
            default = self.registry.default_version(name)
            variant = self.registry.variant(name)
            models[name] = {
                "default_version": default,
                "served_version": default if variant is None else variant,
                "variant": variant,
                "loaded_versions": self.registry.versions(name),
                "retiring_versions": sorted(m.version for m in self.registry.retiring if m.config.name == name),
                "transition": self.transitions.get(name),
                "batching": batching,
                "shed": None if plan is None else plan.json()["shed"],
                "fallback": None if plan is None else plan.json()["fallback"],
            }
        return {
            "policy": {
                "version": self.plan.version,
                "source": self.plan.source,
                "etag": self.etag,
                "agent": None if document is None else document.agent,
                "applied_at": None if self.applied_at is None else isoformat_utc(self.applied_at),
                "causes": [] if document is None else [c.model_dump(mode="json") for c in document.causes],
            },
            "refusals": self.refusals,
            "last_refusal": None if self.last_refusal is None else self.last_refusal.json(),
            "policy_cache": None if self.cache is None else self._cache_json(),
            "models": models,
        }

    def generative_json(self) -> dict[str, Any]:
        """Per generative model: its engine's state (EnginePool.json), the version it serves and those still
        finishing their streams, and the effective limits (the configured ones, or lower under the policy)."""
        models: dict[str, Any] = {}
        for name in sorted(self.engines):
            pool = self.engines[name]
            plan = self.plan.models.get(name)
            decoder = self.decoders.get(name)
            served = _version_number(pool.version)
            default = served if decoder is None else decoder.default_version
            retiring = sorted(_version_number(old.version) for old in self.retiring_engines if old.name == name)
            models[name] = {
                **pool.json(),
                "default_version": default,
                "served_version": served,
                "variant": None if served == default else served,
                "retiring_versions": retiring,
                "transition": self.transitions.get(name),
                "limits": {
                    "max_num_seqs": pool.max_num_seqs,
                    "max_num_batched_tokens": pool.max_num_batched_tokens,
                    "max_tokens_cap": None if plan is None else plan.max_tokens_cap,
                },
                "configured_limits": {
                    "max_num_seqs": pool.configured_max_num_seqs,
                    "max_num_batched_tokens": pool.configured_max_num_batched_tokens,
                },
                "fallback_text_configured": pool.fallback_text is not None,
                "shed": None if plan is None else plan.json()["shed"],
                "fallback": None if plan is None else plan.json()["fallback"],
                "overflow": None if plan is None else plan.json()["overflow"],
            }
        return models

    def _cache_json(self) -> dict[str, Any]:
        assert self.cache is not None
        behind = self._cache_behind
        return {
            "path": str(self.cache.path),
            "version": self.cached_version,
            "behind": behind is not None,
            "pending_version": None if behind is None else behind.document.version,
            "consecutive_failures": self.cache_writes.failures,
            "last_error": self.cache_writes.last_error,
        }


def _version_number(version: str) -> int:
    """A decoder pool's version (its directory's name) as a number; 0 for one that is not numbered."""
    return int(version) if version.isdigit() else 0


def isoformat_utc(seconds: float) -> str:
    """Wall-clock seconds as an ISO 8601 time in UTC, for status reports."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="milliseconds")
