"""Open Inference Protocol (KServe V2) tensors over HTTP, with Triton's binary tensor data extension.

Wire format, as Triton and `tritonclient.http` speak it:

- The body is a JSON object, optionally followed by raw tensor bytes. The header
  `Inference-Header-Content-Length` gives the JSON's length in bytes when raw bytes follow.
- An input carries either `data` (a JSON array, flat or nested row-major) or
  `parameters.binary_data_size`; binary parts follow the JSON in the order of `inputs`.
- Raw tensors are little-endian and row-major without padding; BOOL is one byte (0 or 1); BYTES
  elements are a 4-byte little-endian length followed by the bytes; FP16 and BF16 travel raw.
- An output is returned in binary when its `parameters.binary_data` says so, else when the request's
  `parameters.binary_data_output` does; binary outputs carry `parameters.binary_data_size`.

Decoding refuses anything malformed with `TensorError`, a `ValueError` whose message names the
offending input or output (or "request body"); the HTTP layer answers it with 400. `encode_response`
raises `TypeError` or `KeyError` only for a runner bug (an output missing or of the wrong dtype).
JSON `data` is read with one `np.asarray` for speed, so a boolean mixed among numbers is read as 0/1
(a list of booleans alone is refused for a numeric datatype).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spillway.contract.spec import V2_DATATYPES, TensorSpec

__all__ = [
    "FLOATS",
    "NUMPY_TO_V2",
    "V2_TO_NUMPY",
    "BodyTooLarge",
    "ClientGone",
    "DecodedRequest",
    "InferInput",
    "RequestedOutput",
    "TensorError",
    "deadline_us",
    "decode_json_tensor",
    "decode_request",
    "encode_error",
    "encode_response",
    "parse_header_length",
    "parse_timeout_budget_us",
    "read_body",
    "request_parameters",
    "scheduling_parameters",
    "timeout_parameter_us",
    "validate_inputs",
    "with_parameters",
]


class TensorError(ValueError):
    """A request's tensors are malformed or do not fit the model; the message names the tensor."""


def _bfloat16() -> np.dtype[Any] | None:
    """numpy has no bfloat16; ml_dtypes (a dependency of onnx and JAX) provides one when installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


V2_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),  # elements are `bytes`
}
_BF16 = _bfloat16()
if _BF16 is not None:
    V2_TO_NUMPY["BF16"] = _BF16
assert set(V2_TO_NUMPY) <= set(V2_DATATYPES)

NUMPY_TO_V2: dict[np.dtype[Any], str] = {dtype: name for name, dtype in V2_TO_NUMPY.items()}

# What travels on the wire: little-endian whatever the host (BF16 has no byte-order variant).
_WIRE: dict[str, np.dtype[Any]] = {
    name: dtype if name in ("BYTES", "BF16") else dtype.newbyteorder("<") for name, dtype in V2_TO_NUMPY.items()
}
FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})  # the floating-point V2 datatypes (NaN and Inf possible)
# printf formats that round-trip each float type through a float64 parse (as every JSON client does):
# the printed decimal lies far closer to the value than to the midpoint with its neighbour.
_FLOAT_FORMATS = {"FP16": "%.5g,", "FP32": "%.9g,", "BF16": "%.4g,"}
_U32 = struct.Struct("<I")
_MAX_RANK = 32  # numpy 1.x's limit
_KIND_NAMES = {"b": "booleans", "i": "integers", "u": "integers", "f": "non-integer numbers", "U": "strings"}


def _refuse_constant(token: str) -> Any:
    """Standard JSON has no NaN or Infinity; the stdlib parser would otherwise accept them."""
    raise ValueError(f"{token} is not valid JSON")


def _stdlib_loads(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_refuse_constant)


def _pick_loads() -> Callable[[bytes], Any]:
    """orjson parses a 512-float body about 8x faster than the stdlib; it is optional."""
    try:
        import orjson
    except ImportError:
        return _stdlib_loads
    return orjson.loads


_json_loads = _pick_loads()


def _pick_numpy_dumps() -> Callable[[np.ndarray], str | None] | None:
    """orjson writes a numpy array's numbers about 10x faster than printf, shortest round-trip form included."""
    try:
        import orjson
    except ImportError:
        return None

    def dumps(array: np.ndarray) -> str | None:
        text = orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY)
        if b"null" in text:  # orjson writes NaN and Infinity as null: let the slow path spell them
            return None
        return text[1:-1].decode()

    return dumps


