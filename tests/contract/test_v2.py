"""The V2 tensor codec: round trips, every refusal, fuzzing, and agreement with the real tritonclient."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from spillway.contract import v2 as tensors
from spillway.contract.spec import V2_DATATYPES, TensorSpec
from spillway.contract.v2 import (
    NUMPY_TO_V2,
    V2_TO_NUMPY,
    DecodedRequest,
    InferInput,
    RequestedOutput,
    TensorError,
    decode_request,
    encode_error,
    encode_response,
    validate_inputs,
)

DATATYPES = [name for name in V2_DATATYPES if name in V2_TO_NUMPY]  # BF16 only with ml_dtypes
NUMERIC = [name for name in DATATYPES if name != "BYTES"]

LOADERS: dict[str, Callable[[bytes], Any]] = {"stdlib": tensors._stdlib_loads}
try:
    import orjson

    LOADERS["orjson"] = orjson.loads
except ImportError:
    pass


# --- builders: a second, independent writer and reader of the wire format ------------------------


def wire_dtype(datatype: str) -> np.dtype[Any]:
    dtype = V2_TO_NUMPY[datatype]
    return dtype if datatype in ("BYTES", "BF16") else dtype.newbyteorder("<")


def pack_bytes(array: np.ndarray) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in array.ravel().tolist())


def unpack_bytes(raw: bytes) -> np.ndarray:
    elements, position = [], 0
    while position < len(raw):
        (length,) = struct.unpack_from("<I", raw, position)
        elements.append(raw[position + 4 : position + 4 + length])
        position += 4 + length
    out = np.empty(len(elements), dtype=object)
    out[:] = elements
    return out


def object_array(values: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


def json_input(name: str, datatype: str, array: np.ndarray, *, nested: bool = False) -> dict[str, Any]:
    values = array.tolist() if nested and array.ndim else array.ravel().tolist()
    if datatype == "BYTES":
        values = _map_nested(values, lambda e: e.decode())
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": values}


def _map_nested(values: Any, fn: Callable[[Any], Any]) -> Any:
    return [_map_nested(v, fn) for v in values] if isinstance(values, list) else fn(values)


def binary_input(name: str, datatype: str, array: np.ndarray) -> tuple[dict[str, Any], bytes]:
    raw = pack_bytes(array) if datatype == "BYTES" else array.astype(wire_dtype(datatype)).tobytes()
    params = {"binary_data_size": len(raw)}
    head = {"name": name, "datatype": datatype, "shape": list(array.shape), "parameters": params}
    return head, raw


def make_body(inputs: list[dict[str, Any]], blobs: list[bytes] | None = None, **top: Any) -> tuple[bytes, int | None]:
    head = json.dumps({**top, "inputs": inputs}).encode()
    if blobs is None:
        return head, None
    return head + b"".join(blobs), len(head)


def read_response(body: bytes, header_length: int | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    head = json.loads(body if header_length is None else body[:header_length])
    position = len(body) if header_length is None else header_length
    arrays: dict[str, np.ndarray] = {}
    for output in head["outputs"]:
        datatype = output["datatype"]
        size = output.get("parameters", {}).get("binary_data_size")
        if size is None:
            if datatype == "BYTES":
                array = object_array([s.encode() for s in output["data"]], (len(output["data"]),))
            else:
                array = np.array(output["data"], dtype=V2_TO_NUMPY[datatype])
        else:
            raw = body[position : position + size]
            position += size
            array = unpack_bytes(raw) if datatype == "BYTES" else np.frombuffer(raw, dtype=wire_dtype(datatype))
        arrays[output["name"]] = array.reshape(output["shape"])
    assert position == len(body)
    return head, arrays


def assert_same_array(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.dtype == object
        assert got.ravel().tolist() == want.ravel().tolist()
    else:
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()  # bitwise: -0.0 and NaN payloads survive


def finfo(dtype: np.dtype[Any]) -> Any:
    """numpy's finfo does not know bfloat16; ml_dtypes' does."""
    if dtype.kind == "f":
        return np.finfo(dtype)
    import ml_dtypes

    return ml_dtypes.finfo(dtype)


def sample(datatype: str) -> np.ndarray:
    """A [2, 3] tensor with the edge values of its datatype."""
    if datatype == "BYTES":
        return object_array([b"", b"abc", "h\u00e9llo \u2603".encode(), b"\x00\x01", b"x" * 300, b"last"], (2, 3))
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    dtype = V2_TO_NUMPY[datatype]
    if datatype in ("FP16", "FP32", "FP64", "BF16"):
        info = finfo(dtype)
        values = [float(info.max), -float(info.max), float(info.smallest_subnormal), -0.0, 0.1, math.pi]
        return np.array(values, dtype=np.float64).astype(dtype).reshape(2, 3)
    info_i = np.iinfo(dtype)
    return np.array([info_i.min, info_i.max, 0, 1, info_i.max // 3, info_i.min // 2], dtype=dtype).reshape(2, 3)


@contextmanager
def json_loader(loads: Callable[[bytes], Any]) -> Iterator[None]:
    saved = tensors._json_loads
    tensors._json_loads = loads
    try:
        yield
    finally:
        tensors._json_loads = saved


def decode(body: bytes, header_length: int | None = None, **kwargs: Any) -> DecodedRequest:
    """decode_request under every JSON parser this host has (stdlib, orjson); they must agree."""
    results = []
    for loads in LOADERS.values():
        with json_loader(loads):
            results.append(decode_request(body, header_length, **kwargs))
    first = results[0]
    for other in results[1:]:
        assert (other.id, other.outputs, other.parameters) == (first.id, first.outputs, first.parameters)
        for a, b in zip(first.inputs, other.inputs, strict=True):
            assert (a.name, a.datatype, a.shape) == (b.name, b.datatype, b.shape)
            assert_same_array(b.array, a.array)
    return first


def refusal(body: bytes, header_length: int | None = None, **kwargs: Any) -> list[str]:
    """The TensorError message from every JSON parser; anything else fails the test."""
    messages = []
    for loads in LOADERS.values():
        with json_loader(loads), pytest.raises(TensorError) as info:
            decode_request(body, header_length, **kwargs)
        messages.append(str(info.value))
    return messages


def decode_or_refuse(body: bytes, header_length: int | None, **kwargs: Any) -> None:
    """Decoding may succeed or raise TensorError under every parser; any other exception fails the test."""
    for loads in LOADERS.values():
        with json_loader(loads), suppress(TensorError):
            decode_request(body, header_length, **kwargs)


def respond(outputs: dict[str, np.ndarray], **kwargs: Any) -> tuple[bytes, int | None]:
    specs = tuple(TensorSpec(name, NUMPY_TO_V2.get(a.dtype, "BYTES"), a.shape[1:]) for name, a in outputs.items())
    defaults: dict[str, Any] = {"requested": None, "binary_default": False}
    return encode_response(
        model_name="mlp", model_version="1", request_id="r1", outputs=outputs, specs=specs, **{**defaults, **kwargs}
    )


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("mode", ["json", "nested-json", "binary"])
def test_request_round_trip(datatype: str, mode: str) -> None:
    array = sample(datatype)
    if mode == "binary":
        head, raw = binary_input("pixels", datatype, array)
        body, length = make_body([head], [raw])
    else:
        body, length = make_body([json_input("pixels", datatype, array, nested=mode == "nested-json")])
    decoded = decode(body, length)
    [item] = decoded.inputs
    assert (item.name, item.datatype, item.shape) == ("pixels", datatype, (2, 3))
    assert_same_array(item.array, array)


def test_request_with_several_inputs_mixes_binary_and_json_and_keeps_metadata() -> None:
    a, b, c = sample("FP32"), sample("BYTES"), sample("INT8")
    head_a, raw_a = binary_input("a", "FP32", a)
    head_c, raw_c = binary_input("c", "INT8", c)
    body, length = make_body(
        [head_a, json_input("b", "BYTES", b), head_c],
        [raw_a, raw_c],
        id="req-9",
        parameters={"priority": 2, "timeout": 5000, "binary_data_output": True},
        outputs=[{"name": "y", "parameters": {"binary_data": False}}, {"name": "z"}],
    )
    decoded = decode(body, length)
    assert decoded.id == "req-9"
    assert decoded.parameters == {"priority": 2, "timeout": 5000, "binary_data_output": True}
    assert decoded.binary_output_default is True
    assert decoded.outputs == [RequestedOutput("y", False), RequestedOutput("z", None)]
    for item, want in zip(decoded.inputs, (a, b, c), strict=True):
        assert_same_array(item.array, want)


def test_scalar_and_empty_shapes_decode() -> None:
    body, _ = make_body(
        [
            {"name": "s", "datatype": "FP32", "shape": [], "data": [2.5]},
            {"name": "e", "datatype": "INT32", "shape": [0, 4], "data": []},
            {"name": "n", "datatype": "BYTES", "shape": [2, 0], "data": [[], []]},
        ]
    )
    s, e, n = decode(body).inputs
    assert s.array.shape == () and s.array.dtype == np.float32 and float(s.array) == 2.5
    assert e.array.shape == (0, 4) and e.array.dtype == np.int32
    assert n.array.shape == (2, 0)


def test_binary_input_at_an_odd_offset_is_aligned() -> None:
    array = np.arange(6, dtype=np.float64).reshape(2, 3)
    head, raw = binary_input("x", "FP64", array)
    body, length = make_body([head], [raw], id="odd")
    assert length is not None and length % 8
    [item] = decode(body, length).inputs
    assert item.array.flags.aligned
    assert_same_array(item.array, array)


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("binary", [False, True])
def test_response_round_trip(datatype: str, binary: bool) -> None:
    array = sample(datatype)
    body, length = respond({"scores": array}, binary_default=binary)
    assert (length is not None) == binary
    head, arrays = read_response(body, length)
    assert (head["id"], head["model_name"], head["model_version"]) == ("r1", "mlp", "1")
    assert_same_array(arrays["scores"], array)


def test_response_json_floats_round_trip_exactly() -> None:
    """Fixed-precision printing must give back every bit: all FP16/BF16 values, and random FP32 bit patterns."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    candidates = [bits.view(np.float16)]
    if "BF16" in V2_TO_NUMPY:
        candidates.append(bits.view(V2_TO_NUMPY["BF16"]))
    fp32 = np.random.default_rng(7).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    candidates.append(fp32)
    for values in candidates:
        finite = values[np.isfinite(values.astype(np.float32))].reshape(1, -1)
        body, length = respond({"v": finite})
        assert length is None
        assert_same_array(read_response(body, length)[1]["v"], finite)


