"""Open Inference Protocol (KServe V2) requests rewritten for backends without binary tensors, and answers back.

A client may send Triton's binary tensor data extension and ask for binary outputs; a backend flagged
`binary_tensors: false` (MLServer, for one) reads and writes JSON tensors only. `request_to_json` rewrites a
request as pure JSON: every binary input becomes JSON `data`, and no `binary_data_size`, `binary_data` or
`binary_data_output` parameter is left, so the backend answers in JSON. `response_from_json` turns that answer
into the response the client asked for: the outputs it wanted in binary carry `parameters.binary_data_size`
with their bytes after the JSON, in order; the others stay JSON. Everything else passes unchanged: the id, the
request and tensor parameters, JSON inputs as they came, and the answer's id, model name, version and
parameters.

Tensors are read and written by the edge agent's codec (`spillway.contract.v2`), so the gateway agrees
with the agent on every datatype. JSON cannot carry BYTES elements that are not UTF-8, nor NaN and Infinity
(Python's json and Triton read them, MLServer refuses them): a binary input holding either is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from spillway.contract.spec import TensorSpec
from spillway.contract.v2 import (
    FLOATS,
    V2_TO_NUMPY,
    DecodedRequest,
    InferInput,
    RequestedOutput,
    TensorError,
    decode_json_tensor,
    decode_request,
    encode_response,
)

__all__ = ["BinaryOutputs", "Translated", "TranslationError", "V2Body", "decode_body", "request_to_json",
           "response_from_json"]  # fmt: skip

MAX_ELEMENTS = 1 << 26  # per tensor, as the agent's decoder allows by default
_SLOT = "x"  # the name under which one tensor goes through the codec's writer


class TranslationError(ValueError):
    """A request or a backend's answer cannot be translated; the message names the tensor or the field."""


@dataclass(frozen=True, slots=True)
class BinaryOutputs:
    """How the client wants outputs: each requested one by its `binary` (None: all outputs), else `default`."""

    requested: tuple[RequestedOutput, ...] | None
    default: bool

    @property
    def wanted(self) -> bool:
        """Whether any output may go back in binary (if not, the backend's JSON answer suits the client)."""
        if self.requested is None:
            return self.default
        return any(self.default if item.binary is None else item.binary for item in self.requested)


@dataclass(frozen=True, slots=True)
class V2Body:
    """A V2 infer request's body, checked and decoded by the agent's codec, and where its JSON part ends."""

    raw: bytes
    request: DecodedRequest
    json_end: int

    @property
    def head(self) -> bytes:
        """The JSON part (the whole body when nothing in it is binary)."""
        return self.raw[: self.json_end]

    @property
    def outputs(self) -> BinaryOutputs:
        """The client's output choices."""
        request = self.request
        return BinaryOutputs(None if request.outputs is None else tuple(request.outputs), request.binary_output_default)


def decode_body(body: bytes, header_length: int | None) -> V2Body:
    """A V2 infer request's body (JSON, or JSON and binary tensors as `header_length` says) decoded and checked.

    Raises:
        TranslationError: the request is malformed; the message names the input, output or field.
    """
    if not isinstance(body, bytes):
        body = bytes(body)
    try:
        decoded = decode_request(body, header_length, max_elements=MAX_ELEMENTS)
    except TensorError as exc:
        raise TranslationError(str(exc)) from None
    return V2Body(body, decoded, len(body) if header_length is None else header_length)


@dataclass(frozen=True, slots=True)
class Translated:
    """A request rewritten as pure JSON, and what `response_from_json` needs to answer like the client asked."""

    body: bytes
    binary_outputs: BinaryOutputs


def request_to_json(body: bytes, header_length: int | None) -> Translated:
    """Rewrite a V2 inference request, binary tensors included, as a pure JSON request.

    Args:
        body: the request body as the client sent it.
        header_length: its `Inference-Header-Content-Length`; None when the body is all JSON.

    Returns:
        The JSON request (the body itself when nothing in it is binary) and the client's output choices.

    Raises:
        TranslationError: the request is malformed, or a binary input holds what JSON cannot carry (BYTES
            that are not UTF-8, NaN, Infinity); the message names the input or output, or "request body".
    """
    v2 = decode_body(body, header_length)
    body, outputs = v2.raw, v2.outputs
    # No binary part and no binary_data key (even spelled with \u escapes): nothing to rewrite.
    if v2.json_end == len(body) and b"binary_data" not in body and b"\\u" not in body:
        return Translated(body, outputs)

    doc: dict[str, Any] = orjson.loads(v2.head)  # decode_body has checked every field used below
    doc["inputs"] = [_json_input(raw, item) for raw, item in zip(doc["inputs"], v2.request.inputs, strict=True)]
    if doc.get("outputs"):
        doc["outputs"] = [_without_parameter(raw, "binary_data") for raw in doc["outputs"]]
    doc = _without_parameter(doc, "binary_data_output")
    return Translated(orjson.dumps(doc), outputs)


