"""Model repository (Triton layout), onnxruntime runner, warm-up compute profiles and the GPU memory check.

Importing this package does not import onnxruntime; building an `OrtRunner` does.
"""

from __future__ import annotations

from edge_agent.runtime.config import ModelConfigError, load_model_config
from edge_agent.runtime.gpu import GpuMemoryError, check_fits, free_gpu_memory
from edge_agent.runtime.memory import HostMemoryError, available_host_memory, check_load_fits
from edge_agent.runtime.profile import ComputeProfile, warmup_batch_sizes
from edge_agent.runtime.repository import (
    Repository,
    UnknownModelError,
    load_model,
    load_repository,
    version_on_disk,
)
from edge_agent.runtime.runner import NUMPY_DTYPES, OrtRunner, RunnerError, choose_providers
from spillway.contract.spec import (
    V2_DATATYPES,
    DynamicBatching,
    ModelConfig,
    ModelVersion,
    QueuePolicy,
    TensorSpec,
    VersionPolicy,
)

__all__ = [
    "NUMPY_DTYPES",
    "V2_DATATYPES",
    "ComputeProfile",
    "DynamicBatching",
    "GpuMemoryError",
    "HostMemoryError",
    "ModelConfig",
    "ModelConfigError",
    "ModelVersion",
    "OrtRunner",
    "QueuePolicy",
    "Repository",
    "RunnerError",
    "TensorSpec",
    "UnknownModelError",
    "VersionPolicy",
    "available_host_memory",
    "check_fits",
    "check_load_fits",
    "choose_providers",
    "free_gpu_memory",
    "load_model",
    "load_model_config",
    "load_repository",
    "version_on_disk",
    "warmup_batch_sizes",
]