def test_response_non_finite_floats_use_json_nan_tokens() -> None:
    array = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype=np.float32)
    body, length = respond({"v": array})
    assert b"NaN" in body and b"-Infinity" in body
    got = read_response(body, length)[1]["v"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, array)


def test_non_utf8_bytes_output_falls_back_to_binary_even_in_json_mode() -> None:
    array = object_array([b"ok", b"\xff\xfe"], (1, 2))
    body, length = respond({"blob": array, "f": np.ones((1, 2), dtype=np.float32)}, binary_default=False)
    assert length is not None
    head, arrays = read_response(body, length)
    blob, f = head["outputs"]
    assert blob["parameters"]["binary_data_size"] == 4 + 2 + 4 + 2
    assert "data" in f
    assert_same_array(arrays["blob"], array)


def test_response_encodes_str_bytes_elements_as_onnxruntime_returns_them() -> None:
    array = np.array([["a", "\u00e9"]], dtype=object)
    for binary in (False, True):
        body, length = respond({"t": array}, binary_default=binary)
        assert read_response(body, length)[1]["t"].tolist() == [[b"a", "\u00e9".encode()]]


def test_requested_outputs_choose_order_subset_and_binary_per_output() -> None:
    outputs = {"a": np.zeros((1, 2), np.float32), "b": np.ones((1, 3), np.int64), "c": np.ones((1, 1), np.bool_)}
    requested = [RequestedOutput("c", None), RequestedOutput("a", False)]
    body, length = respond(outputs, requested=requested, binary_default=True)
    head, arrays = read_response(body, length)
    assert [o["name"] for o in head["outputs"]] == ["c", "a"]
    assert "binary_data_size" in head["outputs"][0]["parameters"] and "data" in head["outputs"][1]
    assert set(arrays) == {"a", "c"}
    assert_same_array(arrays["a"], outputs["a"])

    body, length = respond(outputs)
    assert [o["name"] for o in read_response(body, length)[0]["outputs"]] == ["a", "b", "c"]


