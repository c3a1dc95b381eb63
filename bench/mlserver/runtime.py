"""A small onnxruntime runtime for MLServer, the batching peer in `bench/batching.py`.

MLServer's adaptive batcher (max_batch_size / max_batch_time in model-settings.json) merges requests before
`predict`; `predict` runs the merged batch with one `session.run` on a one-thread executor, so the event loop
keeps accepting requests (and forming the next batch) while onnxruntime computes. Session options are the
agent's (sequential, full graph optimisation, no spinning); `parameters.extra` sets:

- `intra_op_threads`: onnxruntime's intra-op threads (default 1);
- `stats_file`: when set, "executions rows" is written there after every batch, for the mean batch size.

Runs inside MLServer's own virtual environment (bench/.mlserver-venv), not the project's.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntimeModel(MLModel):
    async def load(self) -> bool:
        parameters = self.settings.parameters
        assert parameters is not None and parameters.uri, "model-settings.json needs parameters.uri"
        extra = parameters.extra or {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(extra.get("intra_op_threads", 1))
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self._session = ort.InferenceSession(parameters.uri, options, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ort")
        self._executions = 0
        self._rows = 0
        stats_file = extra.get("stats_file")
        self._stats_fd = os.open(stats_file, os.O_WRONLY | os.O_CREAT, 0o644) if stats_file else None
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self._session.run, None, feeds)
        rows = next(iter(feeds.values())).shape[0]
        self._executions += 1
        self._rows += rows
        if self._stats_fd is not None:
            os.pwrite(self._stats_fd, f"{self._executions} {self._rows}\n".ljust(40).encode(), 0)
        pairs = zip(self._outputs, results, strict=True)
        outputs = [NumpyCodec.encode_output(name, np.asarray(r)) for name, r in pairs]
        return InferenceResponse(model_name=self.name, model_version=self.version, outputs=outputs)
