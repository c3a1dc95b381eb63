"""What a policy document means for the models this agent serves, checked against them before anything changes.

`build_plan` turns a document (schema-valid already) into one `ModelPlan` per served model, or raises
`PolicyRefused` naming what does not fit: a variant the repository does not have, batching sizes the model
cannot take, default outputs that are not the model's outputs. A refused document changes nothing.

Entries for models the agent does not serve are ignored (a fleet-wide rule may name models some agents lack).
Batching fields are ignored for models without dynamic batching when they come from the `*` entry, and refused
when the model's own entry sets them. Where shed and fallback both cover a priority level, the fallback answers.

Generative models (decoders, `ServedDecoder`) take part too: their variant must be a decoder version on disk, a
fallback `default` answers with `default_text` and a V2 model's with `default_outputs` (the other kind is refused,
but where the `*` entry gives both, for an agent serving both kinds, each model takes its own), and
their limits (`max_tokens_cap`, `max_num_seqs`, `max_num_batched_tokens`) go into the plan as given: the engines
clamp them to what is configured. The generative fields are ignored for V2 models, and V2 batching fields for
decoders when they come from `*` (refused in a decoder's own entry).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edge_agent.errors import AgentError
from edge_agent.runtime.repository import UnknownModelError, version_on_disk
from spillway.contract.policy import Fallback, Overflow, PolicyDocument, Shed
from spillway.contract.spec import ModelConfig, ModelVersion
from spillway.contract.v2 import TensorError, decode_json_tensor

Source = Literal["control_plane", "cache", "local"]
Admission = Literal["serve", "overflow", "shed", "fallback"]


class PolicyRefused(AgentError, ValueError):
    """A policy document the agent will not apply; the message says why. The last good policy stays."""


@dataclass(frozen=True)
class ServedModel:
    """What a model's policy is checked against: its config, default version and the versions its config serves."""

    config: ModelConfig
    default_version: int
    configured_versions: tuple[int, ...]
    repository: Path
    overflow: Overflow | None = None  # the agent's own setting, where no document says otherwise


@dataclass(frozen=True)
class ServedDecoder:
    """What a generative model's policy is checked against: where its versions are and which one serves by default."""

    folder: Path  # the model's directory in the repository: <repo>/<name>, its versions under it
    default_version: int
    overflow: Overflow | None = None  # the agent's own setting, where no document says otherwise

    def versions_on_disk(self) -> list[int]:
        """The decoder versions on disk: numbered directories holding `genai_config.json`."""
        if not self.folder.is_dir():
            return []
        return sorted(int(d.name) for d in self.folder.iterdir()
                      if d.name.isdigit() and (d / "genai_config.json").is_file())  # fmt: skip