def test_response_carries_parameters_and_omits_absent_id() -> None:
    body, length = encode_response(
        model_name="m",
        model_version="2",
        request_id=None,
        outputs={"y": np.zeros((1,), np.float32)},
        specs=(TensorSpec("y", "FP32", ()),),
        requested=None,
        binary_default=False,
        parameters={"sequence_id": 4},
    )
    head = json.loads(body)
    assert "id" not in head and head["parameters"] == {"sequence_id": 4} and length is None


def test_unknown_requested_output_is_refused_by_name() -> None:
    with pytest.raises(TensorError, match=r"output 'nope'.*no such output"):
        respond({"y": np.zeros((1, 2), np.float32)}, requested=[RequestedOutput("nope", None)])


def test_runner_bugs_are_not_client_errors() -> None:
    specs = (TensorSpec("y", "FP32", (2,)),)
    common: dict[str, Any] = {"model_name": "m", "model_version": "1", "request_id": None, "specs": specs}
    with pytest.raises(TypeError, match=r"'y'.*float64.*FP32"):
        encode_response(**common, outputs={"y": np.zeros((1, 2))}, requested=None, binary_default=False)
    with pytest.raises(KeyError):
        encode_response(**common, outputs={}, requested=None, binary_default=False)


def test_encode_error() -> None:
    assert json.loads(encode_error('input "x": bad')) == {"error": 'input "x": bad'}


