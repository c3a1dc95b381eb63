"""KServe V2 over gRPC (Triton's `GRPCInferenceService` messages) <-> the V2 HTTP body with Triton's binary tensor
extension, so that a gRPC request can be answered by the HTTP path as it is (the agent) and an HTTP request sent to
a gRPC backend (the gateway, `controlplane/gateway/grpc_backend.py`, which writes the inverse directions).

- `infer_request_to_v2`: a `ModelInferRequest` -> a V2 binary body and its `Inference-Header-Content-Length`. Every
  input travels binary: `raw_input_contents` as they are, typed `contents` written out raw (little-endian,
  row-major; BYTES as 4-byte little-endian lengths each followed by the element, as in the V2 binary extension).
  Every output is asked for binary. Request and tensor parameters are carried over as JSON values.
- `v2_response_to_infer`: a V2 response body (JSON, or binary with its header length) -> a `ModelInferResponse`
  with every output in `raw_output_contents`.
- `parameters_to_dict` / `set_parameters`: the `InferParameter` maps <-> plain values.

What the messages cannot say is refused with `TensorError` (a ValueError) naming the tensor: both typed and raw
contents, a typed-contents count that does not fit the shape, an integer out of its datatype's range, a datatype
without a typed field (FP16, BF16: send them raw). Checking the rest (shapes, datatypes, sizes against the model) is
the V2 decoder's, so a gRPC request is refused with the same words as the same request over HTTP.

The protobuf classes come from `tritonclient.grpc` (which needs grpcio), imported when first used: importing this
module needs neither.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, MutableMapping
from types import ModuleType
from typing import Any

import numpy as np

from spillway.contract.v2 import V2_TO_NUMPY, TensorError, decode_json_tensor

__all__ = [
    "contents_to_raw",
    "infer_request_to_v2",
    "parameters_to_dict",
    "raw_tensor",
    "service_pb2",
    "set_parameters",
    "v2_response_to_infer",
]

_INT64_MAX = (1 << 63) - 1
_MAX_OUTPUT_ELEMENTS = 1 << 28
# The typed-contents field of each datatype (FP16 and BF16 have none: they travel in raw contents only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip


@functools.cache
def service_pb2() -> ModuleType:
    """Triton's generated `service_pb2` (from tritonclient[grpc]); ImportError when grpcio is not installed."""
    from tritonclient.grpc import service_pb2 as module

    return module


# ---- parameters -----------------------------------------------------------------------------------------------------


