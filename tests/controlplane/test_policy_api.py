"""`GET /api/v1/agents/{id}/policy`: strong ETags and 304s for polling agents, each agent its own document only,
and a new version once the control loop changes what the agent must do."""

from __future__ import annotations

from datetime import timedelta

from controlplane.db.models import utcnow
from spillway.contract.policy import PolicyDocument, parse
from tests.conftest import Api
from tests.utils.builders import make_agent, make_rule
from tests.utils.rollups import add_gauge


def test_agents_poll_their_own_policy_with_etags(api: Api) -> None:
    first = api.call("POST", "/api/v1/agents", json=make_agent(name="a1", labels={"site": "berlin"})).json()
    other = api.call("POST", "/api/v1/agents", json=make_agent(name="a2")).json()
    me = {"Authorization": f"Bearer {first['token']}"}
    path = f"/api/v1/agents/{first['agent']['id']}/policy"

    got = api.client.get(path, headers=me)
    assert got.status_code == 200, got.text
    etag = got.headers["etag"]
    assert etag.startswith('"') and not etag.startswith("W/")  # strong
    document = parse(got.content)  # the agent's own parser accepts it
    assert (document.agent, document.version, document.models) == (first["agent"]["id"], 1, {})
    assert document.latency_buckets_ms is not None and 10.0 in document.latency_buckets_ms

    again = api.client.get(path, headers={**me, "If-None-Match": etag})
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etag)
    assert api.client.get(path, headers={**me, "If-None-Match": '"stale"'}).status_code == 200

    theirs = api.client.get(f"/api/v1/agents/{other['agent']['id']}/policy", headers=me)
    assert theirs.status_code == 403 and "only its own" in theirs.json()["message"]
    assert api.call("GET", path, role="viewer").status_code == 200  # operators may read any agent's
    assert api.call("GET", "/api/v1/agents/0000000000000000/policy", role="viewer").status_code == 404
    assert api.client.get(path).status_code == 401

    # A rule fires for this agent: the loop publishes version 2, and the old ETag no longer matches.
    rule = make_rule(name="hot", selector={"labels": {"site": "berlin"}},
                     condition={"kind": "gauge", "metric": "queue_depth", "op": ">", "threshold": 5},
                     action={"kind": "shed", "priority_at_or_below": 2, "retry_after_s": 7}, hysteresis={})  # fmt: skip
    assert api.call("POST", "/api/v1/rules", json=rule).status_code == 201
    app = api.client.app
    with app.state.sessionmaker() as session, session.begin():  # type: ignore[attr-defined]
        add_gauge(session, first["agent"]["id"], utcnow().replace(second=0, microsecond=0),
                  "spillway.queue.depth", 9, model="mlp", priority=1)  # fmt: skip
    report = app.state.control_loop.cycle(utcnow() + timedelta(seconds=1))  # type: ignore[attr-defined]
    assert report.published[first["agent"]["id"]] == 2
    rule_id = api.call("GET", "/api/v1/rules", role="viewer").json()["items"][0]["id"]
    states = api.call("GET", f"/api/v1/rules/{rule_id}/status", role="viewer").json()
    assert [(s["agent_name"], s["state"], s["observed"]["value"]) for s in states] == [("a1", "firing", 9)]
    assert states[0]["in_force"] == {"kind": "shed", "priority_at_or_below": 2, "retry_after_s": 7}
    changed = api.client.get(path, headers={**me, "If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    policy = PolicyDocument.model_validate_json(changed.content)
    assert policy.version == 2 and policy.for_model("mlp").shed is not None
    assert policy.for_model("mlp").shed.at_or_below == 2 and [c.name for c in policy.causes] == ["hot"]


def test_the_304_path_answers_only_for_a_stored_document_of_an_existing_agent(api: Api) -> None:
    made = api.call("POST", "/api/v1/agents", json=make_agent(name="a1")).json()
    me = {"Authorization": f"Bearer {made['token']}"}
    path = f"/api/v1/agents/{made['agent']['id']}/policy"
    # No document stored yet (the loop has not run): whatever ETag the agent sends, it gets its first document.
    first = api.client.get(path, headers={**me, "If-None-Match": '"held-from-elsewhere"'})
    assert first.status_code == 200 and parse(first.content).version == 1
    etag = first.headers["etag"]
    tags = f'"other", {etag}'  # a list of tags: any one of them matches
    assert api.client.get(path, headers={**me, "If-None-Match": tags}).status_code == 304
    missing = api.call("GET", "/api/v1/agents/0000000000000000/policy", role="viewer", headers={"If-None-Match": etag})
    assert missing.status_code == 404


def test_a_first_policy_written_meanwhile_is_served_not_a_500(api: Api) -> None:
    """A poll that found no document and writes the first one while the loop (or another poll) wrote it first
    serves the stored one (it once answered 500 on the unique key under a fleet's polls)."""
    from controlplane.db import make_engine, make_sessionmaker
    from controlplane.db.models import Policy
    from controlplane.rules.loop import PolicyDefaults, current_policy

    agent_id = api.call("POST", "/api/v1/agents", json=make_agent()).json()["agent"]["id"]
    engine = make_engine(api.url)
    try:
        factory = make_sessionmaker(engine)
        defaults = PolicyDefaults(
            buckets_ms=[10.0, 100.0], export_interval_s=5.0, poll_interval_s=5.0, stale_after_s=15.0
        )
        with factory() as first, first.begin():
            stored = current_policy(first, agent_id, defaults)
            etag = stored.etag
        with factory() as late, late.begin():
            real_get = late.get

            def stale_get(entity, ident, **kwargs):  # type: ignore[no-untyped-def]
                if entity is Policy and not kwargs:  # the read made before the other writer committed
                    return None
                return real_get(entity, ident, **kwargs)

            late.get = stale_get  # type: ignore[method-assign]
            served = current_policy(late, agent_id, defaults)
            assert served.etag == etag and served.version == 1
    finally:
        engine.dispose()