# --- refusals ------------------------------------------------------------------------------------

INPUT = "pixels"


def one(**fields: Any) -> tuple[bytes, int | None]:
    """A request with one input named INPUT; `fields` override its JSON."""
    return make_body([{"name": INPUT, "datatype": "FP32", "shape": [2], "data": [1.0, 2.0], **fields}])


def binary(datatype: str, shape: list[int], raw: bytes, size: Any = None) -> tuple[bytes, int | None]:
    head = {"name": INPUT, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(raw)}}
    if size is not None:
        head["parameters"]["binary_data_size"] = size
    return make_body([head], [raw])


def raw_body(text: str | bytes, header_length: int | None = None) -> tuple[bytes, int | None]:
    return (text.encode() if isinstance(text, str) else text), header_length


REQUEST_REFUSALS: dict[str, tuple[tuple[bytes, int | None], str]] = {
    "malformed JSON": (raw_body('{"inputs": ['), "request body: malformed JSON"),
    "not UTF-8": (raw_body(b'{"id": "\xff"}'), "request body: malformed JSON"),
    "NaN token": (raw_body('{"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1], "data": [NaN]}]}'),
                  "malformed JSON"),
    "deep nesting": (raw_body("[" * 100_000), "request body"),
    "not an object": (raw_body("[1, 2]"), "request body: the JSON must be an object"),
    "no inputs": (raw_body("{}"), "request body: 'inputs'"),
    "input not an object": (raw_body('{"inputs": [3]}'), "request body: inputs[0]"),
    "input without name": (raw_body('{"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}'),
                           "inputs[0] needs a 'name'"),
    "id not a string": (make_body([], id=7), "request body: 'id'"),
    "parameters not an object": (make_body([], parameters=[1]), "request body: 'parameters'"),
    "binary_data_output not bool": (make_body([], parameters={"binary_data_output": 1}), "binary_data_output"),
    "outputs not a list": (make_body([], outputs={"name": "y"}), "request body: 'outputs'"),
    "output without name": (make_body([], outputs=[{}]), "request body: outputs[0]"),
    "output twice": (make_body([], outputs=[{"name": "y"}, {"name": "y"}]), "output 'y': requested more than once"),
    "output binary_data not bool": (make_body([], outputs=[{"name": "y", "parameters": {"binary_data": "yes"}}]),
                                    "output 'y': parameter 'binary_data'"),
    "classification": (make_body([], outputs=[{"name": "y", "parameters": {"classification": 3}}]),
                       "output 'y': the classification extension"),
    "header length beyond body": (raw_body("{}", 10), "Inference-Header-Content-Length 10"),
    "header length negative": (raw_body("{}", -1), "Inference-Header-Content-Length -1"),
}  # fmt: skip

