"""Tenants through the overflow gateway: the agent's `spillway-tenant` goes on to the backend (checked: anything but a
tenant name is `other`), and a backend's `tenant_share` caps the part of its requests in flight one tenant holds:
over it, the request tries another backend, else 429 `tenant_quota` (OpenAI's rate-limit shape on the OpenAI routes)
while another tenant passes. End to end against a real loopback backend (tests/utils/faulty_backend.py, slow), and
the pool's decisions without a network."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.gateway import BackendPool, BackendSpec, NoCapacity, OutlierPolicy, ReadinessPolicy, TenantQuota
from controlplane.gateway.catalog import tenant_share_of
from controlplane.gateway.relay import openai_error
from controlplane.gateway.tenant import quota_tenant, request_tenant
from controlplane.monitoring import GatewayMetrics
from tests.utils.builders import make_backend
from tests.utils.gateway import MLP_REQUEST, Faulty, Plane, running_plane, start_faulty, wait_for

DELAY_MS = 1500  # long enough for the requests below to be in flight together on a busy machine


@pytest.fixture(scope="module")
def backend() -> Iterator[Faulty]:
    faulty = start_faulty("tenanted")
    yield faulty
    faulty.proc.kill()
    faulty.proc.wait(timeout=10)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    with running_plane(f"sqlite:///{tmp_path / 'gw.db'}") as running:
        yield running


def register(plane: Plane, url: str, shares: dict[str, float], **over: Any) -> dict[str, Any]:
    """A backend with `tenant_share`, through the API."""
    body = make_backend(url=url, binary_tensors=True, tenant_share=shares, **over)
    created = plane.client.post(f"{plane.url}/api/v1/backends", json=body, headers=plane.operator)
    assert created.status_code == 201, created.text
    assert created.json()["tenant_share"] == shares
    return dict(created.json())


def as_tenant(plane: Plane, tenant: str) -> httpx.Response:
    """An overflowed request of `tenant`, as an agent sends it."""
    return plane.infer(MLP_REQUEST, **{"spillway-tenant": tenant})


def test_the_tenant_is_passed_on_checked(plane: Plane, backend: Faulty) -> None:
    backend.set(mode="ok")
    register(plane, backend.url, {})
    for sent, seen in (("alpha", "alpha"), ("beta.v2", "beta.v2"), ("Not A Name", "other")):
        answer = as_tenant(plane, sent)
        assert answer.status_code == 200, answer.text
        assert backend.stats()["last_headers"]["spillway-tenant"] == seen
    assert plane.infer().status_code == 200
    assert "spillway-tenant" not in backend.stats()["last_headers"]  # none named: none passed on


def test_a_tenant_over_its_share_gets_429_while_the_other_passes(plane: Plane, backend: Faulty) -> None:
    """max_concurrency 4, alpha's share 0.5: alpha holds at most 2 of the backend's requests at once."""
    name = register(plane, backend.url, {"alpha": 0.5}, max_concurrency=4, timeout_ms=10_000)["name"]
    backend.set(mode="slow", delay_ms=DELAY_MS)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            before = backend.stats()["infer"]
            held = [pool.submit(as_tenant, plane, "alpha") for _ in range(2)]
            wait_for(lambda: backend.stats()["infer"] >= before + 2)  # both in flight at the backend
            refused = as_tenant(plane, "alpha")
            seen = plane.gateway()[name]  # alpha's two are still in flight
            began = time.monotonic()
            other = as_tenant(plane, "beta")
            assert other.status_code == 200, other.text  # beta has no cap: the backend has room for it
            assert time.monotonic() - began >= DELAY_MS / 1000 * 0.9  # it really went to the slow backend
            assert [f.result().status_code for f in held] == [200, 200]
        assert refused.status_code == 429, refused.text
        assert refused.headers["spillway-reason"] == "tenant_quota"
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == "tenant_quota"
        assert "'alpha'" in refused.json()["message"]
        assert refused.json()["details"]["tenant"] == "alpha"
        assert backend.stats()["infer"] == before + 3  # the refused one never reached the backend
        assert (seen["tenant_share"], seen["tenants"], seen["tenant_refused"]) == ({"alpha": 0.5}, {"alpha": 2},
                                                                                   {"alpha": 1})  # fmt: skip
        refusals = [s for f in text_string_to_metric_families(plane.get("/metrics")) for s in f.samples
                    if s.name == "spillway_gateway_tenant_refusals_total"]  # fmt: skip
        assert [(s.labels["tenant"], s.value) for s in refusals] == [("alpha", 1.0)], refusals
    finally:
        backend.set(mode="ok")
    again = as_tenant(plane, "alpha")  # its requests are answered: its share is free again
    assert again.status_code == 200, again.text


def test_tenant_share_is_checked_stored_and_loaded(plane: Plane) -> None:
    """Bad shares are a 422 naming the field; good ones are returned, changed by PATCH, and loaded by the gateway."""
    too_many = {f"t{i}": 0.5 for i in range(257)}
    for shares, words in (({"Alpha": 0.5}, "should match pattern"), ({"a b": 0.5}, "should match pattern"),
                          ({"x" * 64: 0.5}, "at most 63"), ({"alpha": 0}, "greater than 0"),
                          ({"alpha": 1.5}, "less than or equal to 1"), ({"alpha": "half"}, "valid number"),
                          (too_many, "at most 256"), (["alpha"], "valid dictionary")):  # fmt: skip
        refused = plane.client.post(f"{plane.url}/api/v1/backends", headers=plane.operator,
                                    json=make_backend(tenant_share=shares))  # fmt: skip
        assert refused.status_code == 422, (shares, refused.text)
        details = refused.json()["details"]
        assert any(d["field"].startswith("body.tenant_share") and words in d["message"] for d in details), details
    assert plane.get("/api/v1/backends")["items"] == []

    # `default` (requests naming no tenant) and `other` (names an agent does not know) may be capped too.
    created = register(plane, "http://127.0.0.1:9", {"alpha": 0.25, "default": 1, "other": 0.5})
    ident, name = created["id"], created["name"]
    assert plane.get(f"/api/v1/backends/{ident}")["tenant_share"] == {"alpha": 0.25, "default": 1.0, "other": 0.5}
    assert plane.gateway()[name]["tenant_share"] == {"alpha": 0.25, "default": 1.0, "other": 0.5}
    etag = plane.client.get(f"{plane.url}/api/v1/backends/{ident}", headers=plane.operator).headers["etag"]
    patched = plane.client.patch(f"{plane.url}/api/v1/backends/{ident}", json={"tenant_share": {"beta": 0.5}},
                                 headers={**plane.operator, "If-Match": etag})  # fmt: skip
    assert patched.status_code == 200, patched.text
    assert patched.json()["tenant_share"] == {"beta": 0.5}
    gateway = plane.gateway()[name]
    assert (gateway["tenant_share"], gateway["tenants"], gateway["tenant_refused"]) == ({"beta": 0.5}, {}, {})
    bad = plane.client.patch(f"{plane.url}/api/v1/backends/{ident}", json={"tenant_share": {"beta": -1}},
                             headers=plane.operator)  # fmt: skip
    assert bad.status_code == 422 and "tenant_share" in bad.json()["message"], bad.text


# ---- the pool's decisions ---------------------------------------------------------------------------------------


def _pool(*specs: BackendSpec) -> BackendPool:
    pool = BackendPool(OutlierPolicy(), ReadinessPolicy(), clock=lambda: 1000.0, rng=random.Random(3))
    pool.replace(specs)
    return pool


def _spec(ident: str, cap: int = 4, **shares: float) -> BackendSpec:
    return BackendSpec(ident, f"b-{ident}", f"http://{ident}.example", ("mlp",), max_concurrency=cap,
                       tenant_share=shares)  # fmt: skip


def test_a_tenant_at_its_share_tries_another_backend_then_is_refused() -> None:
    pool = _pool(_spec("a", alpha=0.25), _spec("b", alpha=0.5))  # alpha: 1 at a, 2 at b
    taken = [pool.acquire("mlp", tenant="alpha") for _ in range(3)]
    assert sorted(s.id for s in taken) == ["a", "b", "b"]
    with pytest.raises(TenantQuota) as refused:
        pool.acquire("mlp", tenant="alpha")
    assert refused.value.status_code == 429 and refused.value.code == "tenant_quota"
    assert refused.value.details == {"tenant": "alpha", "quota": "tenant_share", "retry_after_s": 1}
    assert pool.acquire("mlp", tenant="beta").id in ("a", "b")  # no share named for beta
    assert pool.acquire("mlp").id in ("a", "b")  # nor for a request counted against no tenant
    snapshot = {row["id"]: row for row in pool.snapshot()}
    assert snapshot["b"]["tenants"]["alpha"] == 2 and snapshot["b"]["tenant_share"] == {"alpha": 0.5}
    assert snapshot["a"]["tenant_refused"] == {"alpha": 1} and snapshot["b"]["tenant_refused"] == {"alpha": 1}
    state = next(s for s in taken if s.id == "a")
    pool.release(state)
    pool.left(state, "alpha")
    assert pool.acquire("mlp", tenant="alpha").id == "a"  # its share at a is free again
    assert "alpha" in pool.states["a"].tenants


def test_capacity_is_judged_before_the_share_and_the_share_is_at_least_one() -> None:
    pool = _pool(_spec("a", cap=1, alpha=0.1))  # 0.1 of 1 rounds down to 0: a share is at least one request
    state = pool.acquire("mlp", tenant="alpha")
    with pytest.raises(NoCapacity):  # full: the backend's limit, not the tenant's share
        pool.acquire("mlp", tenant="alpha")
    pool.release(state)
    pool.left(state, "alpha")
    assert pool.states["a"].tenants == {}


def _refusals(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """`spillway_gateway_tenant_refusals_total` by (backend, tenant), as Prometheus parses the exposition."""
    return {
        (sample.labels["backend"], sample.labels["tenant"]): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == "spillway_gateway_tenant_refusals_total"
    }


def test_refusals_per_tenant_are_exposed_for_the_tenants_a_share_names() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    pool = _pool(_spec("a", cap=2, alpha=0.5, beta=0.5), _spec("b", cap=8))
    assert _refusals(registry) == {}  # no gateway watched: no series
    metrics.watch(pool.snapshot)
    assert _refusals(registry) == {("b-a", "alpha"): 0, ("b-a", "beta"): 0}  # from 0, only the tenants named
    pool.replace([_spec("a", cap=2, alpha=0.5, beta=0.5)])  # b gone: alpha has nowhere else to go
    pool.acquire("mlp", tenant="alpha")
    for _ in range(2):
        with pytest.raises(TenantQuota):
            pool.acquire("mlp", tenant="alpha")
    pool.acquire("mlp", tenant="gamma")  # not capped: never refused for a share, never a series
    assert _refusals(registry) == {("b-a", "alpha"): 2, ("b-a", "beta"): 0}
    pool.replace([_spec("a", cap=2, beta=0.5)])  # alpha no longer named: its series goes, the set stays bounded
    assert _refusals(registry) == {("b-a", "beta"): 0}


def test_the_header_and_stored_shares_are_checked() -> None:
    assert request_tenant(None) is None and quota_tenant(None) == "default"
    assert request_tenant(b" alpha ") == "alpha" and quota_tenant("alpha") == "alpha"
    for bad in (b"", b"Alpha", b"a b", b"-a", b"x" * 64, b"a\nb", b"\xff"):
        assert request_tenant(bad) == "other", bad
    stored = {"alpha": 0.5, "beta": 1, "Bad": 0.5, "zero": 0, "big": 1.5, "text": "0.5", "flag": True}
    assert tenant_share_of(stored) == {"alpha": 0.5, "beta": 1.0}
    assert tenant_share_of(None) == {} and tenant_share_of(["alpha"]) == {}


def test_openai_routes_refuse_in_openai_rate_limit_shape() -> None:
    error = openai_error(TenantQuota("tenant 'alpha' holds its share", {"tenant": "alpha"}))
    assert error == {"error": {"message": "tenant 'alpha' holds its share", "type": "requests", "param": None,
                               "code": "rate_limit_exceeded"}}  # fmt: skip
