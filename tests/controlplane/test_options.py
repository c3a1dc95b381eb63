"""Which methods a path has is answered from the app's routes: `OPTIONS` and every 405 list all of them (issue 11:
`OPTIONS /api/v1/slos/{id}` answered 405 with `Allow: GET` although PUT, PATCH and DELETE exist)."""

from __future__ import annotations

import re
from collections import defaultdict

import httpx

from tests.conftest import Api
from tests.controlplane.test_auth import PROBES, walk_routes

METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}


def _methods_by_path(api: Api) -> dict[str, set[str]]:
    by_path: dict[str, set[str]] = defaultdict(set)
    for method, path in walk_routes(api.client.app):  # type: ignore[arg-type]
        by_path[path].add(method)
    assert len(by_path) >= 25
    return by_path


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "0000000000000000", path)


def _allow(response: httpx.Response) -> set[str]:
    return {method.strip() for method in response.headers["allow"].split(",")}


def test_options_and_405_list_every_method_of_every_path(sqlite_api: Api) -> None:
    for path, methods in _methods_by_path(sqlite_api).items():
        url, expected = _concrete(path), methods | {"OPTIONS"}
        options = sqlite_api.call("OPTIONS", url, role="viewer")
        assert options.status_code == 204, (path, options.text)
        assert _allow(options) == expected, path
        assert options.content == b""
        for method in sorted(METHODS - methods):
            refused = sqlite_api.call(method, url)
            assert refused.status_code == 405, (method, path, refused.text)
            assert _allow(refused) == expected, (method, path)
            assert refused.json()["error"] == "method_not_allowed"
            assert method in refused.json()["message"]


def test_the_issues_paths_list_put_patch_and_delete(sqlite_api: Api) -> None:
    assert _allow(sqlite_api.call("OPTIONS", "/api/v1/slos/0000000000000000")) == {
        "GET", "PUT", "PATCH", "DELETE", "OPTIONS"}  # fmt: skip
    assert _allow(sqlite_api.call("POST", "/api/v1/keys/0000000000000000")) == {"GET", "PATCH", "DELETE", "OPTIONS"}


def test_options_needs_credentials_like_every_other_method(sqlite_api: Api) -> None:
    """Only the probes answer without credentials, OPTIONS included; an unknown path is still 404."""
    for path in _methods_by_path(sqlite_api):
        response = sqlite_api.client.options(_concrete(path))
        if path in PROBES:
            assert response.status_code == 204 and _allow(response) == {"GET", "OPTIONS"}, path
        else:
            assert response.status_code == 401, (path, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
    assert sqlite_api.call("OPTIONS", "/api/v1/nowhere").status_code == 404