INPUT_REFUSALS: dict[str, tuple[tuple[bytes, int | None], str]] = {
    "unknown datatype": (one(datatype="FP8"), "unknown datatype 'FP8'"),
    "datatype not a string": (one(datatype=None), "unknown datatype None"),
    "negative dim": (one(shape=[-1, 2]), "non-negative integers"),
    "float dim": (one(shape=[2.0]), "non-negative integers"),
    "bool dim": (one(shape=[True, 2]), "non-negative integers"),
    "string dim": (one(shape=["2"]), "non-negative integers"),
    "shape not a list": (one(shape=2), "'shape'"),
    "rank over 32": (one(shape=[1] * 33), "'shape'"),
    "too many elements": (one(shape=[1 << 14, 1 << 13]), "more than the 67108864 elements"),
    "astronomic shape": (one(shape=[1 << 62] * 32), "more than the"),
    "parameters not an object": (one(parameters=[]), "'parameters' must be an object"),
    "shared memory": (one(parameters={"shared_memory_region": "r"}), "shared memory"),
    "no data": (make_body([{"name": INPUT, "datatype": "FP32", "shape": [2]}]), "neither 'data' nor"),
    "data not an array": (one(data=5), "'data' must be a JSON array"),
    "data and binary": (one(parameters={"binary_data_size": 0}), "both 'data' and"),
    "too few values": (one(shape=[3]), "needs 3 values"),
    "too many values": (one(shape=[1]), "needs 1 values"),
    "nested wrong shape": (one(shape=[2, 3], data=[[1, 2], [3, 4], [5, 6]]), "'data' has shape [3, 2]"),
    "ragged": (one(shape=[2, 2], data=[[1, 2], [3]]), "ragged"),
    "values for an empty shape": (one(shape=[0], data=[1.0]), "holds no values"),
    "string for FP32": (one(data=["1.5", "2"]), "FP32 needs numbers, got strings"),
    "bools for FP32": (one(data=[True, False]), "FP32 needs numbers, got booleans"),
    "null in data": (one(data=[1.0, None]), "FP32 needs numbers, got None"),
    "object in data": (one(data=[1.0, {"a": 1}]), "FP32 needs numbers"),
    "FP32 overflow": (one(data=[1e39, 0]), "out of the FP32 range"),
    "FP16 overflow": (one(datatype="FP16", data=[70000, 0]), "out of the FP16 range"),
    "300 for UINT8": (one(datatype="UINT8", data=[300, 1]), "outside the UINT8 range [0, 255]"),
    "-1 for UINT8": (one(datatype="UINT8", data=[-1, 1]), "outside the UINT8 range"),
    "2**63 for INT64": (one(datatype="INT64", data=[2**63, 1]), "outside the INT64 range"),
    "2**64 for UINT64": (one(datatype="UINT64", data=[2**64, 1]), "UINT64"),
    "float for INT32": (one(datatype="INT32", data=[1.5, 2]), "INT32 needs integers, got non-integer numbers"),
    "string for INT32": (one(datatype="INT32", data=["1", "2"]), "INT32 needs integers, got strings"),
    "numbers for BOOL": (one(datatype="BOOL", data=[1, 0]), "BOOL needs true or false, got integers"),
    "number for BYTES": (one(datatype="BYTES", data=["a", 1]), "BYTES elements in JSON must be strings"),
    "BYTES wrong nesting": (one(datatype="BYTES", shape=[2, 1], data=[["a", "b"]]), "does not match shape [2, 1]"),
    "duplicate input": (make_body([json_input(INPUT, "INT8", np.zeros(2, np.int8))] * 2), "appears more than once"),
    "binary_data_size overruns": (binary("FP32", [2], b"\0" * 8, size=12), "binary_data_size 12 overruns the body"),
    "binary without header length": (raw_body(binary("FP32", [2], b"\0" * 8)[0][:-8]), "overruns the body"),
    "binary_data_size mismatch": (binary("FP32", [3], b"\0" * 8), "binary_data_size is 8 bytes but shape [3]"),
    "binary_data_size negative": (binary("FP32", [2], b"", size=-8), "non-negative integer"),
    "binary_data_size not int": (binary("FP32", [2], b"", size="8"), "non-negative integer"),
    "BOOL byte 2": (binary("BOOL", [2], b"\x01\x02"), "BOOL bytes must be 0 or 1"),
    "BYTES truncated element": (binary("BYTES", [1], struct.pack("<I", 10) + b"abc"), "element 0 declares 10 bytes"),
    "BYTES truncated length": (binary("BYTES", [2], struct.pack("<I", 2) + b"ab\x00\x00"),
                               "element 1 is truncated"),
    "BYTES too small for count": (binary("BYTES", [3], struct.pack("<I", 0) * 2), "cannot hold 3 BYTES elements"),
    "BYTES left over": (binary("BYTES", [1], struct.pack("<I", 1) + b"ab"), "1 bytes left over"),
}  # fmt: skip