def _pick_dumps() -> Callable[[Any], str]:
    """Compact JSON for the small parts of a response (orjson when installed: a few microseconds less each)."""
    try:
        import orjson
    except ImportError:
        return _stdlib_compact
    return lambda value: orjson.dumps(value).decode()


def _stdlib_compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


_numpy_dumps = _pick_numpy_dumps()
_compact_dumps = _pick_dumps()
# Datatypes orjson writes exactly (shortest repr that reads back to the same value); FP16/BF16 keep printf.
_ORJSON_DATATYPES = frozenset(
    {"FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
)


@dataclass(frozen=True, slots=True, eq=False)
class InferInput:
    """One decoded input. `array` has `shape`; from binary data it is a read-only view of the body."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the request asks for; `binary` is None when it leaves the choice to the request default."""

    name: str
    binary: bool | None


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    """A decoded inference request; `outputs` is None when the request names none (meaning all)."""

    id: str | None
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None
    parameters: dict[str, Any]
    binary_output_default: bool


def _brief(value: Any, limit: int = 60) -> str:
    """A client's value echoed in a message, cut so a hostile body cannot inflate the error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _input_label(name: str, kind: str = "input") -> str:
    return f"{kind} {name!r}" if len(name) <= 60 else f"{kind} {_brief(name)}"


def decode_request(body: bytes, header_length: int | None, *, max_elements: int = 1 << 26) -> DecodedRequest:
    """Decode an inference request body into arrays, refusing anything malformed before allocating.

    Args:
        body: the whole HTTP body.
        header_length: `Inference-Header-Content-Length`, the JSON's length in bytes; None when the
            body is all JSON.
        max_elements: the most elements one input may declare; checked before anything is allocated.

    Returns:
        The request, with each input's data as a numpy array of its declared shape.

    Raises:
        TensorError: the body is malformed; the message names the input or output, or "request body".
    """
    if not isinstance(body, bytes):
        body = bytes(body)
    size = len(body)
    if header_length is None:
        json_end = size
    elif isinstance(header_length, bool) or not isinstance(header_length, int) or not 0 <= header_length <= size:
        raise TensorError(
            f"request body: Inference-Header-Content-Length {_brief(header_length)} is outside the body ({size} bytes)"
        )
    else:
        json_end = header_length
    try:
        doc = _json_loads(body if json_end == size else body[:json_end])
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TensorError(f"request body: malformed JSON: {_brief(str(exc), 200)}") from None
    if not isinstance(doc, dict):
        raise TensorError("request body: the JSON must be an object")

    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise TensorError(f"request body: 'id' must be a string, got {_brief(request_id)}")
    parameters = doc.get("parameters")
    if parameters is None:
        parameters = {}
    elif not isinstance(parameters, dict):
        raise TensorError("request body: 'parameters' must be an object")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise TensorError(
            f"request body: parameter 'binary_data_output' must be true or false, got {_brief(binary_default)}"
        )

    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise TensorError("request body: 'inputs' must be an array of tensors")
    inputs: list[InferInput] = []
    names: set[str] = set()
    offset = json_end
    for index, raw_input in enumerate(raw_inputs):
        decoded, offset = _decode_input(raw_input, index, body, offset, max_elements)
        if decoded.name in names:
            raise TensorError(f"{_input_label(decoded.name)}: appears more than once")
        names.add(decoded.name)
        inputs.append(decoded)
    if offset != size:
        raise TensorError(f"request body: {size - offset} bytes of binary data after the JSON belong to no input")

    return DecodedRequest(
        id=request_id,
        inputs=inputs,
        outputs=_decode_outputs(doc.get("outputs")),
        parameters=parameters,
        binary_output_default=binary_default,
    )


def decode_json_tensor(raw: Any, index: int, *, kind: str = "output", max_elements: int = 1 << 20) -> InferInput:
    """One tensor written out in JSON (`name`, `datatype`, `shape`, `data`), such as a policy's default output."""
    return _decode_input(raw, index, b"", 0, max_elements, kind=kind)[0]


def _decode_input(
    raw: Any, index: int, body: bytes, offset: int, max_elements: int, *, kind: str = "input"
) -> tuple[InferInput, int]:
    """Decode `inputs[index]`; binary data starts at `offset` in the body. Returns the input and the next offset."""
    if not isinstance(raw, dict):
        raise TensorError(f"request body: {kind}s[{index}] must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TensorError(f"request body: {kind}s[{index}] needs a 'name' string")
    label = _input_label(name, kind)
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in V2_DATATYPES:
        raise TensorError(f"{label}: unknown datatype {_brief(datatype)} (known: {', '.join(V2_DATATYPES)})")
    if datatype not in V2_TO_NUMPY:
        raise TensorError(f"{label}: {datatype} needs the ml_dtypes package, which is not installed")
    shape, count = _parse_shape(raw.get("shape"), label, max_elements)

    params = _tensor_parameters(raw, label)
    binary_size = params.get("binary_data_size")
    data = raw.get("data")

    if binary_size is not None:
        if data is not None:
            raise TensorError(f"{label}: has both 'data' and parameter 'binary_data_size'")
        if type(binary_size) is not int or binary_size < 0:
            raise TensorError(f"{label}: 'binary_data_size' must be a non-negative integer, got {_brief(binary_size)}")
        end = offset + binary_size
        if end > len(body):
            raise TensorError(
                f"{label}: binary_data_size {binary_size} overruns the body ({len(body) - offset} bytes remain)"
            )
        if datatype == "BYTES":
            array = _bytes_from_binary(body, offset, end, shape, count, label)
        else:
            array = _array_from_binary(body, offset, binary_size, datatype, shape, count, label)
        return InferInput(name, datatype, shape, array), end

    if data is None:
        raise TensorError(f"{label}: has neither 'data' nor parameter 'binary_data_size'")
    if not isinstance(data, list):
        raise TensorError(f"{label}: 'data' must be a JSON array")
    if datatype == "BYTES":
        array = _bytes_from_json(data, shape, count, label)
    else:
        array = _array_from_json(data, datatype, shape, count, label)
    return InferInput(name, datatype, shape, array), offset


def _tensor_parameters(raw: dict[str, Any], label: str) -> dict[str, Any]:
    """A tensor's `parameters` object (empty when absent); the shared memory extension is refused."""
    params = raw.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise TensorError(f"{label}: 'parameters' must be an object")
    if "shared_memory_region" in params:
        raise TensorError(f"{label}: the shared memory extension is not supported")
    return params


def _parse_shape(raw: Any, label: str, max_elements: int) -> tuple[tuple[int, ...], int]:
    """Check a declared shape and count its elements without trusting it (the product may be astronomic)."""
    if not isinstance(raw, list) or len(raw) > _MAX_RANK:
        raise TensorError(f"{label}: 'shape' must be an array of at most {_MAX_RANK} integers, got {_brief(raw)}")
    count = 1
    empty = False
    for dim in raw:
        if type(dim) is not int or dim < 0:
            raise TensorError(f"{label}: 'shape' must hold non-negative integers, got {_brief(raw)}")
        if dim > max_elements:  # even an empty tensor with such a dimension is refused by numpy
            raise TensorError(f"{label}: shape {_brief(raw)} has more than the {max_elements} elements allowed")
        if dim == 0:
            empty = True
        count = min(count * dim, max_elements + 1) if dim else count
    if empty:
        count = 0
    if count > max_elements:
        raise TensorError(f"{label}: shape {_brief(raw)} has more than the {max_elements} elements allowed")
    return tuple(raw), count


def _array_from_json(data: list[Any], datatype: str, shape: tuple[int, ...], count: int, label: str) -> np.ndarray:
    """The hot path for JSON requests: one `np.asarray`, a kind check, one cast."""
    dtype = V2_TO_NUMPY[datatype]
    if not count:
        if data and not _collect_nested(data, shape, 0, []):
            raise TensorError(f"{label}: shape {list(shape)} holds no values but 'data' is not empty")
        return np.empty(shape, dtype=dtype)
    try:
        found = np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        raise TensorError(f"{label}: 'data' is ragged or mixes arrays and values") from None
    if found.shape != shape and (found.ndim != 1 or found.size != count):
        raise TensorError(
            f"{label}: 'data' has shape {list(found.shape)} ({found.size} values); "
            f"shape {list(shape)} needs {count} values, flat or nested"
        )
    kind = found.dtype.kind
    if kind == "O":
        found = _numbers_from_objects(found, datatype, label)
        kind = found.dtype.kind
    if datatype in FLOATS:
        if kind not in "iuf":
            raise TensorError(f"{label}: {datatype} needs numbers, got {_KIND_NAMES.get(kind, kind)}")
        with np.errstate(over="ignore"):
            array = found.astype(dtype, copy=False)
        if not np.isfinite(array).all():
            raise TensorError(f"{label}: a value is out of the {datatype} range")
    elif datatype == "BOOL":
        if kind != "b":
            raise TensorError(f"{label}: BOOL needs true or false, got {_KIND_NAMES.get(kind, kind)}")
        array = found
    else:
        if kind == "f":  # numpy reads a mix of int64 and larger uint64 values as float64: look again, exactly
            found = _exact_integers(data, found.shape, datatype, label)
            kind = found.dtype.kind
        if kind not in "iu":
            raise TensorError(f"{label}: {datatype} needs integers, got {_KIND_NAMES.get(kind, kind)}")
        if found.dtype != dtype:
            info = np.iinfo(dtype)
            if int(found.min()) < info.min or int(found.max()) > info.max:
                raise TensorError(f"{label}: a value is outside the {datatype} range [{info.min}, {info.max}]")
            array = found.astype(dtype)
        else:
            array = found
    return array if array.shape == shape else array.reshape(shape)


def _numbers_from_objects(found: np.ndarray, datatype: str, label: str) -> np.ndarray:
    """numpy falls back to objects for integers beyond 64 bits or for mixed values; only the first may pass."""
    values = found.ravel().tolist()
    if not all(type(v) is int or type(v) is float for v in values):
        raise TensorError(
            f"{label}: {datatype} needs numbers, got {_brief(next(v for v in values if type(v) not in (int, float)))}"
        )
    if datatype not in FLOATS:
        raise TensorError(f"{label}: a value is outside the {datatype} range")
    return np.asarray(values, dtype=np.float64).reshape(found.shape)


def _exact_integers(data: list[Any], shape: tuple[int, ...], datatype: str, label: str) -> np.ndarray:
    """Integers read one by one, for the rare list numpy could only hold as floats."""
    values = np.asarray(data, dtype=object).ravel().tolist()
    if not all(type(v) is int for v in values):
        raise TensorError(f"{label}: {datatype} needs integers, got non-integer numbers")
    info = np.iinfo(V2_TO_NUMPY[datatype])
    if min(values) < info.min or max(values) > info.max:
        raise TensorError(f"{label}: a value is outside the {datatype} range [{info.min}, {info.max}]")
    return np.array(values, dtype=V2_TO_NUMPY[datatype]).reshape(shape)


def _bytes_from_json(data: list[Any], shape: tuple[int, ...], count: int, label: str) -> np.ndarray:
    """JSON carries BYTES elements as strings (Triton's choice); they become UTF-8 `bytes`."""
    leaves: list[Any] = []
    if len(data) == count and not any(isinstance(item, list) for item in data):
        leaves = data
    elif not _collect_nested(data, shape, 0, leaves):
        raise TensorError(f"{label}: 'data' does not match shape {list(shape)} ({count} values, flat or nested)")
    out = np.empty(count, dtype=object)
    try:
        out[:] = [leaf.encode() for leaf in leaves] if count else []
    except (AttributeError, UnicodeEncodeError):
        bad = next((leaf for leaf in leaves if not isinstance(leaf, str)), "a lone surrogate")
        raise TensorError(f"{label}: BYTES elements in JSON must be strings, got {_brief(bad)}") from None
    return out.reshape(shape)


def _collect_nested(node: list[Any], shape: tuple[int, ...], depth: int, out: list[Any]) -> bool:
    """Append the leaves of `node` if its nesting is exactly `shape[depth:]`."""
    if depth >= len(shape) or len(node) != shape[depth]:
        return False
    if depth == len(shape) - 1:
        if any(isinstance(item, list) for item in node):
            return False
        out.extend(node)
        return True
    return all(isinstance(item, list) and _collect_nested(item, shape, depth + 1, out) for item in node)


def _array_from_binary(
    body: bytes, offset: int, size: int, datatype: str, shape: tuple[int, ...], count: int, label: str
) -> np.ndarray:
    """A zero-copy view of the body, copied only when misaligned for its dtype."""
    dtype = _WIRE[datatype]
    needed = count * dtype.itemsize
    if size != needed:
        raise TensorError(
            f"{label}: binary_data_size is {size} bytes but shape {list(shape)} of {datatype} needs {needed}"
        )
    if not count:
        return np.empty(shape, dtype=dtype)
    array = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    if not array.flags.aligned:
        array = array.copy()
    if datatype == "BOOL" and array.view(np.uint8).max() > 1:
        raise TensorError(f"{label}: BOOL bytes must be 0 or 1")
    return array.reshape(shape)


def _bytes_from_binary(
    body: bytes, offset: int, end: int, shape: tuple[int, ...], count: int, label: str
) -> np.ndarray:
    """BYTES elements: a 4-byte little-endian length, then that many bytes, `count` times, filling the part exactly."""
    if count * _U32.size > end - offset:
        raise TensorError(
            f"{label}: binary_data_size {end - offset} cannot hold {count} BYTES elements (4 bytes of length each)"
        )
    elements: list[bytes] = []
    position = offset
    unpack = _U32.unpack_from
    for index in range(count):
        if position + 4 > end:
            raise TensorError(f"{label}: BYTES element {index} is truncated (no room for its length)")
        (length,) = unpack(body, position)
        position += 4
        if position + length > end:
            raise TensorError(f"{label}: BYTES element {index} declares {length} bytes but {end - position} remain")
        elements.append(body[position : position + length])
        position += length
    if position != end:
        raise TensorError(f"{label}: {end - position} bytes left over after {count} BYTES elements")
    out = np.empty(count, dtype=object)
    out[:] = elements
    return out.reshape(shape)


def _decode_outputs(raw: Any) -> list[RequestedOutput] | None:
    """Requested outputs; an absent or empty list means every output, as in Triton."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise TensorError("request body: 'outputs' must be an array")
    requested: list[RequestedOutput] = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise TensorError(f"request body: outputs[{index}] must be an object with a 'name' string")
        name = item["name"]
        label = f"output {_brief(name)}"
        if name in names:
            raise TensorError(f"{label}: requested more than once")
        names.add(name)
        params = _tensor_parameters(item, label)
        if "classification" in params:
            raise TensorError(f"{label}: the classification extension is not supported")
        binary = params.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise TensorError(f"{label}: parameter 'binary_data' must be true or false, got {_brief(binary)}")
        requested.append(RequestedOutput(name, binary))
    return requested or None


def validate_inputs(
    inputs: list[InferInput], specs: tuple[TensorSpec, ...], max_batch_size: int, *, allow_non_finite: bool = True
) -> int:
    """Check decoded inputs against the model's inputs and return the request's batch size.

    Args:
        inputs: the decoded inputs.
        specs: the model's inputs; shapes exclude the batch dimension when `max_batch_size > 0`; -1 is dynamic.
        max_batch_size: the model's; 0 when it does not batch.
        allow_non_finite: False refuses NaN and Inf in float inputs.

    Returns:
        For a batching model, the first dimension shared by every input (1..max_batch_size); for a
        model that does not batch, 1 (the request is one unit of work).

    Raises:
        TensorError: naming the input and saying what was expected and what came.
    """
    by_name = {spec.name: spec for spec in specs}
    batched = max_batch_size > 0
    batch = 0
    batch_from = ""
    seen: set[str] = set()
    for item in inputs:
        label = _input_label(item.name)
        spec = by_name.get(item.name)
        if spec is None:
            raise TensorError(f"{label}: the model has no such input (it has: {', '.join(sorted(by_name))})")
        if item.name in seen:
            raise TensorError(f"{label}: appears more than once")
        seen.add(item.name)
        if item.datatype != spec.datatype:
            raise TensorError(f"{label}: expected datatype {spec.datatype}, got {item.datatype}")
        expected = ((-1,) if batched else ()) + spec.shape
        if len(item.shape) != len(expected) or any(
            want not in (-1, got) for want, got in zip(expected, item.shape, strict=True)
        ):
            raise TensorError(f"{label}: expected shape {list(expected)}, got {list(item.shape)}")
        if batched:
            size = item.shape[0]
            if not 1 <= size <= max_batch_size:
                raise TensorError(f"{label}: batch size {size} is outside 1..{max_batch_size}")
            if not batch:
                batch, batch_from = size, item.name
            elif size != batch:
                raise TensorError(f"{label}: batch size {size} disagrees with {_input_label(batch_from)} ({batch})")
        if not allow_non_finite and item.datatype in FLOATS and not np.isfinite(item.array).all():
            raise TensorError(f"{label}: holds NaN or Inf, which this model does not accept")
    missing = [spec.name for spec in specs if spec.name not in seen]
    if missing:
        raise TensorError(f"{_input_label(missing[0])}: missing from the request")
    return batch if batched else 1


def encode_response(
    *,
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: dict[str, np.ndarray],
    specs: tuple[TensorSpec, ...],
    requested: list[RequestedOutput] | None,
    binary_default: bool,
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """Encode the requested outputs (all, in the model's order, when None) as a V2 response body.

    BYTES go to JSON as strings when every element is UTF-8; otherwise that output is sent in binary
    (lossless, and clients read it by its `binary_data_size` whatever they asked). Non-finite floats
    go to JSON as NaN/Infinity, as Python's json and Triton's client accept.

    Returns:
        The body and its `Inference-Header-Content-Length` (None when the body is all JSON).

    Raises:
        TensorError: a requested output the model does not have.
        KeyError, TypeError: the runner did not produce a declared output, or gave it the wrong dtype.
    """
    by_name = {spec.name: spec for spec in specs}
    plan: list[tuple[TensorSpec, bool]] = []
    if requested is None:
        plan = [(spec, binary_default) for spec in specs]
    else:
        for item in requested:
            spec = by_name.get(item.name)
            if spec is None:
                raise TensorError(
                    f"output {_brief(item.name)}: the model has no such output (it has: {', '.join(sorted(by_name))})"
                )
            plan.append((spec, binary_default if item.binary is None else item.binary))

    parts: list[str] = []
    blobs: list[bytes] = []
    for spec, binary in plan:
        array = outputs[spec.name]
        _check_output_dtype(spec, array)
        head: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "shape": list(array.shape)}
        text = None if binary else _json_data(array, spec.datatype)
        if text is None:
            blob = _wire_bytes(array, spec.datatype)
            head["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
            parts.append(_compact_dumps(head))
        else:
            parts.append(f'{_compact_dumps(head)[:-1]},"data":[{text}]}}')

    top: dict[str, Any] = {}
    if request_id is not None:
        top["id"] = request_id
    top["model_name"] = model_name
    top["model_version"] = model_version
    if parameters:
        top["parameters"] = parameters
    header = f'{_compact_dumps(top)[:-1]},"outputs":[{",".join(parts)}]}}'.encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _check_output_dtype(spec: TensorSpec, array: np.ndarray) -> None:
    if spec.datatype == "BYTES":
        ok = array.dtype.kind in "OSU"
    else:
        expected = V2_TO_NUMPY.get(spec.datatype)
        ok = expected is not None and array.dtype == expected
    if not ok:
        raise TypeError(f"output {spec.name!r}: the runner produced {array.dtype}, the model declares {spec.datatype}")


def _json_data(array: np.ndarray, datatype: str) -> str | None:
    """The inside of an output's JSON `data` array, flat row-major; None when BYTES are not all UTF-8."""
    if datatype == "BYTES":
        try:
            strings = [e.decode() if isinstance(e, bytes) else str(e) for e in array.ravel().tolist()]
        except UnicodeDecodeError:
            return None
        return json.dumps(strings)[1:-1]
    if _numpy_dumps is not None and datatype in _ORJSON_DATATYPES and array.dtype.kind in "iuf":
        text = _numpy_dumps(np.ascontiguousarray(array).ravel())
        if text is not None:
            return text
    fmt = _FLOAT_FORMATS.get(datatype)
    if fmt is not None and np.isfinite(array).all():
        # Fixed-precision printf is about 3x faster than json's shortest-repr floats for [1, 1000] FP32.
        values = (array.astype(np.float32) if datatype == "BF16" else array).ravel().tolist()
        text = (fmt * len(values)) % tuple(values)
        if "-0," in text:  # %g prints -0.0 as "-0", which JSON readers take for the integer 0
            text = text.replace("-0,", "-0.0,")
        return text[:-1]
    if datatype == "BF16":
        array = array.astype(np.float32)
    return json.dumps(array.ravel().tolist())[1:-1]


def _wire_bytes(array: np.ndarray, datatype: str) -> bytes:
    """An output's binary part: raw little-endian row-major, or length-prefixed BYTES elements."""
    if datatype != "BYTES":
        return array.astype(_WIRE[datatype], copy=False).tobytes()
    pieces: list[bytes] = []
    for element in array.ravel().tolist():
        raw = element if isinstance(element, bytes) else str(element).encode()
        pieces.append(_U32.pack(len(raw)))
        pieces.append(raw)
    return b"".join(pieces)


def encode_error(message: str) -> bytes:
    """The V2 error body, `{"error": "..."}`."""
    return json.dumps({"error": message}).encode()


def with_parameters(body: bytes, header_length: int | None, extra: dict[str, Any]) -> tuple[bytes, int | None]:
    """A V2 response with `extra` added to its `parameters` (binary data after the JSON header kept as it is).

    On every overflowed answer, so orjson both ways where it can: what orjson parsed has no NaN or Infinity,
    which it could not write back; an answer with them takes the standard library. Raises ValueError when the
    JSON part is not a JSON object."""
    head = body if header_length is None else body[:header_length]
    dumps = _compact_dumps
    try:
        document = _json_loads(head)
    except ValueError:  # NaN/Infinity literals (the stdlib's writer puts them in JSON): the stdlib both ways
        document, dumps = json.loads(head), _stdlib_compact
    if not isinstance(document, dict):
        raise ValueError("a V2 response is a JSON object")
    parameters = document.get("parameters")
    document["parameters"] = {**(parameters if isinstance(parameters, dict) else {}), **extra}
    new_head = dumps(document).encode()
    if header_length is None:
        return new_head, None
    return new_head + body[header_length:], len(new_head)


# ---- the request around the tensors: headers, scheduling parameters, the body ---------------------------------------
# Both the agent and the gateway read requests with these, so that a header means the same on either side.


class BodyTooLarge(ValueError):
    """The request body is over the limit (said by Content-Length, or found while reading)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


class ClientGone(Exception):
    """The client disconnected before its body arrived: nobody is left to answer."""


def _shown(raw: bytes) -> str:
    return raw[:40].decode("latin-1")


def parse_header_length(raw: bytes | None, body_size: int) -> int | None:
    """`Inference-Header-Content-Length`: the JSON part's length in a binary request (None: the body is all JSON)."""
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or not 0 < int(text) <= body_size:
        raise TensorError(
            f"inference-header-content-length: must be a whole number of bytes from 1 to the body's {body_size}, "
            f"got '{_shown(text)}'"
        )
    return int(text)


def parse_timeout_budget_us(raw: bytes | None) -> int | None:
    """`Spillway-Timeout-Us`: what is left of the deadline of a request that an edge agent overflowed, which the
    gateway passes on, so that a cloud agent refuses at once what it cannot answer in time. At least 1 µs."""
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit():
        raise TensorError(f"spillway-timeout-us: must be a whole number of microseconds, got '{_shown(text)}'")
    return max(int(text), 1)


def timeout_parameter_us(parameters: dict[str, Any]) -> int | None:
    """Triton's `timeout` request parameter, in microseconds (0 or absent: none)."""
    timeout = parameters.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0):
        raise TensorError(f"parameter 'timeout' must be a non-negative integer of microseconds, got {timeout!r}")
    return timeout or None


def scheduling_parameters(parameters: dict[str, Any]) -> tuple[int, int | None]:
    """Triton's request parameters: `priority` (0: the model's default level) and `timeout` (`timeout_parameter_us`).
    A proxy reads only the timeout: the priority is the serving side's to judge."""
    priority = parameters.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise TensorError(f"parameter 'priority' must be a non-negative integer, got {priority!r}")
    return priority, timeout_parameter_us(parameters)


def request_parameters(json_head: bytes) -> dict[str, Any]:
    """The `parameters` of a request, from its JSON (the whole body, or a binary request's header), without decoding
    its tensors: what a proxy needs to read the deadline."""
    try:
        request = _json_loads(json_head)
    except ValueError as exc:
        raise TensorError(f"request JSON: not valid JSON ({exc})") from None
    if not isinstance(request, dict):
        raise TensorError(f"request JSON: must be an object, got {type(request).__name__}")
    parameters = request.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise TensorError("request JSON: 'parameters' must be an object")
    return parameters


def deadline_us(budget_us: int | None, timeout_us: int | None) -> int | None:
    """The tighter of the budget header and the `timeout` parameter; None when the caller set neither."""
    given = [t for t in (budget_us, timeout_us) if t is not None]
    return min(given) if given else None


async def read_body(receive: Callable[[], Any], declared: bytes | None, limit: int) -> bytes:
    """An ASGI request's whole body, refused with BodyTooLarge as soon as it is known to exceed `limit` (from its
    Content-Length, before reading anything); ClientGone when the client leaves first."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
