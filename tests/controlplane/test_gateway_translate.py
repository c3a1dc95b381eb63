"""The gateway's translation for JSON-only backends, checked against tritonclient's own encoder and decoder.

Requests are built by `tritonclient.http` (binary or JSON tensors), translated, answered by a JSON-only backend
(a small echo written here with Python's json, or a real MLServer), translated back, and read by
`tritonclient.http.InferResult`: every array must come back bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import triton_to_np_dtype

from controlplane.gateway.translate import BinaryOutputs, TranslationError, request_to_json, response_from_json
from spillway.contract.v2 import RequestedOutput, decode_request
from spillway.demo.models import build_demo_repository
from tests.utils.mlserver import running_mlserver

SAMPLES: dict[str, list[Any]] = {  # six values each, the type's edges included; shaped [2, 3] (a batch of 2)
    "BOOL": [True, False, True, True, False, False],
    "UINT8": [0, 1, 127, 128, 254, 255],
    "UINT16": [0, 1, 255, 256, 65534, 65535],
    "UINT32": [0, 1, 2**16, 2**31, 2**32 - 2, 2**32 - 1],
    "UINT64": [0, 1, 2**32, 2**63, 2**64 - 2, 2**64 - 1],
    "INT8": [-128, -1, 0, 1, 126, 127],
    "INT16": [-(2**15), -1, 0, 1, 2**15 - 2, 2**15 - 1],
    "INT32": [-(2**31), -1, 0, 1, 2**31 - 2, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 1, 2**63 - 2, 2**63 - 1],
    "FP16": [-65504.0, -0.0, 2**-24, 0.1, 1 / 3, 65504.0],
    "FP32": [-3.4028235e38, -0.0, 1e-45, 0.1, 1 / 3, 16777216.0],
    "FP64": [-1.7976931348623157e308, -0.0, 5e-324, 0.1, 1 / 3, 2.0**53 + 2],
    "BF16": [-3.3895314e38, -0.0, 9.2e-41, 0.1, 1 / 3, 257.0],
    "BYTES": [b"", b"plain", "\u00e9\u20ac\U0001f600".encode(), b'"quoted" \\ back', b"\x00nul", b"tab\t"],
}


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    values = SAMPLES[datatype]
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array.reshape(shape)
    return np.array(values, dtype=triton_to_np_dtype(datatype)).reshape(shape)


def tensor_input(name: str, array: np.ndarray, datatype: str, *, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def assert_same(got: np.ndarray | None, want: np.ndarray) -> None:
    """Equal shape and values, bit for bit for numbers (-0.0 included); BYTES read from JSON come back as str."""
    assert got is not None
    assert got.shape == want.shape
    if want.dtype == object:
        assert [g.encode() if isinstance(g, str) else g for g in got.ravel()] == list(want.ravel())
    else:
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


def as_backend_reads(body: bytes) -> dict[str, np.ndarray]:
    """The inputs of a pure JSON request as a JSON-only backend reads them (strict JSON, no binary part)."""
    doc = json.loads(body, parse_constant=lambda token: pytest.fail(f"{token} in the JSON"))
    arrays = {}
    for tensor in doc["inputs"]:
        assert "binary_data_size" not in tensor.get("parameters", {})
        if tensor["datatype"] == "BYTES":
            array = np.empty(len(tensor["data"]), dtype=object)
            array[:] = [s.encode() for s in tensor["data"]]
        else:
            array = np.array(tensor["data"], dtype=triton_to_np_dtype(tensor["datatype"]))
        arrays[tensor["name"]] = array.reshape(tensor["shape"])
    return arrays


def echo_backend(body: bytes, **top: Any) -> bytes:
    """A JSON-only backend: answers each requested output (all, when none is named) with the input of its name."""
    assert b"binary_data" not in body
    doc = json.loads(body)
    inputs = {tensor["name"]: tensor for tensor in doc["inputs"]}
    names = [output["name"] for output in doc.get("outputs", [])] or list(inputs)
    outputs = [
        {
            "name": name,
            "datatype": inputs[name]["datatype"],
            "shape": inputs[name]["shape"],
            "parameters": {"content_type": "np"},  # as MLServer writes them
            "data": inputs[name]["data"],
        }
        for name in names
    ]
    answer = {"model_name": "echo", "model_version": "1", **top, "outputs": outputs}
    if "id" in doc:
        answer["id"] = doc["id"]
    return json.dumps(answer).encode()


def round_trip(body: bytes, header_length: int | None, **top: Any) -> triton.InferResult:
    translated = request_to_json(body, header_length)
    answer, answer_length = response_from_json(echo_backend(translated.body, **top), translated)
    return triton.InferResult.from_response_body(answer, header_length=answer_length)


@pytest.mark.parametrize(
    ("datatype", "binary_in", "binary_out"),
    [
        (datatype, binary_in, binary_out)
        for datatype in SAMPLES
        for binary_in, binary_out in [(True, True), (True, False), (False, True)]
        if binary_in or datatype != "BF16"  # tritonclient sends BF16 inputs in binary only
    ],
)
def test_every_datatype_round_trips(datatype: str, binary_in: bool, binary_out: bool) -> None:
    array = sample(datatype)
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("t", array, datatype, binary=binary_in)], [triton.InferRequestedOutput("t", binary_out)]
    )
    translated = request_to_json(body, header_length)
    assert_same(as_backend_reads(translated.body)["t"], array)

    answer, answer_length = response_from_json(echo_backend(translated.body), translated)
    assert (answer_length is not None) == binary_out
    result = triton.InferResult.from_response_body(answer, header_length=answer_length)
    assert_same(result.as_numpy("t"), array)
    output = result.get_output("t")
    assert ("binary_data_size" in output.get("parameters", {})) == binary_out


def test_translated_request_is_what_the_codec_decodes_from_the_original() -> None:
    inputs = {datatype: sample(datatype, (1, 2, 3)) for datatype in SAMPLES}
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input(name, array, name, binary=True) for name, array in inputs.items()]
    )
    original = decode_request(body, header_length)
    translated = decode_request(request_to_json(body, header_length).body, None)
    assert [t.name for t in translated.inputs] == list(inputs)
    for before, after in zip(original.inputs, translated.inputs, strict=True):
        assert (after.datatype, after.shape) == (before.datatype, before.shape)
        assert_same(after.array, inputs[before.name])


def test_mixed_inputs_keep_their_order_and_json_inputs_pass_as_they_came() -> None:
    a, b, c = sample("FP32"), sample("INT64"), sample("BYTES")
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [
            tensor_input("a", a, "FP32", binary=True),
            tensor_input("b", b, "INT64", binary=False),
            tensor_input("c", c, "BYTES", binary=True),
        ],
        [triton.InferRequestedOutput(name, binary_data=True) for name in "abc"],
    )
    translated = request_to_json(body, header_length)
    sent = json.loads(body[:header_length])
    doc = json.loads(translated.body)
    assert [tensor["name"] for tensor in doc["inputs"]] == ["a", "b", "c"]
    assert doc["inputs"][1] == sent["inputs"][1]
    assert "parameters" not in doc["inputs"][0] and "parameters" not in doc["inputs"][2]
    seen = as_backend_reads(translated.body)
    for name, array in {"a": a, "b": b, "c": c}.items():
        assert_same(seen[name], array)


def test_outputs_come_back_binary_or_json_each_as_requested_and_in_the_requested_order() -> None:
    x, y, z = sample("FP32"), sample("UINT8"), sample("BYTES")
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [
            tensor_input("x", x, "FP32", binary=True),
            tensor_input("y", y, "UINT8", binary=True),
            tensor_input("z", z, "BYTES", binary=True),
        ],
        [
            triton.InferRequestedOutput("z", binary_data=True),
            triton.InferRequestedOutput("x", binary_data=False),
            triton.InferRequestedOutput("y", binary_data=True),
        ],
    )
    translated = request_to_json(body, header_length)
    assert translated.binary_outputs == BinaryOutputs(
        (RequestedOutput("z", True), RequestedOutput("x", False), RequestedOutput("y", True)), False
    )
    assert json.loads(translated.body)["outputs"] == [{"name": "z"}, {"name": "x"}, {"name": "y"}]

    result = round_trip(body, header_length)
    outputs = result.get_response()["outputs"]
    assert [o["name"] for o in outputs] == ["z", "x", "y"]
    assert outputs[0]["parameters"] == {"binary_data_size": sum(4 + len(s) for s in SAMPLES["BYTES"])}
    assert "data" in outputs[1] and "parameters" not in outputs[1]
    assert outputs[2]["parameters"] == {"binary_data_size": y.nbytes}
    for name, array in {"x": x, "y": y, "z": z}.items():
        assert_same(result.as_numpy(name), array)


def test_with_no_outputs_named_the_request_default_applies_to_every_output() -> None:
    a, b = sample("FP64"), sample("BOOL")
    # tritonclient sets parameters.binary_data_output when no output is named
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("a", a, "FP64", binary=False), tensor_input("b", b, "BOOL", binary=False)]
    )
    assert header_length is None and json.loads(body)["parameters"] == {"binary_data_output": True}
    translated = request_to_json(body, header_length)
    assert translated.binary_outputs == BinaryOutputs(None, True)
    assert "parameters" not in json.loads(translated.body)

    result = round_trip(body, header_length)
    outputs = result.get_response()["outputs"]
    assert [o["parameters"] for o in outputs] == [{"binary_data_size": a.nbytes}, {"binary_data_size": b.nbytes}]
    assert_same(result.as_numpy("a"), a)
    assert_same(result.as_numpy("b"), b)


def test_an_output_without_its_own_choice_follows_the_request_default() -> None:
    request = {
        "inputs": [
            {"name": "a", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]},
            {"name": "b", "shape": [2], "datatype": "FP32", "data": [0.5, -1.5]},
        ],
        "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}],
        "parameters": {"binary_data_output": True},
    }
    translated = request_to_json(orjson.dumps(request), None)
    assert json.loads(translated.body)["outputs"] == [{"name": "a"}, {"name": "b"}]
    assert translated.binary_outputs.wanted

    answer, header_length = response_from_json(echo_backend(translated.body), translated)
    result = triton.InferResult.from_response_body(answer, header_length=header_length)
    a, b = result.get_response()["outputs"]
    assert a["parameters"] == {"binary_data_size": 16} and "data" not in a
    assert b["data"] == [0.5, -1.5] and "parameters" not in b
    assert_same(result.as_numpy("a"), np.array([[1, 2], [3, 4]], dtype=np.int32))


def test_request_fields_pass_unchanged_but_the_binary_ones() -> None:
    x = sample("FP16", (3, 2))
    tensor = tensor_input("x", x, "FP16", binary=True)
    tensor._parameters["content_type"] = "np"  # a tensor parameter some backends read (MLServer's codecs)
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor],
        [triton.InferRequestedOutput("x", binary_data=True)],
        request_id="req-7",
        priority=2,
        timeout=5000,
        parameters={"tenant": "acme"},
    )
    doc = json.loads(request_to_json(body, header_length).body)
    assert doc["id"] == "req-7"
    assert doc["parameters"] == {"priority": 2, "timeout": 5000, "tenant": "acme"}
    assert doc["inputs"][0]["parameters"] == {"content_type": "np"}
    assert (doc["inputs"][0]["name"], doc["inputs"][0]["shape"], doc["inputs"][0]["datatype"]) == ("x", [3, 2], "FP16")


def test_answer_keeps_the_backends_id_model_version_and_parameters() -> None:
    x = sample("INT16")
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("x", x, "INT16", binary=True)], request_id="abc"
    )
    result = round_trip(body, header_length, model_version="7", parameters={"sequence_id": 3, "note": "é"})
    response = result.get_response()
    assert {k: v for k, v in response.items() if k != "outputs"} == {
        "model_name": "echo",
        "model_version": "7",
        "parameters": {"sequence_id": 3, "note": "é"},
        "id": "abc",
    }
    assert_same(result.as_numpy("x"), x)


def test_an_answer_with_nothing_but_outputs_still_gets_its_binary_part() -> None:
    translated = request_to_json(b'{"inputs":[],"parameters":{"binary_data_output":true}}', None)
    answer = b'{"outputs":[{"name":"o","datatype":"UINT16","shape":[2],"data":[1,65535]}]}'
    body, header_length = response_from_json(answer, translated)
    result = triton.InferResult.from_response_body(body, header_length=header_length)
    assert set(result.get_response()) == {"outputs"}
    assert_same(result.as_numpy("o"), np.array([1, 65535], dtype=np.uint16))


def test_pure_json_stays_as_it_is_both_ways() -> None:
    body = b'{"id":"j","inputs":[{"name":"t","shape":[2],"datatype":"FP32","data":[0.25,-2]}],"outputs":[{"name":"t"}]}'
    translated = request_to_json(body, None)
    assert translated.body is body
    assert not translated.binary_outputs.wanted
    answer = echo_backend(translated.body)
    assert response_from_json(answer, translated) == (answer, None)


def test_binary_data_false_everywhere_is_dropped_and_the_answer_stays_json() -> None:
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("t", sample("UINT32"), "UINT32", binary=False)],
        [triton.InferRequestedOutput("t", binary_data=False)],
    )
    translated = request_to_json(body, header_length)
    assert b"binary_data" not in translated.body
    answer = echo_backend(translated.body)
    assert response_from_json(answer, translated) == (answer, None)


def test_binary_keys_spelled_with_escapes_are_still_taken_out() -> None:
    body = (
        b'{"inputs":[{"name":"t","shape":[1],"datatype":"INT8","data":[3],'
        b'"parameters":{"binary\\u005fdata_size":null,"content_type":"np"}}],'
        b'"parameters":{"binary\\u005fdata_output":true}}'
    )
    translated = request_to_json(body, None)
    assert json.loads(translated.body) == {
        "inputs": [{"name": "t", "shape": [1], "datatype": "INT8", "data": [3], "parameters": {"content_type": "np"}}]
    }
    assert translated.binary_outputs == BinaryOutputs(None, True)


SHORT_BINARY = b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}\0\0\0\0'


@pytest.mark.parametrize(
    ("body", "header_length", "message"),
    [
        (b"{not json", None, "request body: malformed JSON"),
        (b"[]", None, "request body: the JSON must be an object"),
        (b'{"inputs":{}}', None, "request body: 'inputs' must be an array"),
        (b'{"inputs":[]}', 99, "Inference-Header-Content-Length 99 is outside the body"),
        (SHORT_BINARY, None, "request body: malformed JSON"),
        (SHORT_BINARY, len(SHORT_BINARY) - 4, "input 'x': binary_data_size 8 overruns the body (4 bytes remain)"),
        (b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP8","data":[1]}]}', None, "input 'x': unknown datatype"),
        (b'{"inputs":[{"name":"x","shape":[3],"datatype":"INT8","data":[1,2]}]}', None, "input 'x': 'data' has shape"),
        (b'{"inputs":[{"name":"x","shape":[1],"datatype":"UINT8","data":[256]}]}', None, "outside the UINT8 range"),
        (b'{"inputs":[{"name":"x","shape":[1],"datatype":"BOOL","data":[1]}]}', None, "BOOL needs true or false"),
        (
            b'{"inputs":[{"name":"x","shape":[1],"datatype":"INT8","data":[1]}],"outputs":[{"name":"y",'
            b'"parameters":{"binary_data":"yes"}}]}',
            None,
            "output 'y': parameter 'binary_data' must be true or false",
        ),
        (b'{"inputs":[],"parameters":{"binary_data_output":1}}', None, "'binary_data_output' must be true or false"),
    ],
)
def test_a_malformed_request_is_refused_with_what_is_wrong(
    body: bytes, header_length: int | None, message: str
) -> None:
    with pytest.raises(TranslationError) as refused:
        request_to_json(body, header_length)
    assert message in str(refused.value)


def test_extra_binary_bytes_are_refused() -> None:
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("x", sample("INT32"), "INT32", binary=True)]
    )
    with pytest.raises(TranslationError, match="4 bytes of binary data after the JSON belong to no input"):
        request_to_json(body + b"\0\0\0\0", header_length)


def test_bytes_that_are_not_utf8_cannot_go_to_a_json_backend() -> None:
    array = np.array([b"ok", b"\xff\xfe"], dtype=object)
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("blob", array, "BYTES", binary=True)]
    )
    with pytest.raises(TranslationError, match="input 'blob': BYTES elements that are not UTF-8 cannot be sent"):
        request_to_json(body, header_length)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_floats_cannot_go_to_a_json_backend(value: float) -> None:
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("x", np.array([1.0, value], dtype=np.float32), "FP32", binary=True)]
    )
    with pytest.raises(TranslationError, match="input 'x': NaN and Infinity cannot be sent as JSON"):
        request_to_json(body, header_length)


def binary_request_for(*names: str) -> bytes:
    outputs = ",".join(f'{{"name":"{name}","parameters":{{"binary_data":true}}}}' for name in names)
    return f'{{"inputs":[],"outputs":[{outputs}]}}'.encode()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"<html>502</html>", "backend response: malformed JSON"),
        (b'{"outputs":[{"name":"o","datatype":"FP32","shape":[1],"data":[NaN]}]}', "backend response: malformed JSON"),
        (b'["outputs"]', "backend response: the JSON must be an object"),
        (b'{"model_name":"m","error":"boom"}', "backend response: 'outputs' must be an array"),
        (b'{"outputs":[7]}', "backend response: outputs[0] must be an object"),
        (b'{"outputs":[{"name":"o","datatype":"FP32","shape":[2],"data":[1.0]}]}', "output 'o': 'data' has shape"),
        (b'{"outputs":[{"name":"o","datatype":"FP33","shape":[1],"data":[1.0]}]}', "output 'o': unknown datatype"),
        (b'{"outputs":[{"name":"o","datatype":"INT8","shape":[1],"data":["a"]}]}', "output 'o': INT8 needs integers"),
        (
            b'{"outputs":[{"name":"o","datatype":"INT8","shape":[1],"parameters":{"binary_data_size":1}}]}',
            "output 'o': binary_data_size 1 overruns the body",
        ),
        (
            b'{"outputs":[{"name":"o","datatype":"INT8","shape":[1],"data":[1]},'
            b'{"name":"o","datatype":"INT8","shape":[1],"data":[1]}]}',
            "output 'o' appears more than once",
        ),
        (
            b'{"outputs":[{"name":"p","datatype":"INT8","shape":[1],"data":[1]}]}',
            "backend response: output 'o': the model has no such output (it has: p)",
        ),
    ],
)
def test_an_invalid_backend_answer_is_refused_with_what_is_wrong(answer: bytes, message: str) -> None:
    translated = request_to_json(binary_request_for("o"), None)
    with pytest.raises(TranslationError) as refused:
        response_from_json(answer, translated)
    assert message in str(refused.value)


def test_an_invalid_answer_is_refused_even_when_the_client_wants_json() -> None:
    translated = request_to_json(b'{"inputs":[]}', None)
    with pytest.raises(TranslationError, match="output 'o': 'data' has shape"):
        response_from_json(b'{"outputs":[{"name":"o","datatype":"FP32","shape":[2],"data":[1.0]}]}', translated)


# ---- MLServer, a real JSON-only backend -------------------------------------------------------------


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """MLServer serving the demo model `mlp` v1 (its environment is made on first use: a minute or two)."""
    repo = build_demo_repository(tmp_path_factory.mktemp("models"))
    with running_mlserver(repo, tmp_path_factory.mktemp("mlserver")) as url:
        yield url, repo / "mlp" / "1" / "model.onnx"


@pytest.mark.slow
@pytest.mark.parametrize("outputs", ["binary", "json", "request default"])
def test_mlserver_answers_a_translated_binary_request(mlserver: tuple[str, Path], outputs: str) -> None:
    url, model = mlserver
    x = np.random.default_rng(7).standard_normal((3, 512), dtype=np.float32)
    options = ort.SessionOptions()  # as MLServer's runtime (bench/mlserver/runtime.py) runs it
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    expected = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    requested = None if outputs == "request default" else [triton.InferRequestedOutput("output", outputs == "binary")]
    body, header_length = triton.InferenceServerClient.generate_request_body(
        [tensor_input("input", x, "FP32", binary=True)], requested, request_id="probe-1"
    )

    translated = request_to_json(body, header_length)
    answer = httpx.post(
        f"{url}/v2/models/mlp/infer",
        content=translated.body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    result_body, result_length = response_from_json(answer.content, translated)

    result = triton.InferResult.from_response_body(result_body, header_length=result_length)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("mlp", "1", "probe-1")
    output = result.get_output("output")
    if outputs == "json":
        assert result_length is None and "data" in output
    else:
        assert output["parameters"] == {"binary_data_size": expected.nbytes}
    np.testing.assert_array_equal(result.as_numpy("output"), expected)


@pytest.mark.slow
def test_mlserver_behind_the_gateway_answers_tritonclient_like_onnxruntime(
    mlserver: tuple[str, Path], tmp_path: Path
) -> None:
    """The whole path: tritonclient (binary tensors) -> the control plane's gateway -> MLServer registered with
    `binary_tensors: false` (JSON translation both ways) -> tritonclient reads the answer in binary."""
    from tests.utils.gateway import running_plane

    url, model = mlserver
    x = np.random.default_rng(11).standard_normal((2, 512), dtype=np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    expected = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    with running_plane(f"sqlite:///{tmp_path / 'cp.db'}") as plane:
        plane.register(url, name="mlserver", binary_tensors=False)
        client = triton.InferenceServerClient(plane.url.removeprefix("http://"))
        result = client.infer(
            "mlp", [tensor_input("input", x, "FP32", binary=True)],
            outputs=[triton.InferRequestedOutput("output", binary_data=True)], headers=plane.agent,
        )  # fmt: skip
        np.testing.assert_array_equal(result.as_numpy("output"), expected)
        assert result.get_output("output")["parameters"] == {"binary_data_size": expected.nbytes}
        assert plane.gateway()["mlserver"]["requests"] == 1