@pytest.mark.parametrize("case", REQUEST_REFUSALS)
def test_request_refusals_say_what_is_wrong(case: str) -> None:
    (body, length), expected = REQUEST_REFUSALS[case]
    for message in refusal(body, length):
        assert expected in message


@pytest.mark.parametrize("case", INPUT_REFUSALS)
def test_input_refusals_name_the_input(case: str) -> None:
    (body, length), expected = INPUT_REFUSALS[case]
    for message in refusal(body, length):
        assert f"input '{INPUT}'" in message
        assert expected in message


@pytest.mark.parametrize(
    "text",
    [
        '{"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2], "data": [1e999, 0]}]}',
        '{"inputs": [{"name": "pixels", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}',
    ],
)
def test_values_json_cannot_hold_are_refused_by_either_parser(text: str) -> None:
    """The stdlib parser reads 1e999 as inf and keeps lone surrogates; orjson refuses both while parsing."""
    for message in refusal(text.encode()):
        assert f"input '{INPUT}'" in message or "request body: malformed JSON" in message


def test_unconsumed_binary_data_is_refused() -> None:
    body, length = binary("FP32", [2], b"\0" * 8)
    for message in refusal(body + b"\0", length):
        assert "request body: 1 bytes of binary data" in message


def test_huge_declared_shapes_are_refused_before_allocating() -> None:
    big = 1 << 25  # within the default limit: 256 MiB as FP64 if anything believed it
    cases = [
        one(shape=[big], data=[1.0]),
        binary("FP64", [big], b"\0" * 8),
        binary("BYTES", [big], struct.pack("<I", 0) * 2),
        one(shape=[1 << 40, 1 << 40]),
    ]
    tracemalloc.start()
    try:
        for body, length in cases:
            refusal(body, length)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_max_elements_is_the_callers_limit() -> None:
    body, length = one(shape=[2])
    assert decode(body, length, max_elements=2).inputs[0].shape == (2,)
    assert "more than the 1 elements" in refusal(body, length, max_elements=1)[0]


def test_bf16_without_ml_dtypes_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors, "V2_TO_NUMPY", {k: v for k, v in V2_TO_NUMPY.items() if k != "BF16"})
    body, length = binary("BF16", [1], b"\0\0")
    assert "BF16 needs the ml_dtypes package" in refusal(body, length)[0]


# --- validate_inputs -----------------------------------------------------------------------------

SPECS = (TensorSpec("x", "FP32", (-1, 4)), TensorSpec("mask", "BOOL", (3,)))


def inputs(batch: int = 2, **overrides: np.ndarray) -> list[InferInput]:
    arrays = {"x": np.zeros((batch, 5, 4), np.float32), "mask": np.ones((batch, 3), np.bool_), **overrides}
    return [InferInput(name, NUMPY_TO_V2[a.dtype], a.shape, a) for name, a in arrays.items()]


def test_validate_returns_the_batch_size() -> None:
    assert validate_inputs(inputs(3), SPECS, 8) == 3
    flat = [InferInput("x", "FP32", (5, 4), np.zeros((5, 4), np.float32))]
    assert validate_inputs(flat, (TensorSpec("x", "FP32", (-1, 4)),), 0) == 1


VALIDATION_REFUSALS: dict[str, tuple[list[InferInput], int, str]] = {
    "unknown input": ([*inputs(), InferInput("extra", "FP32", (2,), np.zeros(2, np.float32))], 8,
                      "input 'extra': the model has no such input (it has: mask, x)"),
    "missing input": (inputs()[:1], 8, "input 'mask': missing from the request"),
    "datatype": (inputs(x=np.zeros((2, 5, 4), np.float64)), 8, "input 'x': expected datatype FP32, got FP64"),
    "rank": (inputs(x=np.zeros((2, 4), np.float32)), 8, "input 'x': expected shape [-1, -1, 4], got [2, 4]"),
    "fixed dim": (inputs(x=np.zeros((2, 5, 3), np.float32)), 8, "input 'x': expected shape [-1, -1, 4], got [2, 5, 3]"),
    "batch disagrees": (inputs(mask=np.ones((3, 3), np.bool_)), 8,
                        "input 'mask': batch size 3 disagrees with input 'x' (2)"),
    "batch too big": (inputs(9), 8, "input 'x': batch size 9 is outside 1..8"),
    "batch zero": (inputs(0), 8, "input 'x': batch size 0 is outside 1..8"),
    "unbatched rank": (inputs(), 0, "input 'x': expected shape [-1, 4], got [2, 5, 4]"),
}  # fmt: skip


