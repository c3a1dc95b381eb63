"""The last active admin key survives any concurrency: revocations and demotions that race each other, on SQLite
and on PostgreSQL, leave one admin key and refuse exactly the change that would have removed the last one."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from controlplane.access import change_api_key, issue_api_key, revoke_api_key
from controlplane.app import create_app
from controlplane.db import ApiKey, make_engine, make_sessionmaker, migrate_to, transaction
from controlplane.db.models import utcnow
from controlplane.db.repository import Actor
from controlplane.errors import Conflict
from controlplane.settings import Settings
from tests.utils.server import serving

ROUNDS = 5
ACTOR = Actor("test")


def _active_admins(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        where = (ApiKey.role == "admin", ApiKey.revoked_at.is_(None))
        return int(session.scalar(select(func.count()).select_from(ApiKey).where(*where)) or 0)


def _exactly_these_admins(factory: sessionmaker[Session], names: list[str]) -> list[tuple[str, str]]:
    """Fresh admin keys (id, bearer key) named `names`, every other admin key revoked: a race starts from these."""
    with transaction(factory) as session:
        session.execute(update(ApiKey).where(ApiKey.role == "admin").values(revoked_at=utcnow()))
        issued = [issue_api_key(session, name, "admin", ACTOR) for name in names]
        return [(key.id, bearer) for key, bearer in issued]


def _race(calls: list[Callable[[], str]]) -> Counter[str]:
    """Run `calls` at the same moment, one thread each; how many answered what."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], str]) -> str:
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return Counter(pool.map(run, calls))


def test_admins_removing_each_other_at_once_leave_one(db_url: str) -> None:
    """Four admin keys, each revoked or demoted by its own transaction at the same moment: three changes win, the
    fourth is refused as the last admin, every round."""
    migrate_to(db_url)
    engine = make_engine(db_url)
    factory = make_sessionmaker(engine)

    def removal(ident: str, how: str) -> Callable[[], str]:
        def remove() -> str:
            try:
                with transaction(factory) as session:
                    if how == "revoke":
                        revoke_api_key(session, ident, None, ACTOR)
                    else:
                        change_api_key(session, ident, name=None, role="editor", if_match=None, actor=ACTOR)
            except Conflict as exc:
                assert "last active admin key" in exc.message
                return "refused"
            return "done"

        return remove

    try:
        for round_ in range(ROUNDS):
            admins = _exactly_these_admins(factory, [f"admin-{round_}-{i}" for i in range(4)])
            calls = [removal(ident, "revoke" if i % 2 else "demote") for i, (ident, _) in enumerate(admins)]
            assert _race(calls) == Counter(done=3, refused=1), f"round {round_}"
            assert _active_admins(factory) == 1, f"round {round_}"
    finally:
        engine.dispose()


def test_two_admins_revoking_or_demoting_each_other_over_http_keep_one(db_url: str) -> None:
    """The issue's race through the real API: A revokes B while B revokes (or demotes) A. One wins; the other is
    refused: 409 when it reached the check, or 401 (403) when its own key was already revoked (demoted) on arrival."""
    migrate_to(db_url)
    engine = make_engine(db_url)
    factory = make_sessionmaker(engine)
    try:
        with serving(create_app(Settings(database_url=db_url, control_loop_interval_s=0))) as base:
            for round_ in range(ROUNDS):
                (a, key_a), (b, key_b) = _exactly_these_admins(factory, [f"a-{round_}", f"b-{round_}"])
                second = ("PATCH", a, {"role": "viewer"}) if round_ % 2 else ("DELETE", a, None)
                requests = [(key_a, "DELETE", b, None), (key_b, *second)]

                def call(key: str, method: str, target: str, body: object) -> Callable[[], str]:
                    def send() -> str:
                        response = httpx.request(method, f"{base}/api/v1/keys/{target}", json=body, timeout=30,
                                                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip
                        return str(response.status_code)

                    return send

                statuses = _race([call(*request) for request in requests])
                assert sum(statuses[s] for s in ("200", "204")) == 1, (round_, statuses)
                assert sum(statuses[s] for s in ("409", "401", "403")) == 1, (round_, statuses)
                assert _active_admins(factory) == 1, (round_, statuses)
    finally:
        engine.dispose()
