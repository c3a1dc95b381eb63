"""The overflow gateway on loopback: a real control plane, faulty V2 backends as separate processes, an enrolled
agent's token. Failures are switched on in the backends; what the client sees, what the backends received, the
events, /metrics and /api/v1/status are checked."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.utils.gateway import MLP_REQUEST, Faulty, Plane, running_plane, start_faulty, wait_for


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Faulty]]:
    started = {name: start_faulty(name) for name in ("alpha", "beta")}
    yield started
    for faulty in started.values():
        faulty.proc.kill()
        faulty.proc.wait(timeout=10)


@pytest.fixture
def alpha(backends: dict[str, Faulty]) -> Faulty:
    backends["alpha"].set(mode="ok", ready=True)
    return backends["alpha"]


@pytest.fixture
def beta(backends: dict[str, Faulty]) -> Faulty:
    backends["beta"].set(mode="ok", ready=True)
    return backends["beta"]


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    with running_plane(f"sqlite:///{tmp_path / 'gw.db'}") as running:
        yield running


def sample(plane: Plane, name: str, **labels: str) -> float:
    """One sample of the control plane's /metrics, 0 when absent."""
    for family in text_string_to_metric_families(plane.get("/metrics")):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_forwards_the_body_unchanged_and_says_which_backend_answered(plane: Plane, alpha: Faulty) -> None:
    created = plane.register(alpha.url, auth_header="Bearer cloud-secret")  # at once: no wait for a refresh
    before = alpha.stats()["infer"]
    response = plane.infer(MLP_REQUEST, **{"spillway-timeout-us": "2000000"})
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "alpha" and response.json()["outputs"][0]["name"] == "output"
    assert response.headers["spillway-backend"] == created["name"]
    assert response.headers["spillway-backend-id"] == created["id"]
    assert response.headers["spillway-attempts"] == "1"
    seen = alpha.stats()
    assert seen["infer"] == before + 1 and seen["last_body_bytes"] == len(MLP_REQUEST)
    assert seen["last_headers"]["authorization"] == "Bearer cloud-secret"  # the backend's, not the agent's
    assert 1_000_000 < int(seen["last_headers"]["spillway-timeout-us"]) <= 2_000_000  # what is left of the deadline
    # The versioned path goes to the same path on the backend.
    versioned = plane.client.post(f"{plane.url}/v2/models/mlp/versions/2/infer", content=MLP_REQUEST,
                                  headers=plane.agent)  # fmt: skip
    assert versioned.status_code == 200


def test_only_agent_tokens_pass(plane: Plane, alpha: Faulty) -> None:
    plane.register(alpha.url)
    url = f"{plane.url}/v2/models/mlp/infer"
    for headers in ({}, {"Authorization": "Bearer spa_0000000000000000_wrong"}, {"Authorization": "Basic eDp5"}):
        refused = plane.client.post(url, content=MLP_REQUEST, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.headers["spillway-reason"] == "unauthenticated"
        assert set(refused.json()) == {"error", "message", "details"} and refused.json()["error"] == "unauthenticated"
    forbidden = plane.client.post(url, content=MLP_REQUEST, headers=plane.operator)
    assert forbidden.status_code == 403 and forbidden.json()["error"] == "forbidden"
    assert "agent" in forbidden.json()["message"]
    assert plane.infer().status_code == 200
    assert sample(plane, "spillway_gateway_rejected_total", reason="unauthenticated") == 3


def test_a_deleted_agent_passes_until_the_cache_forgets_it(tmp_path: Path, alpha: Faulty) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'ttl.db'}", gateway_auth_ttl_s=0.5) as plane:
        plane.register(alpha.url)
        assert plane.infer().status_code == 200
        agent_id = plane.token.split("_")[1]
        deleted = plane.client.delete(f"{plane.url}/api/v1/agents/{agent_id}", headers=plane.operator)
        assert deleted.status_code == 204
        assert plane.infer().status_code == 200  # still cached
        wait_for(lambda: plane.infer().status_code == 401, timeout_s=5)