@pytest.mark.parametrize("case", VALIDATION_REFUSALS)
def test_validate_refusals_say_expected_and_got(case: str) -> None:
    items, max_batch, expected = VALIDATION_REFUSALS[case]
    with pytest.raises(TensorError) as info:
        validate_inputs(items, SPECS, max_batch)
    assert expected in str(info.value)


@pytest.mark.parametrize("datatype", [d for d in ("FP16", "FP32", "FP64", "BF16") if d in V2_TO_NUMPY])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_are_refused_only_when_the_model_says_so(datatype: str, bad: float) -> None:
    array = np.array([[0.0, bad]]).astype(V2_TO_NUMPY[datatype])
    items = [InferInput("v", datatype, (1, 2), array)]
    specs = (TensorSpec("v", datatype, (2,)),)
    assert validate_inputs(items, specs, 4) == 1
    with pytest.raises(TensorError, match="input 'v': holds NaN or Inf"):
        validate_inputs(items, specs, 4, allow_non_finite=False)


# --- properties ----------------------------------------------------------------------------------

BF16_SAFE = float(np.float32(1e38))  # rounds to a finite bfloat16
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def tensors_of(draw: st.DrawFn, datatype: str, *, finite: bool) -> np.ndarray:
    shape = draw(SHAPES)
    if datatype == "BYTES":
        count = math.prod(shape)
        element = TEXT.map(str.encode) if finite else st.binary(max_size=12)
        values = draw(st.lists(element, min_size=count, max_size=count))
        return object_array(values, shape)
    if datatype == "BF16":
        elements = st.floats(-BF16_SAFE, BF16_SAFE, width=32) if finite else st.floats(width=32)
        return draw(hnp.arrays(np.float32, shape, elements=elements)).astype(V2_TO_NUMPY["BF16"])
    dtype = V2_TO_NUMPY[datatype]
    elements = st.floats(width=dtype.itemsize * 8, allow_nan=False, allow_infinity=False) if finite else None
    return draw(hnp.arrays(dtype, shape, elements=elements if dtype.kind == "f" else None))


@st.composite
def wire_requests(draw: st.DrawFn) -> tuple[bytes, int | None, list[tuple[str, str, np.ndarray]]]:
    chosen = draw(st.lists(st.sampled_from(DATATYPES), min_size=1, max_size=3))
    heads, blobs, expected = [], [], []
    for index, datatype in enumerate(chosen):
        as_binary = draw(st.booleans())
        array = draw(tensors_of(datatype, finite=not as_binary))
        name = f"in{index}"
        if as_binary:
            head, raw = binary_input(name, datatype, array)
            heads.append(head)
            blobs.append(raw)
        else:
            heads.append(json_input(name, datatype, array, nested=draw(st.booleans())))
        expected.append((name, datatype, array))
    body, length = make_body(heads, blobs if blobs else None)
    return body, length, expected


@settings(max_examples=150, deadline=None)
@given(wire_requests())
def test_property_requests_round_trip(drawn: tuple[bytes, int | None, list[tuple[str, str, np.ndarray]]]) -> None:
    body, length, expected = drawn
    decoded = decode(body, length)
    for item, (name, datatype, array) in zip(decoded.inputs, expected, strict=True):
        assert (item.name, item.datatype, item.shape) == (name, datatype, array.shape)
        assert_same_array(item.array, array)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_property_responses_round_trip(data: st.DataObject) -> None:
    datatype = data.draw(st.sampled_from(DATATYPES))
    as_binary = data.draw(st.booleans())
    array = data.draw(tensors_of(datatype, finite=not as_binary))
    body, length = respond({"out": array}, binary_default=as_binary)
    got = read_response(body, length)[1]["out"]
    assert_same_array(got, array)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(-3, 210)))