def parameters_to_dict(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """An `InferParameter` (or `ModelRepositoryParameter`) map as plain values; a parameter with no value set is left
    out, and `bytes_param` (repository parameters only) stays bytes."""
    found: dict[str, Any] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            found[key] = getattr(parameter, choice)
    return found


def set_parameters(target: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
    """Write plain values into an `InferParameter` map: bool, int (uint64 beyond int64), float and str as themselves;
    anything else (a JSON object or array) as its JSON text in `string_param`; None is left out."""
    for key, value in values.items():
        if value is None:
            continue
        parameter = target[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if value > _INT64_MAX:
                parameter.uint64_param = value
            else:
                parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            parameter.string_param = json.dumps(value)


# ---- tensors --------------------------------------------------------------------------------------------------------


def _label(name: str) -> str:
    return f"input {name!r}" if len(name) <= 60 else f"input {name[:57]!r}..."


def _count(shape: list[int]) -> int | None:
    """The element count of a shape; None when a dimension is negative (the V2 decoder refuses that shape)."""
    return None if any(d < 0 for d in shape) else math.prod(shape)


def contents_to_raw(name: str, datatype: str, shape: list[int], contents: Any) -> bytes:
    """A tensor's typed `InferTensorContents` as the bytes of its raw form (TensorError naming the tensor when the
    contents do not fit its datatype or shape)."""
    label = _label(name)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise TensorError(f"{label}: {datatype} has no typed contents field; send it in raw_input_contents")
    values = list(getattr(contents, field))
    count = _count(shape)
    if count is not None and len(values) != count:
        raise TensorError(f"{label}: {field} holds {len(values)} values but shape {shape} needs {count}")
    if datatype == "BYTES":
        return raw_tensor(np.array(values, dtype=np.object_), "BYTES")
    dtype = V2_TO_NUMPY[datatype]
    if dtype.kind in "iu" and values:
        limits = np.iinfo(dtype)
        low, high = min(values), max(values)
        if low < limits.min or high > limits.max:
            bad = low if low < limits.min else high
            raise TensorError(f"{label}: {bad} in {field} is out of range for {datatype}")
    return raw_tensor(np.array(values, dtype=dtype), datatype)


def raw_tensor(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's raw bytes, as `raw_input_contents` / `raw_output_contents` and V2 binary parts carry them."""
    if datatype == "BYTES":
        from tritonclient.utils import serialize_byte_tensor

        return bytes(serialize_byte_tensor(array).item()) if array.size else b""
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes()


def _dumps(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


# ---- ModelInferRequest -> V2 ----------------------------------------------------------------------------------------


def infer_request_to_v2(request: Any) -> tuple[bytes, int]:
    """A `ModelInferRequest` as a V2 binary request body: the body and its `Inference-Header-Content-Length`.

    Raises:
        TensorError: the request's contents cannot be written as V2 (see the module docstring).
    """
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise TensorError(
            f"request: raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs (one per input, "
            "or none with every input's data in its typed contents)"
        )
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for index, tensor in enumerate(request.inputs):
        shape = list(tensor.shape)
        if raw:
            if tensor.HasField("contents"):
                raise TensorError(f"{_label(tensor.name)}: has both typed contents and raw_input_contents")
            blob = raw[index]
        else:
            blob = contents_to_raw(tensor.name, tensor.datatype, shape, tensor.contents)
        head: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": shape}
        head["parameters"] = {**parameters_to_dict(tensor.parameters), "binary_data_size": len(blob)}
        inputs.append(head)
        blobs.append(blob)
    document: dict[str, Any] = {}
    if request.id:
        document["id"] = request.id
    parameters = parameters_to_dict(request.parameters)
    outputs = [{"name": o.name, "parameters": {**parameters_to_dict(o.parameters), "binary_data": True}}
               for o in request.outputs]  # fmt: skip
    if not outputs:
        parameters["binary_data_output"] = True
    document["inputs"] = inputs
    if outputs:
        document["outputs"] = outputs
    document["parameters"] = parameters
    header = _dumps(document)
    return b"".join([header, *blobs]), len(header)


# ---- V2 -> ModelInferResponse ---------------------------------------------------------------------------------------


def v2_response_to_infer(body: bytes, header_length: int | None, response: Any = None) -> Any:
    """A V2 response body (JSON, or binary with its header length) as a `ModelInferResponse`, every output raw.

    Args:
        response: a `ModelInferResponse` to fill (a stream's `infer_response`, say); a new one when None.

    Raises:
        ValueError: the body is not a V2 response (TensorError naming the output for a malformed one).
    """
    if response is None:
        response = service_pb2().ModelInferResponse()
    end = len(body) if header_length is None else header_length
    if not 0 < end <= len(body):
        raise ValueError(f"V2 response: header length {header_length} is outside the body ({len(body)} bytes)")
    document = json.loads(body[:end])
    if not isinstance(document, dict):
        raise ValueError("V2 response: the JSON must be an object")
    response.model_name = str(document.get("model_name", ""))
    response.model_version = str(document.get("model_version", ""))
    if document.get("id") is not None:
        response.id = str(document["id"])
    if isinstance(document.get("parameters"), dict):
        set_parameters(response.parameters, document["parameters"])
    outputs = document.get("outputs") or []
    if not isinstance(outputs, list):
        raise ValueError("V2 response: 'outputs' must be an array")
    offset = end
    for index, output in enumerate(outputs):
        if not isinstance(output, dict):
            raise TensorError(f"V2 response: outputs[{index}] must be an object")
        parameters = dict(output.get("parameters") or {})
        size = parameters.pop("binary_data_size", None)
        if size is not None:
            if type(size) is not int or not 0 <= size <= len(body) - offset:
                raise TensorError(f"output {output.get('name')!r}: binary_data_size {size!r} overruns the body")
            blob = body[offset : offset + size]
            offset += size
            shape = output.get("shape")
        else:
            decoded = decode_json_tensor(output, index, max_elements=_MAX_OUTPUT_ELEMENTS)
            blob = raw_tensor(decoded.array, decoded.datatype)
            shape = list(decoded.shape)
        tensor = response.outputs.add()
        tensor.name = str(output.get("name", ""))
        tensor.datatype = str(output.get("datatype", ""))
        tensor.shape.extend(int(d) for d in shape or ())
        set_parameters(tensor.parameters, parameters)
        response.raw_output_contents.append(blob)
    return response
