"""Load a model repository in Triton's layout and check every served version's graph against its config.

`<root>/<model>/config.pbtxt|config.yaml` and `<root>/<model>/<version>/model.onnx|model.plan`. A config that
disagrees with its graph is refused at load, naming the files, the tensor and the field, instead of failing
the first request.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.errors import AgentError
from edge_agent.runtime.config import (
    CONFIG_FILENAMES,
    DECODER_PLATFORM,
    MODEL_FILENAMES,
    ModelConfigError,
    load_model_config,
)
from spillway.contract.spec import ModelConfig, ModelVersion, TensorSpec, VersionPolicy

_VERSION_DIR = re.compile(r"[0-9]+")

# onnx.TensorProto.DataType value -> V2 datatype
_ONNX_DATATYPES = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    4: "UINT16",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    8: "BYTES",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
    12: "UINT32",
    13: "UINT64",
    16: "BF16",
}


class UnknownModelError(AgentError, LookupError):
    """No served model (or version) by that name: the API answers 404."""

    status = 404
    reason = "unknown_model"


@dataclass(frozen=True)
class Repository:
    """The served versions of every model, newest last."""

    root: Path
    models: Mapping[str, tuple[ModelVersion, ...]]

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        """One served version of `name`; the newest when `version` is None."""
        versions = self.models.get(name)
        if not versions:
            raise UnknownModelError(f"unknown model {name!r}")
        if version is None:
            return versions[-1]
        for candidate in versions:
            if candidate.version == version:
                return candidate
        served = ", ".join(str(v.version) for v in versions)
        raise UnknownModelError(f"model {name!r} has no served version {version} (served: {served})")

    def __iter__(self) -> Iterator[ModelVersion]:
        for versions in self.models.values():
            yield from versions


def load_repository(root: Path) -> Repository:
    """Load every model directory under `root` (hidden ones skipped); one bad model refuses the whole load."""
    if not root.is_dir():
        raise ModelConfigError(f"{root}: the model repository is not a directory")
    models = {model_dir.name: load_model(model_dir) for model_dir in model_dirs(root) if not is_generative(model_dir)}
    return Repository(root=root, models=models)


def model_dirs(root: Path) -> list[Path]:
    """The model directories of a repository: its sub-directories, hidden ones and `__pycache__` aside."""
    return [d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".") and d.name != "__pycache__"]


def is_generative(model_dir: Path) -> bool:
    """A generative model: its config says `platform: "onnxruntime_decoder"`, or it has no config and its versions
    hold `genai_config.json` (served with the agent's `generation` settings)."""
    if any((model_dir / name).exists() for name in CONFIG_FILENAMES):
        return load_model_config(model_dir).platform == DECODER_PLATFORM
    return any((v / "genai_config.json").is_file() for v in model_dir.iterdir() if _VERSION_DIR.fullmatch(v.name))


@dataclass(frozen=True)
class GenerativeModel:
    """A generative model to serve: the directory of the newest version its config's version policy serves (the
    newest holding `genai_config.json` without a config), and its model config when it has one."""

    folder: Path
    config: ModelConfig | None


def generative_models(root: Path) -> dict[str, GenerativeModel]:
    """The generative models of a repository by name (ModelConfigError naming a version without its files)."""
    found = {}
    for model_dir in model_dirs(root) if root.is_dir() else []:
        if not is_generative(model_dir):
            continue
        config = load_model_config(model_dir) if any((model_dir / n).exists() for n in CONFIG_FILENAMES) else None
        versions = sorted((v for v in model_dir.iterdir() if v.is_dir() and _VERSION_DIR.fullmatch(v.name)
                           and (config is not None or (v / "genai_config.json").is_file())),
                          key=lambda v: int(v.name))  # fmt: skip
        if not versions:
            raise ModelConfigError(f"{model_dir}: no version directory (e.g. {model_dir}/1/)")
        if config is not None:  # the newest of the versions its policy serves (one engine a model, for now)
            chosen = _select(config.version_policy, [int(v.name) for v in versions], config.source)
            versions = [v for v in versions if int(v.name) in chosen]
        newest = versions[-1]
        if not (newest / "genai_config.json").is_file():
            raise ModelConfigError(f"{newest / 'genai_config.json'}: missing or not a file (platform "
                                   f"{DECODER_PLATFORM!r} needs it in the served version)")  # fmt: skip
        found[model_dir.name] = GenerativeModel(newest, config)
    return found


def load_model(model_dir: Path) -> tuple[ModelVersion, ...]:
    """The versions of one model that its version policy serves, each checked against the config."""
    config = load_model_config(model_dir)
    available = sorted(
        int(entry.name) for entry in model_dir.iterdir() if entry.is_dir() and _VERSION_DIR.fullmatch(entry.name)
    )
    if not available:
        raise ModelConfigError(f"{model_dir}: no version directories (numeric names such as {model_dir / '1'})")
    served = _select(config.version_policy, available, config.source)
    versions = tuple(ModelVersion(config, v, _model_file(config, model_dir / str(v))) for v in served)
    for version in versions:
        if version.path.name == "model.onnx":
            check_onnx_graph(config, version.path)
    return versions


def version_on_disk(root: Path, config: ModelConfig, version: int) -> ModelVersion:
    """Any version of a loaded model that its directory holds, served by the version policy or not (a variant).

    Uses the config the model was loaded with. Raises UnknownModelError when the directory or its model file is
    missing; the graph is checked separately (`check_onnx_graph`), when the version is loaded.
    """
    model_dir = root / config.name
    version_dir = model_dir / str(version)
    if not version_dir.is_dir():
        entries = list(model_dir.iterdir()) if model_dir.is_dir() else []
        on_disk = sorted(int(e.name) for e in entries if e.is_dir() and _VERSION_DIR.fullmatch(e.name))
        raise UnknownModelError(f"model {config.name!r} has no version {version} in {root} (it has: {on_disk})")
    try:
        path = _model_file(config, version_dir)
    except ModelConfigError as exc:
        raise UnknownModelError(str(exc)) from None
    return ModelVersion(config, version, path)


def _select(policy: VersionPolicy, available: list[int], source: Path) -> list[int]:
    if policy.kind == "all":
        return available
    if policy.kind == "latest":
        return available[-policy.latest_n :]
    missing = sorted(set(policy.versions) - set(available))
    if missing:
        raise ModelConfigError(
            f"{source}: field 'version_policy.specific.versions': version(s) {missing} have no directory "
            f"(available: {available})"
        )
    return [v for v in available if v in policy.versions]


def _model_file(config: ModelConfig, version_dir: Path) -> Path:
    expected = version_dir / MODEL_FILENAMES[config.platform]
    if expected.is_file():
        return expected
    others = [name for name in MODEL_FILENAMES.values() if name != expected.name and (version_dir / name).exists()]
    if others:
        raise ModelConfigError(
            f"{config.source}: field 'platform': {config.platform!r} loads {expected.name}, but {version_dir} "
            f"holds {others[0]}"
        )
    raise ModelConfigError(
        f"{expected}: missing or not a file (platform {config.platform!r} needs it in every served version)"
    )


def check_onnx_graph(config: ModelConfig, path: Path) -> None:
    """Refuse a config whose inputs or outputs disagree with the ONNX graph in `path` (names, dtypes, dims)."""
    import onnx  # deferred: only loading a repository needs it

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError and friends: any of them means "not a model"
        raise ModelConfigError(f"{path}: not a readable ONNX model: {exc}") from exc
    initializers = {tensor.name for tensor in graph.initializer}
    graph_inputs = {value.name: value for value in graph.input if value.name not in initializers}
    graph_outputs = {value.name: value for value in graph.output}
    _check_tensors(config, path, "input", config.inputs, graph_inputs)
    _check_tensors(config, path, "output", config.outputs, graph_outputs)
    extra = sorted(set(graph_inputs) - {spec.name for spec in config.inputs})
    if extra:
        raise ModelConfigError(f"{config.source}: field 'input': the graph in {path} also needs input(s) {extra}")


def _check_tensors(
    config: ModelConfig, path: Path, field: str, specs: tuple[TensorSpec, ...], graph: Mapping[str, Any]
) -> None:
    for spec in specs:
        where = f"{config.source}: {field} {spec.name!r}"
        value = graph.get(spec.name)
        if value is None:
            raise ModelConfigError(f"{where}: field 'name': the graph in {path} has no such {field} ({sorted(graph)})")
        tensor_type = value.type.tensor_type
        datatype = _ONNX_DATATYPES.get(tensor_type.elem_type, f"ONNX type {tensor_type.elem_type}")
        if datatype != spec.datatype:
            raise ModelConfigError(f"{where}: field 'data_type': {spec.datatype} in the config, {datatype} in {path}")
        if not tensor_type.HasField("shape"):
            continue  # the graph leaves the shape open: nothing more to compare
        dims = [dim.dim_value if dim.HasField("dim_value") else -1 for dim in tensor_type.shape.dim]
        batching = config.max_batch_size > 0
        expected_rank = len(spec.shape) + (1 if batching else 0)
        if len(dims) != expected_rank:
            batch_note = " plus the batch dimension" if batching else ""
            raise ModelConfigError(
                f"{where}: field 'dims': {list(spec.shape)}{batch_note} is rank {expected_rank}, "
                f"but the graph in {path} has rank {len(dims)} ({dims})"
            )
        if batching:
            if dims[0] != -1:
                raise ModelConfigError(
                    f"{where}: field 'max_batch_size': {config.max_batch_size} needs a variable first dimension, "
                    f"but the graph in {path} fixes it to {dims[0]}"
                )
            dims = dims[1:]
        for configured, actual in zip(spec.shape, dims, strict=True):
            if actual != -1 and configured != actual:
                raise ModelConfigError(
                    f"{where}: field 'dims': {list(spec.shape)} in the config, {dims} in the graph in {path}"
                )
