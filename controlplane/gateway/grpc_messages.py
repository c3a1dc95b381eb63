"""V2 HTTP infer requests as gRPC ModelInferRequests, and ModelInferResponses as the V2 HTTP answer the client asked
for: the gateway's half of speaking to a `v2_grpc` backend (the agent's gRPC server, `spillway.contract.grpc_codec`,
does the opposite directions).

A request's inputs travel as `raw_input_contents` (a binary input's bytes as they came, a JSON input written in the
same wire format: little-endian, row-major, BYTES as 4-byte lengths and bytes); its parameters (`priority`, `timeout`,
...), its tensors' parameters and its requested outputs go as they came, less the binary tensor extension's
(`binary_data_size`, `binary_data`, `binary_data_output`), which gRPC has no use for; an object or array parameter
goes as its JSON text, as the agent's codec writes it (`spillway.contract.grpc_codec`, whose helpers are used here).
The answer's outputs (raw or typed `contents`) are written by the V2 codec (`spillway.contract.v2.encode_response`):
in binary where the client asked for binary, else in JSON, with the backend's id, model name, version and parameters.
Messages are tritonclient's generated ones.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from tritonclient.grpc import service_pb2

from controlplane.gateway.translate import MAX_ELEMENTS, BinaryOutputs, TranslationError, decode_body
from spillway.contract.grpc_codec import parameters_to_dict, raw_tensor, set_parameters
from spillway.contract.spec import TensorSpec
from spillway.contract.v2 import V2_TO_NUMPY, TensorError, encode_response

__all__ = ["GrpcRequest", "http_answer", "infer_request"]

_U32 = struct.Struct("<I")
# The typed `contents` field of each datatype (FP16 and BF16 have none: they travel raw only).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}  # fmt: skip


@dataclass(frozen=True)
class GrpcRequest:
    """A client's request as a ModelInferRequest, and how it wants its outputs back."""

    message: Any  # service_pb2.ModelInferRequest
    outputs: BinaryOutputs


def infer_request(body: bytes, header_length: int | None, model: str, version: str | None) -> GrpcRequest:
    """A V2 HTTP infer request (JSON, or JSON and binary tensors) as a ModelInferRequest for `model`.

    Raises:
        TranslationError: the request is malformed, or holds a parameter gRPC cannot carry (an object, an array, a
            null); the message names the input, output or parameter, as the agent's would.
    """
    v2 = decode_body(body, header_length)
    body, decoded = v2.raw, v2.request
    doc = _loads(v2.head)  # decode_body has checked every field used below
    message = service_pb2.ModelInferRequest(model_name=model, model_version=version or "", id=decoded.id or "")
    _set_parameters(message.parameters, decoded.parameters, "request", skip="binary_data_output")
    offset = v2.json_end
    for raw, item in zip(doc["inputs"], decoded.inputs, strict=True):
        tensor = message.inputs.add(name=item.name, datatype=item.datatype, shape=item.shape)
        parameters = raw.get("parameters") or {}
        _set_parameters(tensor.parameters, parameters, f"input {item.name!r}", skip="binary_data_size")
        size = parameters.get("binary_data_size")
        if size is None:
            message.raw_input_contents.append(raw_tensor(item.array, item.datatype))
        else:  # already in the wire format: the bytes as they came
            message.raw_input_contents.append(body[offset : offset + size])
            offset += size
    for raw in doc.get("outputs") or ():
        output = message.outputs.add(name=raw["name"])
        _set_parameters(output.parameters, raw.get("parameters") or {}, f"output {raw['name']!r}", skip="binary_data")
    return GrpcRequest(message, v2.outputs)