@dataclass(frozen=True)
class ModelPlan:
    """One model's effective policy. Batching fields are None where the model's configuration applies."""

    name: str
    variant: ModelVersion | None = None  # served in place of the default version
    max_queue_delay_us: int | None = None
    preferred_batch_sizes: tuple[int, ...] | None = None
    shed: Shed | None = None
    fallback: Fallback | None = None
    default_outputs: Mapping[str, np.ndarray] | None = None  # mode `default`: one row (unit) per output
    overflow: Overflow | None = None  # None: never sent to the gateway
    # Generative models: the engine's limits for new streams (None: as configured).
    max_tokens_cap: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    decoder_variant: int | None = None  # generative models: the decoder version served in place of the default

    @property
    def default_text(self) -> str | None:
        """A generative model's fallback answer in mode `default` (None: the model config's `fallback_text`)."""
        if self.fallback is None or self.fallback.mode != "default":
            return None
        return self.fallback.default_text

    def admission(self, level: int, draw: float = 1.0) -> Admission:
        """What happens to a request at priority level `level` (1 highest) on arrival; `draw` is uniform in [0, 1)
        and decides the overflow `fraction`. `serve` with overflow on still overflows a predicted deadline miss."""
        if self.fallback is not None and level >= self.fallback.at_or_below:
            return "fallback"
        if self.shed is not None and level >= self.shed.at_or_below:
            return "shed"
        overflow = self.overflow
        if overflow is not None and (
            (overflow.at_or_below is not None and level >= overflow.at_or_below) or draw < overflow.fraction
        ):
            return "overflow"
        return "serve"

    def json(self) -> dict[str, Any]:
        fallback = None
        if self.fallback is not None:
            fallback = {"at_or_below": self.fallback.at_or_below, "mode": self.fallback.mode}
        variant = self.decoder_variant if self.variant is None else self.variant.version
        return {
            "variant": variant,
            "overflow": None if self.overflow is None else self.overflow.model_dump(),
            "shed": None if self.shed is None else self.shed.model_dump(),
            "fallback": fallback,
            "max_tokens_cap": self.max_tokens_cap,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


@dataclass(frozen=True)
class Plan:
    """A whole document as this agent applies it (or the local configuration: no document)."""

    source: Source = "local"
    document: PolicyDocument | None = None
    models: Mapping[str, ModelPlan] = field(default_factory=dict)

    @property
    def version(self) -> int | None:
        return None if self.document is None else self.document.version

    @property
    def latency_buckets_ms(self) -> list[float] | None:
        return None if self.document is None else self.document.latency_buckets_ms

    @property
    def export_interval_s(self) -> float | None:
        return None if self.document is None else self.document.export_interval_s

    @property
    def poll_interval_s(self) -> float | None:
        return None if self.document is None else self.document.poll_interval_s


def local_plan(served: Mapping[str, ServedModel], decoders: Mapping[str, ServedDecoder] | None = None) -> Plan:
    """The agent as configured, with no policy document."""
    everything: dict[str, ServedModel | ServedDecoder] = {**served, **(decoders or {})}
    return Plan(models={name: ModelPlan(name, overflow=model.overflow) for name, model in everything.items()})


def build_plan(document: PolicyDocument, source: Source, served: Mapping[str, ServedModel],
               decoders: Mapping[str, ServedDecoder] | None = None) -> Plan:  # fmt: skip
    """Check `document` against the served models (V2 `served`, generative `decoders`); raises PolicyRefused naming
    the model and the field."""
    models: dict[str, ModelPlan] = {}
    for name, decoder in (decoders or {}).items():
        models[name] = _decoder_plan(document, name, decoder)
    for name, model in served.items():
        policy = document.for_model(name)
        own = document.models.get(name)
        where = f"models[{name!r}]"
        variant = None
        if policy.variant is not None and policy.variant != model.default_version:
            try:
                variant = version_on_disk(model.repository, model.config, policy.variant)
            except UnknownModelError as exc:
                raise PolicyRefused(f"{where}.variant: {exc}") from None
        delay, preferred = _batching(name, model.config, policy.max_queue_delay_us, policy.preferred_batch_sizes,
                                     explicit=own is not None)  # fmt: skip
        defaults = None
        if policy.fallback is not None and policy.fallback.mode == "default":
            if policy.fallback.default_text is not None and (
                not policy.fallback.default_outputs or (own is not None and own.fallback is not None)
            ):
                raise PolicyRefused(f"{where}.fallback.default_text: {name!r} is a V2 model: mode 'default' answers "
                                    "with default_outputs (tensors), not text")  # fmt: skip
            defaults = validate_default_outputs(
                f"{where}.fallback", model.config, policy.fallback.default_outputs or []
            )
        overflow = policy.overflow if policy.overflow is not None else model.overflow
        models[name] = ModelPlan(name, variant, delay, preferred, policy.shed, policy.fallback, defaults, overflow,
                                 policy.max_tokens_cap, policy.max_num_seqs, policy.max_num_batched_tokens)  # fmt: skip
    return Plan(source, document, models)


def _decoder_plan(document: PolicyDocument, name: str, decoder: ServedDecoder) -> ModelPlan:
    policy = document.for_model(name)
    own = document.models.get(name)
    where = f"models[{name!r}]"
    if own is not None and (own.max_queue_delay_us is not None or own.preferred_batch_sizes is not None):
        raise PolicyRefused(f"{where}: max_queue_delay_us/preferred_batch_sizes: {name!r} is a generative model; "
                            "its engine's limits are max_num_seqs and max_num_batched_tokens")  # fmt: skip
    variant = None
    if policy.variant is not None and policy.variant != decoder.default_version:
        on_disk = decoder.versions_on_disk()
        if policy.variant not in on_disk:
            raise PolicyRefused(f"{where}.variant: the decoder {name!r} has no version {policy.variant} on disk "
                                f"(it has: {on_disk}; a version is a directory holding genai_config.json)")  # fmt: skip
        variant = policy.variant
    fallback = policy.fallback
    if (fallback is not None and fallback.mode == "default" and fallback.default_outputs
            and (not fallback.default_text or (own is not None and own.fallback is not None))):  # fmt: skip
        # (The `*` entry may give both kinds, for an agent serving both: each model takes its own.)
        raise PolicyRefused(f"{where}.fallback.default_outputs: {name!r} is a generative model: mode 'default' "
                            "answers with default_text, not V2 output tensors")  # fmt: skip
    overflow = policy.overflow if policy.overflow is not None else decoder.overflow
    return ModelPlan(name, shed=policy.shed, fallback=fallback, overflow=overflow,
                     max_tokens_cap=policy.max_tokens_cap, max_num_seqs=policy.max_num_seqs,
                     max_num_batched_tokens=policy.max_num_batched_tokens, decoder_variant=variant)  # fmt: skip


def _batching(
    name: str, config: ModelConfig, delay_us: int | None, preferred: list[int] | None, *, explicit: bool
) -> tuple[int | None, tuple[int, ...] | None]:
    if delay_us is None and preferred is None:
        return None, None
    if config.dynamic_batching is None or config.max_batch_size < 1:
        if explicit:
            raise PolicyRefused(
                f"models[{name!r}]: max_queue_delay_us/preferred_batch_sizes: the model has no dynamic batching to tune"
            )
        return None, None
    if preferred is not None:
        too_big = [size for size in preferred if size > config.max_batch_size]
        if too_big:
            raise PolicyRefused(
                f"models[{name!r}].preferred_batch_sizes: {too_big} exceed the model's max_batch_size "
                f"({config.max_batch_size})"
            )
    return delay_us, None if preferred is None else tuple(sorted(set(preferred)))


def validate_default_outputs(where: str, config: ModelConfig, raw: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The default outputs as arrays of one row each (the whole tensor for a model that does not batch);
    PolicyRefused names what does not fit the model (`where` prefixes the message)."""
    specs = {spec.name: spec for spec in config.outputs}
    batching = config.max_batch_size > 0
    found: dict[str, np.ndarray] = {}
    for index, item in enumerate(raw):
        label = f"{where}.default_outputs[{index}]"
        try:
            tensor = decode_json_tensor(item, index, kind="default output")
        except TensorError as exc:
            raise PolicyRefused(f"{label}: {exc}") from None
        spec = specs.get(tensor.name)
        if spec is None:
            raise PolicyRefused(f"{label}: the model has no output {tensor.name!r} (it has: {sorted(specs)})")
        if tensor.name in found:
            raise PolicyRefused(f"{label}: output {tensor.name!r} is given twice")
        if tensor.datatype != spec.datatype:
            raise PolicyRefused(f"{label}: output {tensor.name!r} is {spec.datatype}, not {tensor.datatype}")
        array = tensor.array
        if batching and len(array.shape) == len(spec.shape) + 1 and array.shape[0] == 1:
            array = array[0]  # given as a batch of one row
        if len(array.shape) != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)
        ):
            shapes = f"{list(spec.shape)}" + (f" or {[1, *spec.shape]}" if batching else "")
            raise PolicyRefused(f"{label}: output {tensor.name!r} needs shape {shapes}, got {list(tensor.shape)}")
        found[tensor.name] = array
    missing = sorted(set(specs) - set(found))
    if missing:
        raise PolicyRefused(f"{where}.default_outputs: output(s) {missing} of the model are missing")
    return found