def test_bad_input_is_refused_with_a_reason(tmp_path: Path, alpha: Faulty) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'bad.db'}", max_body_bytes=4096) as plane:
        plane.register(alpha.url)
        before = alpha.stats()["infer"]
        cases = [
            (plane.infer(model="bert"), 503, "no_backend", "'bert'"),
            (plane.infer(b"x" * 5000), 413, "payload_too_large", "4096"),
            (plane.infer(b'{"inputs": ['), 400, "invalid_request", "not valid JSON"),
            (plane.infer(b'{"inputs": [], "parameters": {"timeout": "soon"}}'), 400, "invalid_request", "'timeout'"),
            (plane.infer(**{"spillway-timeout-us": "later"}), 400, "invalid_request", "spillway-timeout-us"),
            (plane.infer(**{"inference-header-content-length": "9999"}), 400, "invalid_request",
             "inference-header-content-length"),
        ]  # fmt: skip
        for response, status, code, named in cases:
            assert response.status_code == status, (code, response.text)
            assert response.json()["error"] == code and named in response.json()["message"], response.text
            assert response.headers["spillway-reason"] == code
        # A streamed body over the limit (no Content-Length) is refused too.
        chunks = (b"x" * 1024 for _ in range(8))
        streamed = plane.client.post(f"{plane.url}/v2/models/mlp/infer", content=chunks, headers=plane.agent)
        assert streamed.status_code == 413
        assert alpha.stats()["infer"] == before  # none of them reached the backend


def test_a_model_name_no_backend_can_register_is_400_naming_it(plane: Plane, alpha: Faulty) -> None:
    """A NUL or another control character in the model name (or any name outside the rule a backend's models must
    follow) names nothing that could ever be served: 400 invalid_model_name, not 503 no_backend; after the token."""
    plane.register(alpha.url)
    before = alpha.stats()["infer"]
    for model in ("m%00", "mlp%00x", "ml%0Ap", "%1Bmlp", "mlp%7F", "has%20space", "-mlp", "x" * 129):
        for path in (f"/v2/models/{model}/infer", f"/v2/models/{model}/versions/1/infer"):
            response = plane.client.post(f"{plane.url}{path}", content=MLP_REQUEST, headers=plane.agent)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"] == "invalid_model_name", response.text
            assert response.json()["message"].startswith("model: "), response.text
            assert response.headers["spillway-reason"] == "invalid_model_name"
        assert plane.client.post(f"{plane.url}/v2/models/{model}/infer", content=MLP_REQUEST).status_code == 401
    assert plane.infer(model="bert").json()["error"] == "no_backend"  # a valid name nobody serves
    assert alpha.stats()["infer"] == before  # none of them reached the backend
    assert plane.infer().status_code == 200


def test_retries_on_another_backend_and_ejects_after_five_failures(tmp_path: Path, alpha: Faulty, beta: Faulty) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'eject.db'}", gateway_base_ejection_s=0.5) as plane:
        a = plane.register(alpha.url)
        b = plane.register(beta.url)
        alpha.set(mode="status", status=503)
        attempts: Counter[str] = Counter()
        for _ in range(200):
            # A generous deadline: what is tested is where a request goes, not how fast (a busy CI machine stalls).
            response = plane.infer(**{"spillway-timeout-us": "20000000"})
            assert response.status_code == 200, response.text  # every one answered, by beta
            assert response.headers["spillway-backend"] == b["name"]
            attempts[response.headers["spillway-attempts"]] += 1
            if plane.gateway()[a["name"]]["ejected"]:
                break
        assert attempts["2"] == 5, attempts  # alpha was tried five times, then ejected
        [ejected] = wait_for(lambda: plane.events("backend.ejected"))
        assert ejected["subject_id"] == a["id"] and ejected["actor"] == "gateway"
        assert ejected["data"]["consecutive_failures"] == 5 and ejected["data"]["ejection_s"] == 0.5
        assert ejected["data"]["last_error"] == "answered 503"
        status = plane.gateway()[a["name"]]
        assert status["times_ejected"] == 1 and status["ejected_until"] is not None and status["errors"] == 5
        assert status["last_error"] == "answered 503"
        assert sample(plane, "spillway_gateway_ejections_total", backend=a["name"]) == 1
        assert sample(plane, "spillway_gateway_retries_total") == 5
        assert sample(plane, "spillway_gateway_errors_total", backend=a["name"], kind="status_5xx") == 5
        assert sample(plane, "spillway_gateway_requests_total", backend=a["name"], code="503") == 5
        # Back after its 0.5 s: a `backend.returned` event, and traffic again once it answers well.
        [returned] = wait_for(lambda: plane.events("backend.returned"), timeout_s=5)
        assert returned["subject_id"] == a["id"] and returned["data"]["times_ejected"] == 1
        alpha.set(mode="ok")
        wait_for(lambda: plane.infer().headers["spillway-backend"] == a["name"], timeout_s=5, every_s=0)


