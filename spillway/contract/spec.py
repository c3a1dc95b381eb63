"""What a loaded model is: its config (Triton's model config, normalised) and one version's file.

These frozen dataclasses are the contract between the repository loader, the runners, the scheduler and
the HTTP API; nothing here imports onnxruntime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

V2_DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                "FP16", "FP32", "FP64", "BYTES", "BF16")  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    """One input or output. `shape` excludes the batch dimension when the model batches; -1 is dynamic."""

    name: str
    datatype: str  # a V2 datatype from V2_DATATYPES
    shape: tuple[int, ...]


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy: per priority level."""

    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    default_timeout_us: int = 0  # 0: no deadline unless the request sets `timeout`
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded (Triton's meaning); the agent applies its own cap on top


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's ModelDynamicBatching, with Triton's meanings (priority 1 is the highest)."""

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    priority_levels: int = 0  # 0: a single level
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: Mapping[int, QueuePolicy] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions to serve: the latest N, all, or specific ones (Triton's ModelVersionPolicy)."""

    kind: Literal["latest", "all", "specific"] = "latest"
    latest_n: int = 1
    versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str  # "onnxruntime_onnx", "onnxruntime_decoder" (generative), "tensorrt_plan" (refused by the runner)
    max_batch_size: int  # 0: the model does not batch; shapes then include every dimension
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dynamic_batching: DynamicBatching | None
    instance_count: int
    version_policy: VersionPolicy
    source: Path  # the config file, for error messages
    parameters: Mapping[str, str] = field(default_factory=dict)  # Triton's `parameters`, their string values


@dataclass(frozen=True)
class ModelVersion:
    config: ModelConfig
    version: int
    path: Path  # <repo>/<model>/<version>/model.onnx