def response_from_json(body: bytes, translated: Translated) -> tuple[bytes, int | None]:
    """Turn a backend's JSON answer to `translated` into the response its client asked for.

    Returns:
        The body and its `Inference-Header-Content-Length`: None when the client wanted nothing in binary
        (the backend's body is returned as it came) or no output ended up binary.

    Raises:
        TranslationError: the answer is not a valid V2 JSON response, or lacks an output the client asked
            for; the message starts with "backend response".
    """
    if not isinstance(body, bytes):
        body = bytes(body)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise TranslationError(f"backend response: malformed JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise TranslationError("backend response: the JSON must be an object")
    raw_outputs = doc.get("outputs")
    if not isinstance(raw_outputs, list):
        raise TranslationError("backend response: 'outputs' must be an array of tensors")
    tensors: dict[str, InferInput] = {}
    for index, raw in enumerate(raw_outputs):
        try:
            tensor = decode_json_tensor(raw, index, kind="output", max_elements=MAX_ELEMENTS)
        except TensorError as exc:
            raise _backend_error(exc) from None
        if tensor.name in tensors:
            raise TranslationError(f"backend response: output {tensor.name!r} appears more than once")
        tensors[tensor.name] = tensor

    wanted = translated.binary_outputs
    if not wanted.wanted:
        return body, None
    try:
        encoded, header_length = encode_response(
            model_name="",
            model_version="",
            request_id=None,
            outputs={name: tensor.array for name, tensor in tensors.items()},
            specs=tuple(TensorSpec(t.name, t.datatype, t.shape) for t in tensors.values()),
            requested=None if wanted.requested is None else list(wanted.requested),
            binary_default=wanted.default,
        )
    except TensorError as exc:  # an output the client asked for is missing
        raise _backend_error(exc) from None
    # The codec writes its own top-level fields; the backend's (id, model_name, model_version, parameters, and
    # anything else) take their place, as they came.
    top = orjson.dumps({key: value for key, value in doc.items() if key != "outputs"})
    lead = top[:-1] + b"," if len(top) > 2 else b"{"
    translated_body = lead + encoded[len(_CODEC_LEAD) :]
    if header_length is None:
        return translated_body, None
    return translated_body, header_length - len(_CODEC_LEAD) + len(lead)


def _backend_error(exc: TensorError) -> TranslationError:
    """The codec's message about an answer's tensor, said of the backend's response (not of a request body)."""
    message = str(exc).removeprefix("request body: ")
    return TranslationError(f"backend response: {message}")


def _json_input(raw: dict[str, Any], item: InferInput) -> dict[str, Any]:
    """One input of the request as JSON: a binary one gets `data`; a JSON one passes as it came."""
    parameters = raw.get("parameters")
    if not parameters or "binary_data_size" not in parameters:
        return raw
    tensor = _without_parameter(raw, "binary_data_size")
    if parameters["binary_data_size"] is not None:  # else the input came as JSON `data`, kept as it is
        tensor["data"] = orjson.Fragment(_json_data(item))
    return tensor


def _without_parameter(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """`raw` without `parameters[key]`, and without `parameters` if nothing else is left there."""
    parameters = raw.get("parameters")
    if not parameters or key not in parameters:
        return raw
    rest = {name: value for name, value in parameters.items() if name != key}
    tensor = {name: value for name, value in raw.items() if name != "parameters"}
    if rest:
        tensor["parameters"] = rest
    return tensor


def _json_data(item: InferInput) -> bytes:
    """The input's values as a flat JSON array, written by the codec's response writer.

    That writer is what the agent answers JSON with (round-trip precision for each float type, BYTES as
    strings); `tensors.py` keeps its array-to-JSON function private, so the array is taken out of a
    one-output response.
    """
    array = item.array
    if item.datatype in FLOATS and not np.isfinite(array).all():
        raise TranslationError(f"input {item.name!r}: NaN and Infinity cannot be sent as JSON to this backend")
    if item.datatype != "BYTES" and array.dtype != V2_TO_NUMPY[item.datatype]:
        array = array.astype(V2_TO_NUMPY[item.datatype])  # a big-endian host: binary data arrives little-endian
    encoded, header_length = encode_response(
        model_name="",
        model_version="",
        request_id=None,
        outputs={_SLOT: array},
        specs=(TensorSpec(_SLOT, item.datatype, item.shape),),
        requested=None,
        binary_default=False,
    )
    if header_length is not None:  # the writer falls back to binary for BYTES that are not UTF-8
        raise TranslationError(
            f"input {item.name!r}: BYTES elements that are not UTF-8 cannot be sent as JSON to this backend"
        )
    # `{..."outputs":[{"name":"x","datatype":...,"shape":[...],"data":[...]}]}`: the data array ends 3 bytes short.
    return encoded[encoded.index(b'"data":[') + 7 : -3]


def _codec_lead() -> bytes:
    """What the codec's response writer puts before `"outputs":` when given no id and no parameters."""
    empty, _ = encode_response(
        model_name="", model_version="", request_id=None, outputs={}, specs=(), requested=None, binary_default=False
    )
    lead, found, rest = empty.rpartition(b'"outputs":')
    if not (found and rest == b"[]}" and lead.startswith(b"{") and lead.endswith(b",")):
        raise RuntimeError(f"spillway.contract.v2 writes an unexpected response: {empty!r}")
    return lead


_CODEC_LEAD = _codec_lead()