@pytest.mark.parametrize("mode", ["reset", "connect"])
def test_transport_failures_are_retried_elsewhere(tmp_path: Path, alpha: Faulty, beta: Faulty, mode: str) -> None:
    # No readiness checks during the test: they would take the unreachable one out before any request tried it.
    with running_plane(f"sqlite:///{tmp_path / 'transport.db'}", gateway_health_interval_s=60) as plane:
        if mode == "connect":
            broken = plane.register("http://127.0.0.1:9")  # nothing listens on the discard port
        else:
            alpha.set(mode="reset")
            broken = plane.register(alpha.url)
        healthy = plane.register(beta.url)
        seen: Counter[str] = Counter()
        for _ in range(30):
            # A generous deadline: a 2 s one once ran out on a busy CI machine (504); speed is not what is tested.
            response = plane.infer(**{"spillway-timeout-us": "20000000"})
            assert response.status_code == 200, response.text
            assert response.headers["spillway-backend"] == healthy["name"], response.headers
            seen[response.headers["spillway-attempts"]] += 1
        assert seen["2"] >= 1  # some went to the broken one first
        kind = "reset" if mode == "reset" else "connect"
        assert sample(plane, "spillway_gateway_errors_total", backend=broken["name"], kind=kind) == seen["2"]


@pytest.mark.parametrize("status", [500, 400, 429])
def test_a_4xx_or_500_is_passed_on_never_retried(tmp_path: Path, alpha: Faulty, beta: Faulty, status: int) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'noretry.db'}") as plane:
        broken = plane.register(alpha.url)
        plane.register(beta.url)
        alpha.set(mode="status", status=status)
        before = alpha.stats()["infer"]
        answered: Counter[int] = Counter()
        for _ in range(30):
            response = plane.infer()
            answered[response.status_code] += 1
            if response.status_code == status:
                assert response.headers["spillway-backend"] == broken["name"]
                assert response.headers["spillway-attempts"] == "1"
                assert response.json() == {"error": f"injected {status} by alpha"}  # the backend's own body
        assert answered[status] >= 1 and set(answered) == {200, status}
        assert alpha.stats()["infer"] - before == answered[status]  # each reached alpha once, none twice
        assert sample(plane, "spillway_gateway_retries_total") == 0


def test_a_hang_is_bounded_by_the_deadline(tmp_path: Path, alpha: Faulty, beta: Faulty) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'hang.db'}") as plane:
        alpha.set(mode="hang")
        a = plane.register(alpha.url, timeout_ms=10_000)
        with_parameter = orjson.dumps({**orjson.loads(MLP_REQUEST), "parameters": {"timeout": 300000}})
        for headers, body in (({"spillway-timeout-us": "300000"}, MLP_REQUEST), ({}, with_parameter)):
            began = time.monotonic()
            response = plane.infer(body, **headers)
            took = time.monotonic() - began
            assert response.status_code == 504, response.text
            assert response.json()["error"] == "deadline_exceeded" and "300 ms" in response.json()["message"]
            assert response.headers["spillway-attempts"] == "1"
            assert 0.29 <= took < 1.0, took
        # Without a deadline from the caller, the backend's timeout_ms bounds it.
        plane.client.patch(f"{plane.url}/api/v1/backends/{a['id']}", json={"timeout_ms": 200},
                           headers=plane.operator).raise_for_status()  # fmt: skip
        began = time.monotonic()
        assert plane.infer().status_code == 504 and time.monotonic() - began < 1.0
        # A backend that hangs past its own timeout_ms, within the caller's deadline: retried on the other.
        plane.register(beta.url)
        for _ in range(10):
            response = plane.infer(**{"spillway-timeout-us": "3000000"})
            assert response.status_code == 200, response.text
            assert response.headers["spillway-backend"] != a["name"]


def test_the_retry_budget_limits_retries_when_many_fail_at_once(tmp_path: Path, alpha: Faulty, beta: Faulty) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'budget.db'}", gateway_consecutive_failures=1000) as plane:
        a = plane.register(alpha.url)
        plane.register(beta.url)
        alpha.set(mode="status", status=503)
        beta.set(mode="slow", delay_ms=400)  # a retry stays in flight long enough to overlap the others

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=40)
            async with httpx.AsyncClient(timeout=30, limits=limits, headers=plane.agent) as client:
                url = f"{plane.url}/v2/models/mlp/infer"
                return list(await asyncio.gather(*(client.post(url, content=MLP_REQUEST) for _ in range(30))))

        responses = asyncio.run(burst())
        first_failed = [r for r in responses if r.headers.get("spillway-attempts") == "2" or r.status_code == 503]
        retried = [r for r in responses if r.status_code == 200 and r.headers["spillway-attempts"] == "2"]
        refused = [r for r in responses if r.status_code == 503]
        assert len(first_failed) >= 6, Counter((r.status_code, r.headers.get("spillway-attempts")) for r in responses)
        # At most max(3, 20 % of 30 in flight) = 6 retries at once, and each holds its slot 400 ms: the others
        # that failed at alpha in that time answer with alpha's 503 (passed on) instead of retrying.
        assert 1 <= len(retried) <= 6
        assert refused and all(r.json() == {"error": "injected 503 by alpha"} for r in refused)
        assert all(r.headers["spillway-backend"] == a["name"] for r in refused)
        assert sample(plane, "spillway_gateway_retries_total") == len(retried)