def http_answer(response: Any, outputs: BinaryOutputs) -> tuple[bytes, int | None]:
    """A ModelInferResponse as a V2 HTTP response body, and its `Inference-Header-Content-Length` (None: all JSON).

    Raises:
        TranslationError: the response is not a valid one (a tensor whose bytes do not fit its shape, an unknown
            datatype, an output the client asked for missing); the message starts with "backend response".
    """
    raw = response.raw_output_contents
    if raw and len(raw) != len(response.outputs):
        raise TranslationError(f"backend response: {len(raw)} raw_output_contents for {len(response.outputs)} outputs")
    arrays: dict[str, np.ndarray] = {}
    specs: list[TensorSpec] = []
    for index, tensor in enumerate(response.outputs):
        label = f"backend response: output {tensor.name[:60]!r}"
        if tensor.name in arrays:
            raise TranslationError(f"{label}: appears more than once")
        if tensor.datatype not in V2_TO_NUMPY:
            raise TranslationError(f"{label}: unknown datatype {tensor.datatype[:20]!r}")
        shape = tuple(int(d) for d in tensor.shape)
        if any(d < 0 for d in shape):
            raise TranslationError(f"{label}: shape {list(shape)} has a negative dimension")
        count = int(np.prod(shape, dtype=np.int64))
        if count > MAX_ELEMENTS:
            raise TranslationError(f"{label}: {count} elements, more than {MAX_ELEMENTS}")
        if raw:
            array = _from_raw(raw[index], tensor.datatype, shape, count, label)
        else:
            array = _from_contents(tensor.contents, tensor.datatype, shape, count, label)
        arrays[tensor.name] = array
        specs.append(TensorSpec(tensor.name, tensor.datatype, shape))
    parameters = parameters_to_dict(response.parameters)
    try:
        return encode_response(
            model_name=response.model_name,
            model_version=response.model_version,
            request_id=response.id or None,
            outputs=arrays,
            specs=tuple(specs),
            requested=None if outputs.requested is None else list(outputs.requested),
            binary_default=outputs.default,
            parameters=parameters or None,
        )
    except TensorError as exc:  # an output the client asked for is missing
        raise TranslationError(f"backend response: {str(exc).removeprefix('request body: ')}") from None


def _loads(head: bytes) -> Any:
    try:
        return orjson.loads(head)
    except orjson.JSONDecodeError:  # NaN or Infinity, which the agent's reader (the standard library's) takes
        return json.loads(head)


def _set_parameters(target: Any, parameters: Mapping[str, Any], label: str, *, skip: str) -> None:
    try:
        set_parameters(target, {key: value for key, value in parameters.items() if key != skip})
    except ValueError:  # protobuf's: an integer beyond 64 bits
        raise TranslationError(f"{label}: a parameter holds an integer beyond 64 bits") from None


def _from_raw(data: bytes, datatype: str, shape: tuple[int, ...], count: int, label: str) -> np.ndarray:
    if datatype == "BYTES":
        elements: list[bytes] = []
        position = 0
        for index in range(count):
            if position + 4 > len(data):
                raise TranslationError(f"{label}: BYTES element {index} is truncated")
            (length,) = _U32.unpack_from(data, position)
            position += 4
            if position + length > len(data):
                raise TranslationError(f"{label}: BYTES element {index} overruns its contents")
            elements.append(data[position : position + length])
            position += length
        if position != len(data):
            raise TranslationError(f"{label}: {len(data) - position} bytes left over after {count} BYTES elements")
        out = np.empty(count, dtype=object)
        out[:] = elements
        return out.reshape(shape)
    dtype = V2_TO_NUMPY[datatype]
    if datatype != "BF16":
        dtype = dtype.newbyteorder("<")
    needed = count * dtype.itemsize
    if len(data) != needed:
        raise TranslationError(
            f"{label}: {len(data)} bytes of contents; shape {list(shape)} of {datatype} needs {needed}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count)
    if array.dtype != V2_TO_NUMPY[datatype]:  # a big-endian host: the codec writes native arrays
        array = array.astype(V2_TO_NUMPY[datatype])
    return array.reshape(shape)


def _from_contents(contents: Any, datatype: str, shape: tuple[int, ...], count: int, label: str) -> np.ndarray:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise TranslationError(f"{label}: {datatype} travels in raw_output_contents only, which the answer lacks")
    values = list(getattr(contents, field))
    if len(values) != count:
        raise TranslationError(f"{label}: {len(values)} values in contents, but shape {list(shape)} holds {count}")
    if datatype == "BYTES":
        out = np.empty(count, dtype=object)
        out[:] = values
        return out.reshape(shape)
    try:
        return np.array(values, dtype=V2_TO_NUMPY[datatype]).reshape(shape)
    except OverflowError:
        raise TranslationError(f"{label}: a value is outside the {datatype} range") from None
