"""Triton's generate extension on ModelStreamInfer (grpc_server.py): a request for a generative model as the
extension's JSON body, its server-sent events read back, and each event as one `ModelStreamInferResponse`, the last
one with `triton_final_response: true`, as Triton's decoupled LLM backends (vLLM, TensorRT-LLM) answer.

Needs grpcio (tritonclient's messages); imported only when gRPC serves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from tritonclient.grpc import service_pb2

from spillway.contract import names
from spillway.contract.grpc_codec import infer_request_to_v2, set_parameters
from spillway.contract.v2 import TensorError, decode_request

__all__ = ["event_error", "generate_body", "generated", "sse_events"]

# Request parameters of Triton's own that mean nothing to the generate extension.
_TRITON_ONLY = frozenset({"sequence_id", "sequence_start", "sequence_end", "headers", "binary_data_output"})
# Inputs of Triton's LLM backends under the generate extension's names.
_ALIASES = {"random_seed": "seed", "stop_words": "stop"}
_DROPPED = frozenset({"exclude_input_in_output", "stream"})


def generate_body(request: Any) -> tuple[dict[str, Any], bool]:
    """A ModelInferRequest for a generative model as the generate extension's body (`text_input` and `parameters`),
    and whether it streams (its `stream` input or parameter; true unless set false). The other inputs (one element
    each) and the request parameters become parameters: `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`
    (`random_seed`), `stop` (`stop_words`), `ignore_eos`, `priority`, `timeout`...; `sampling_parameters` (vLLM's
    backend: a JSON object) is read as more of them.

    Raises:
        TensorError: the request cannot be read so (no prompt, `sampling_parameters` not a JSON object...).
    """
    payload, header_length = infer_request_to_v2(request)
    decoded = decode_request(payload, header_length)
    parameters = {k: v for k, v in decoded.parameters.items() if k not in _TRITON_ONLY and not k.startswith("triton_")}
    text: Any = None
    stream = parameters.pop("stream", True)
    for tensor in decoded.inputs:
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in tensor.array.ravel().tolist()]
        value: Any = values[0] if len(values) == 1 else values
        if tensor.name == "text_input":
            text = value
        elif tensor.name == "stream":
            stream = value
        elif tensor.name == "sampling_parameters":
            try:
                more = json.loads(value) if isinstance(value, str) else None
            except ValueError:
                more = None
            if not isinstance(more, dict):
                raise TensorError("input 'sampling_parameters': must be one BYTES element holding a JSON object")
            parameters.update(more)
        elif tensor.name not in _DROPPED and not tensor.name.startswith("return_"):
            parameters[_ALIASES.get(tensor.name, tensor.name)] = value
    if not isinstance(text, str):
        raise TensorError("input 'text_input': a generative model needs one BYTES element with the prompt")
    return {"text_input": text, "parameters": parameters}, stream is not False


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events (`data: {json}` blocks) as JSON objects."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data and data != b"[DONE]":
                        event = json.loads(data)
                        if isinstance(event, dict):
                            yield event


def event_error(event: dict[str, Any]) -> str | None:
    """The error an event reports: an error event, or a generation that ended by failing."""
    if "error" in event:
        error = event["error"]
        return str(error.get("message") if isinstance(error, dict) else error)
    if event.get("finish_reason") == "error":
        return "the model run failed; see the agent log"
    if event.get("finish_reason") == "cancelled":
        return "the model's engine closed before the generation ended"
    return None


def generated(request: Any, event: dict[str, Any], outcome: str | None, *, last: bool) -> Any:
    """One generate event as a stream response: `text_output` (BYTES [1]) and, on the last, `triton_final_response`,
    `finish_reason` and `spillway_outcome`."""
    response = service_pb2.ModelStreamInferResponse()
    infer = response.infer_response
    infer.model_name = str(event.get("model_name", request.model_name))
    infer.model_version = str(event.get("model_version", request.model_version))
    infer.id = request.id
    if "text_output" in event:
        text = str(event["text_output"]).encode()
        output = infer.outputs.add()
        output.name, output.datatype = "text_output", "BYTES"
        output.shape.append(1)
        infer.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    parameters: dict[str, Any] = {"triton_final_response": last}
    if last:
        spillway = event.get(names.OPENAI_FIELD)
        said = spillway.get("outcome") if isinstance(spillway, dict) else None
        parameters.update(finish_reason=event.get("finish_reason"), spillway_outcome=said or outcome)
    set_parameters(infer.parameters, parameters)
    return response