def test_no_capacity_at_once_when_every_backend_is_at_its_cap(tmp_path: Path, alpha: Faulty) -> None:
    with running_plane(f"sqlite:///{tmp_path / 'cap.db'}") as plane:
        plane.register(alpha.url, max_concurrency=2)
        alpha.set(mode="slow", delay_ms=600)

        async def three() -> list[tuple[int, float, str]]:
            async with httpx.AsyncClient(timeout=30, headers=plane.agent) as client:
                url = f"{plane.url}/v2/models/mlp/infer"

                async def one(delay: float) -> tuple[int, float, str]:
                    await asyncio.sleep(delay)
                    began = time.monotonic()
                    response = await client.post(url, content=MLP_REQUEST)
                    return response.status_code, time.monotonic() - began, response.text

                return list(await asyncio.gather(one(0), one(0), one(0.2)))

        results = asyncio.run(three())
        assert [r[0] for r in results] == [200, 200, 503], results
        assert '"no_capacity"' in results[2][2] and results[2][1] < 0.2  # refused at once, no waiting
        assert sample(plane, "spillway_gateway_rejected_total", reason="no_capacity") == 1


def test_active_checks_take_a_backend_out_and_back(plane: Plane, alpha: Faulty) -> None:
    checks = alpha.stats()["checks"]
    a = plane.register(alpha.url)
    wait_for(lambda: alpha.stats()["checks"] >= checks + 4)  # twice: /v2/health/ready and /v2/models/mlp/ready
    assert plane.gateway()[a["name"]]["healthy"]
    alpha.set(ready=False)
    wait_for(lambda: not plane.gateway()[a["name"]]["healthy"], timeout_s=5)
    status = plane.gateway()[a["name"]]
    assert status["unhealthy_models"] == ["mlp"]
    refused = plane.infer()
    assert refused.status_code == 503 and refused.json()["error"] == "no_healthy_backend"
    [event] = wait_for(lambda: plane.events("backend.unhealthy"))
    assert event["data"]["models"] == ["mlp"] and event["data"]["failures"] == 2
    assert "answered 503" in event["data"]["error"]
    alpha.set(ready=True)
    wait_for(lambda: plane.gateway()[a["name"]]["healthy"], timeout_s=5)
    assert plane.infer().status_code == 200
    assert wait_for(lambda: plane.events("backend.healthy"))[0]["data"]["models"] == ["mlp"]


def test_status_and_metrics_show_each_backend(plane: Plane, alpha: Faulty, beta: Faulty) -> None:
    a = plane.register(alpha.url, max_concurrency=7)
    b = plane.register(beta.url)
    names: Counter[str] = Counter(plane.infer().headers["spillway-backend"] for _ in range(40))
    assert names[a["name"]] >= 5 and names[b["name"]] >= 5, names  # spread over both
    gateway = plane.get("/api/v1/status")["gateway"]
    assert gateway["active_requests"] == 0 and gateway["retry_limit"] == 3
    rows = {r["name"]: r for r in gateway["backends"]}
    row = rows[a["name"]]
    assert row["id"] == a["id"] and row["url"] == alpha.url and row["models"] == ["mlp"]
    assert row["requests"] == names[a["name"]] and row["errors"] == 0 and row["outstanding"] == 0
    assert row["max_concurrency"] == 7 and not row["ejected"] and row["ejected_until"] is None
    assert 0 < row["p50_ms"] <= row["p99_ms"] < 1000 and row["last_error"] is None
    for name, count in names.items():
        assert sample(plane, "spillway_gateway_requests_total", backend=name, code="200") == count
        assert sample(plane, "spillway_gateway_request_duration_seconds_count", backend=name) == count
        assert sample(plane, "spillway_gateway_outstanding", backend=name) == 0
    assert "auth_header" not in str(gateway) and "backend-secret-value" not in str(gateway)


