"""The naive peer for `batching.py`: FastAPI + onnxruntime on uvicorn, one `session.run` per request, no batching.

It speaks the V2 (KServe) JSON protocol for one ONNX model: POST /v2/models/{name}[/versions/{v}]/infer with a
JSON body of `inputs` ({name, shape, datatype, data}); the answer carries every output as JSON `data`. It is
naive only about scheduling: each request runs on its own in Starlette's thread pool (anyio's default of 40
threads), while JSON is parsed and written with orjson (the agent uses orjson to parse too), so what it lacks
against the agent is batching, not a fast codec.

    python bench/naive_server.py --model mlp/1/model.onnx --port 8002 --intra-op-threads 1
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "FP16": np.float16}
_V2 = {np.dtype(v): k for k, v in _DTYPES.items()}


def session_options(intra_op_threads: int) -> ort.SessionOptions:
    """The agent's settings (edge_agent/runtime/runner.py): sequential, full graph optimisation, no spinning."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def build_app(model_path: str, intra_op_threads: int) -> FastAPI:
    session = ort.InferenceSession(model_path, session_options(intra_op_threads), providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    async def infer(request: Request, name: str, version: str | None = None) -> Response:
        try:
            doc = orjson.loads(await request.body())
            feeds = {}
            for tensor in doc["inputs"]:
                dtype = _DTYPES[tensor["datatype"]]
                feeds[tensor["name"]] = np.asarray(tensor["data"], dtype=dtype).reshape(tensor["shape"])
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            return Response(orjson.dumps({"error": f"bad request: {exc}"}), status_code=400)
        results = await run_in_threadpool(session.run, None, feeds)
        outputs: list[dict[str, Any]] = [
            {"name": n, "datatype": _V2[r.dtype], "shape": list(r.shape), "data": r.ravel()}
            for n, r in zip(output_names, results, strict=True)
        ]
        body = {"model_name": name, "model_version": version or "1", "outputs": outputs}
        return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    app.add_api_route("/v2/models/{name}/infer", infer, methods=["POST"])
    app.add_api_route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"])
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="path to model.onnx")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    args = parser.parse_args()
    app = build_app(args.model, args.intra_op_threads)
    # The agent's uvicorn options (edge_agent/serving/server.py): uvloop and httptools when installed.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, server_header=False)


if __name__ == "__main__":
    main()