def test_property_garbage_raises_only_tensor_error(body: bytes, length: int | None) -> None:
    decode_or_refuse(body, length)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["x", ""]) | JSON_VALUES,
            "datatype": st.sampled_from(V2_DATATYPES) | JSON_VALUES,
            "shape": st.lists(st.integers(-2, 5), max_size=3) | JSON_VALUES,
            "data": JSON_VALUES,
            "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-2, 40) | JSON_VALUES})
            | JSON_VALUES,
        },
    ),
    st.binary(max_size=40),
    st.booleans(),
)
def test_property_hostile_json_raises_only_tensor_error(fields: dict[str, Any], tail: bytes, with_length: bool) -> None:
    head = json.dumps({"inputs": [fields], "outputs": [{"name": "y"}]}).encode()
    body, length = (head + tail, len(head)) if with_length else (head, None)
    decode_or_refuse(body, length, max_elements=1000)


@settings(max_examples=200, deadline=None)
@given(wire_requests(), st.data())
def test_property_corrupted_bodies_raise_only_tensor_error(
    drawn: tuple[bytes, int | None, list[Any]], data: st.DataObject
) -> None:
    body, length, _ = drawn
    mutable = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        if not mutable:
            break
        position = data.draw(st.integers(0, len(mutable) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "drop"]))
        if action == "flip":
            mutable[position] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "cut":
            del mutable[position:]
        else:
            del mutable[position]
    decode_or_refuse(bytes(mutable), length)


# --- the real tritonclient -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton() -> Any:
    return pytest.importorskip("tritonclient.http")


def client_cases() -> list[tuple[str, bool]]:
    # tritonclient sends BF16 only as binary.
    return [(d, b) for d in DATATYPES for b in (False, True) if b or d != "BF16"]


@pytest.mark.parametrize(("datatype", "binary_data"), client_cases())
def test_tritonclient_requests_decode(triton: Any, datatype: str, binary_data: bool) -> None:
    array = sample(datatype)
    first = triton.InferInput("pixels", list(array.shape), datatype)
    first.set_data_from_numpy(array, binary_data=binary_data)
    second = triton.InferInput("ids", [1, 3], "INT64")
    second.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int64), binary_data=not binary_data)
    outputs = [triton.InferRequestedOutput("scores", binary_data=binary_data)]
    body, json_size = triton.InferenceServerClient.generate_request_body(
        [first, second], outputs=outputs, request_id="req-1", priority=2, timeout=1500
    )
    decoded = decode(body, json_size)
    assert decoded.id == "req-1"
    assert decoded.parameters == {"priority": 2, "timeout": 1500}
    assert decoded.outputs == [RequestedOutput("scores", binary_data)]
    assert decoded.binary_output_default is False
    assert [i.name for i in decoded.inputs] == ["pixels", "ids"]
    assert_same_array(decoded.inputs[0].array, array)
    assert_same_array(decoded.inputs[1].array, np.array([[1, 2, 3]], dtype=np.int64))


def test_tritonclient_without_outputs_asks_for_binary(triton: Any) -> None:
    item = triton.InferInput("pixels", [1, 2], "FP32")
    item.set_data_from_numpy(np.ones((1, 2), np.float32))
    body, json_size = triton.InferenceServerClient.generate_request_body([item])
    decoded = decode(body, json_size)
    assert decoded.outputs is None and decoded.binary_output_default is True


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("binary_data", [False, True])
def test_tritonclient_reads_responses(triton: Any, datatype: str, binary_data: bool) -> None:
    array = sample(datatype)
    extra = np.arange(5, dtype=np.int32).reshape(1, 5)
    body, length = respond(
        {"scores": array, "extra": extra},
        requested=[RequestedOutput("scores", binary_data), RequestedOutput("extra", not binary_data)],
    )
    result = triton.InferResult.from_response_body(body, verbose=False, header_length=length)
    got = result.as_numpy("scores")
    if datatype == "BYTES" and not binary_data:  # JSON BYTES reach the client as str, as from Triton
        got = object_array([s.encode() for s in got.ravel().tolist()], got.shape)
    assert_same_array(got, array)
    np.testing.assert_array_equal(result.as_numpy("extra"), extra)
    assert result.get_response()["id"] == "r1"


def test_tritonclient_reads_fallback_bytes_and_non_finite_json(triton: Any) -> None:
    blob = object_array([b"\xff", b"ok"], (1, 2))
    floats = np.array([[np.nan, np.inf, -1.0]], dtype=np.float32)
    body, length = respond({"blob": blob, "floats": floats}, binary_default=False)
    result = triton.InferResult.from_response_body(body, verbose=False, header_length=length)
    assert result.as_numpy("blob").tolist() == [[b"\xff", b"ok"]]
    np.testing.assert_array_equal(result.as_numpy("floats"), floats)