def test_backend_changes_take_effect_at_once(plane: Plane, alpha: Faulty, beta: Faulty) -> None:
    a = plane.register(alpha.url)
    assert plane.infer().headers["spillway-backend"] == a["name"]
    patched = plane.client.patch(f"{plane.url}/api/v1/backends/{a['id']}", json={"url": beta.url},
                                 headers=plane.operator)  # fmt: skip
    assert patched.status_code == 200
    assert plane.infer().json()["id"] == "beta"  # the next request already goes to the new URL
    plane.client.patch(f"{plane.url}/api/v1/backends/{a['id']}", json={"models": ["resnet"]},
                       headers=plane.operator).raise_for_status()  # fmt: skip
    assert plane.infer().json()["error"] == "no_backend"
    assert plane.client.delete(f"{plane.url}/api/v1/backends/{a['id']}", headers=plane.operator).status_code == 204
    assert plane.infer(model="resnet").json()["error"] == "no_backend"
    assert a["name"] not in plane.gateway()


def test_the_answer_is_streamed_and_a_broken_stream_is_cut_not_retried(
    plane: Plane, alpha: Faulty, beta: Faulty
) -> None:
    a = plane.register(alpha.url)
    alpha.set(mode="trickle", delay_ms=400)
    url = f"{plane.url}/v2/models/mlp/infer"
    began = time.monotonic()
    chunks = []
    with plane.client.stream("POST", url, content=MLP_REQUEST, headers=plane.agent) as response:
        assert response.status_code == 200
        for chunk in response.iter_raw():
            chunks.append((time.monotonic() - began, chunk))
    assert chunks[0][0] < 0.3 <= chunks[-1][0]  # the first half came before the backend sent the rest
    assert orjson.loads(b"".join(c for _, c in chunks))["id"] == "alpha"
    # Cut mid-answer: the status line is out, so no retry elsewhere; the client sees a broken response.
    plane.register(beta.url)
    alpha.set(mode="cut")
    before = alpha.stats()["infer"] + beta.stats()["infer"]
    broken = 0
    for _ in range(20):
        try:
            response = plane.infer()
        except httpx.RemoteProtocolError:
            broken += 1
            continue
        assert response.headers["spillway-backend"] != a["name"]
    assert broken >= 1
    assert alpha.stats()["infer"] + beta.stats()["infer"] - before == 20  # one attempt each
    assert plane.gateway()[a["name"]]["errors"] == broken


def test_a_json_only_backend_gets_json_and_the_client_gets_what_it_asked_for(plane: Plane, alpha: Faulty) -> None:
    import numpy as np
    import tritonclient.http as triton

    plane.register(alpha.url, binary_tensors=False)
    tensor = triton.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4), binary_data=True)
    output = triton.InferRequestedOutput("output", binary_data=True)
    body, json_size = triton.InferenceServerClient.generate_request_body([tensor], outputs=[output])
    response = plane.infer(body, **{"inference-header-content-length": str(json_size)})
    assert response.status_code == 200, response.text
    seen = alpha.stats()["last_headers"]
    assert seen["content-type"] == "application/json" and "inference-header-content-length" not in seen
    length = int(response.headers["inference-header-content-length"])  # binary, as the client asked
    result = triton.InferenceServerClient.parse_response_body(response.content, header_length=length)
    assert result.as_numpy("output").tolist() == [[0.0, 1.0, 2.0, 3.0]]
    # A request that cannot be translated is the client's fault; an answer that cannot be, the backend's.
    bad = plane.infer(body[: json_size + 2], **{"inference-header-content-length": str(json_size)})
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_request", bad.text
    alpha.set(mode="garbage")
    garbage = plane.infer(body, **{"inference-header-content-length": str(json_size)})
    assert garbage.status_code == 502 and garbage.json()["error"] == "bad_backend_response", garbage.text
    assert "backend response" in garbage.json()["message"]


def test_a_backend_registered_elsewhere_is_found_on_the_first_miss(tmp_path: Path, alpha: Faulty) -> None:
    from controlplane.db import make_engine, make_sessionmaker, transaction
    from controlplane.db.models import Backend

    db = f"sqlite:///{tmp_path / 'miss.db'}"
    with running_plane(db, gateway_refresh_s=60) as plane:  # no periodic refresh during the test
        assert plane.infer(model="bert").json()["error"] == "no_backend"  # reloads once
        engine = make_engine(db)  # another replica registers a backend for bert
        with transaction(make_sessionmaker(engine)) as session:
            session.add(Backend(id="0123456789abcdef", name="elsewhere", url=alpha.url, models=["bert"]))
        engine.dispose()
        missed = time.monotonic()
        second = plane.infer(model="bert")
        if time.monotonic() - missed < 0.4:  # within 0.5 s of the last miss's reload: not reloaded again
            assert second.json()["error"] == "no_backend"
        wait_for(lambda: plane.infer(model="bert").status_code == 200, timeout_s=3, every_s=0.1)
