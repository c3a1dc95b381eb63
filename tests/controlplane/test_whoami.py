"""`GET /api/v1/whoami`: every authenticated caller learns its kind, id, name and role; nobody else learns anything,
and the answer never carries the credential."""

from __future__ import annotations

from tests.conftest import Api
from tests.utils.builders import make_agent


def test_each_key_learns_its_role_and_never_sees_its_secret(sqlite_api: Api) -> None:
    listed = {k["name"]: k for k in sqlite_api.call("GET", "/api/v1/keys").json()["items"]}
    for role in ("viewer", "editor", "admin"):
        answer = sqlite_api.call("GET", "/api/v1/whoami", role=role)
        assert answer.status_code == 200, answer.text
        key = listed[f"test-{role}"]
        assert answer.json() == {"kind": "key", "id": key["id"], "name": f"test-{role}", "role": role}
        secret = sqlite_api.keys[role].split("_", 2)[-1]  # spk_<id>_<secret>
        assert sqlite_api.keys[role] not in answer.text and secret not in answer.text


def test_an_agent_token_learns_it_is_that_agent(sqlite_api: Api) -> None:
    created = sqlite_api.call("POST", "/api/v1/agents", json=make_agent(name="edge-7")).json()
    token = created["token"]
    answer = sqlite_api.client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"kind": "agent", "id": created["agent"]["id"], "name": "edge-7", "role": "agent"}
    assert token not in answer.text


def test_no_or_wrong_credentials_are_401(sqlite_api: Api) -> None:
    assert sqlite_api.client.get("/api/v1/whoami").status_code == 401
    wrong = sqlite_api.keys["admin"][:-4] + "AAAA"
    for header in (f"Bearer {wrong}", "Bearer nonsense", "Basic dXNlcjpwYXNz"):
        answer = sqlite_api.client.get("/api/v1/whoami", headers={"Authorization": header})
        assert answer.status_code == 401, header
        assert answer.json()["error"] == "unauthenticated"
