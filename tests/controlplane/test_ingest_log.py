"""The ingest log: an export answered in mode `logged` is in the log before the answer; a restart after a crash
replays exactly what was not applied (nothing twice); a torn tail is cut and said; one bad export fails alone."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from controlplane.db import normalise_url
from controlplane.ingest.log import IngestLog, log_folder, open_ingest_log
from controlplane.ingest.receiver import Ingestor
from controlplane.settings import Settings
from tests.controlplane.test_ingest_replicas import MINUTE_NS, T0, export, history, totals


def crash(ingestor: Ingestor) -> None:
    """What a kill -9 leaves: the log's files as written so far and its slot free; nothing queued is applied."""
    ingestor._queue.clear()
    ingestor._closing = True
    ingestor._wake.put(None)
    if ingestor._thread is not None:
        ingestor._thread.join(10)
    log = ingestor.log
    assert log is not None
    if log._fd is not None:
        os.close(log._fd)
        log._fd = None
    os.close(log._lock_fd)  # the kernel drops the flock with the process


def records(folder: Path) -> list[int]:
    """The seqs of the records in the folder's slot-0, as a restart would read them."""
    log = IngestLog(folder, slot=folder / "slot-0", fsync=False)
    try:
        return [record.seq for record in log.replay(0)]
    finally:
        log.close()


@contextmanager
def writes_blocked(db_url: str) -> Iterator[None]:
    """Another connection holds what the applier needs to write (SQLite's write lock, PostgreSQL's stream table)."""
    if db_url.startswith("sqlite"):
        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    engine = create_engine(normalise_url(db_url))
    with engine.connect() as locking:
        locking.execute(text("LOCK TABLE ingest_streams IN ACCESS EXCLUSIVE MODE"))
        try:
            yield
        finally:
            locking.rollback()
    engine.dispose()


def test_the_log_folder_slots_and_file_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPILLWAY_INGEST_LOG_DIR", raising=False)  # (the tests' conftest sets one)
    database = tmp_path / "cp.db"
    settings = Settings(database_url=f"sqlite:///{database}")
    first, second = open_ingest_log(settings), open_ingest_log(settings)
    assert first is not None and second is not None
    assert first.folder.parent == tmp_path / "cp.db.ingest-log"
    assert (first.path.name, second.path.name) == ("slot-0", "slot-1")  # slot-0 is held: the next one
    assert first.log_id != second.log_id
    first.resume(1)
    first.append("a1", b"body")
    for path in [*first.path.glob("seg-*.log"), first.path / "lock"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first.close()
    third = open_ingest_log(settings)
    assert third is not None and third.path.name == "slot-0" and third.log_id == first.log_id  # free again
    second.close()
    third.close()
    assert open_ingest_log(Settings(database_url=f"sqlite:///{database}", ingest_ack="applied")) is None
    assert open_ingest_log(Settings(database_url="sqlite:///:memory:")) is None
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    pg = log_folder(Settings(database_url="postgresql://spillway:secret@db.example/spillway"))
    assert pg == log_folder(Settings(database_url="postgresql+psycopg://spillway:other@db.example/spillway"))
    assert pg is not None and pg.parent == tmp_path / "state" / "spillway" / "ingest-log"
    assert pg != log_folder(Settings(database_url="postgresql://spillway@db.example/another"))
    chosen = Settings(database_url=f"sqlite:///{database}", ingest_log_dir=str(tmp_path / "chosen"))
    assert log_folder(chosen) is not None and log_folder(chosen).parent == tmp_path / "chosen"  # type: ignore[union-attr]


def test_a_restart_replays_what_was_logged_and_not_applied_exactly_once(factory: Any, tmp_path: Path) -> None:
    """Phase 1 applies half an agent's exports (their records stay in the log: segments go once a durable commit
    covers them), then logs the other half without applying it and dies. The restart applies that half only; a
    second restart applies nothing."""
    exports, served, observed, buckets = history(7)
    half = len(exports) // 2
    folder = tmp_path / "log"
    first = Ingestor(factory, log=IngestLog(folder, segment_bytes=2_000))
    for message in exports[:half]:
        first.submit("a1", message).durable.result(timeout=10)  # written and fsynced
    assert first.wait_applied(timeout=10)
    assert first.log is not None
    for message in exports[half:]:  # logged (acknowledged once durable), never applied: the process dies here
        first.log.append("a1", message.SerializeToString())[1].result(timeout=10)
    crash(first)
    logged = records(folder)
    assert logged[-1] == len(exports) and len(logged) > len(exports) - half  # applied records are still there

    second = Ingestor(factory, log=IngestLog(folder))
    second.start()
    assert second.stats()["replayed"] == len(exports) - half
    assert totals(factory) == (served, observed, buckets)
    second.ingest("a1", export("a1", T0 + 60 * MINUTE_NS, T0 + 61 * MINUTE_NS, 5, 2))  # appends after the replay
    assert second.wait_applied()
    crash(second)  # after applying: nothing left to replay

    third = Ingestor(factory, log=IngestLog(folder))
    third.start()
    assert third.stats()["replayed"] == 0
    assert totals(factory) == (served + 5, observed + 2, [b + 1 if i in (2, 5) else b for i, b in enumerate(buckets)])
    third.close()
    assert len(records(folder)) <= 1  # what is applied is deleted (the newest segment stays)


def test_an_idle_slot_is_replayed_by_another_process(factory: Any, tmp_path: Path) -> None:
    """A process crashed and none took its slot again (one worker fewer): the next one to start applies its records."""
    folder = tmp_path / "log"
    held = IngestLog(folder)  # slot-0: a live process
    gone = IngestLog(folder)  # slot-1: crashed with two records logged, not applied
    gone.resume(1)
    gone.append("a1", export("a1", T0, T0 + 10**9, 4, 2).SerializeToString())
    gone.append("a1", export("a1", T0, T0 + 2 * 10**9, 9, 4).SerializeToString())
    ingestor = Ingestor(factory, log=IngestLog(folder))  # slot-2
    gone.close()
    ingestor.start()
    assert totals(factory)[:2] == (9, 4)
    assert not list((folder / "slot-1").glob("seg-*.log"))
    ingestor.close()
    held.close()


@pytest.mark.parametrize("tail", [b"\x30\x00", b"\x40\x00\x00\x00\x12\x34\x56\x78partial", "bad crc"])
def test_a_torn_tail_is_cut_and_said(factory: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                     tail: Any) -> None:  # fmt: skip
    folder = tmp_path / "log"
    log = IngestLog(folder)
    log.resume(1)
    for k in (1, 2, 3):
        log.append("a1", export("a1", T0, T0 + k * 10**9, 10 * k, 2 * k).SerializeToString())
    log.close()
    (segment,) = (folder / "slot-0").glob("seg-*.log")
    if tail == "bad crc":  # the last record written whole but damaged: it is cut with the tail
        data = bytearray(segment.read_bytes())
        data[-1] ^= 0xFF
        segment.write_bytes(bytes(data))
    else:
        with segment.open("ab") as out:
            out.write(tail)
    caplog.set_level(logging.WARNING, logger="spillway.controlplane")
    ingestor = Ingestor(factory, log=IngestLog(folder))
    ingestor.start()
    assert "not a whole record" in caplog.text
    assert ingestor.stats()["log_cut_records"] == 1
    assert totals(factory)[:2] == ((20, 4) if tail == "bad crc" else (30, 6))  # the whole records, once
    ingestor.ingest("a1", export("a1", T0, T0 + 4 * 10**9, 45, 9))
    assert ingestor.wait_applied()
    assert totals(factory)[:2] == (45, 9)
    ingestor.close()


@pytest.fixture
def refuse_agent_bad(factory: Any, db_url: str) -> None:
    """The database refuses rollups of agent `bad` (a trigger), as it would a row it cannot store."""
    with factory() as session, session.begin():
        if db_url.startswith("sqlite"):
            session.execute(text("CREATE TRIGGER refuse_bad BEFORE INSERT ON metric_rollups "
                                 "WHEN NEW.agent_id = 'bad' BEGIN SELECT RAISE(ABORT, 'refused'); END"))  # fmt: skip
        else:
            session.execute(text("CREATE FUNCTION refuse_bad() RETURNS trigger AS $$ BEGIN "
                                 "IF NEW.agent_id = 'bad' THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END "
                                 "$$ LANGUAGE plpgsql"))  # fmt: skip
            session.execute(text("CREATE TRIGGER refuse_bad BEFORE INSERT ON metric_rollups "
                                 "FOR EACH ROW EXECUTE FUNCTION refuse_bad()"))  # fmt: skip


@pytest.mark.usefixtures("refuse_agent_bad")
@pytest.mark.parametrize("logged", [False, True])
def test_one_bad_export_fails_alone(factory: Any, db_url: str, tmp_path: Path, logged: bool) -> None:
    """Three exports applied in one batch, the middle one refused by the database: the others are stored; without a
    log the bad one's answer carries the error, with one it was answered already and is counted as failed."""
    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log") if logged else None)
    ingestor.start()
    with writes_blocked(db_url):
        stuck = ingestor.submit("a0", export("a0", T0, T0 + 10**9, 1, 2))  # taken by the applier, which waits
        sent = [ingestor.submit(agent, export(agent, T0, T0 + 10**9, 3, 4)) for agent in ("a1", "bad", "a2")]
    assert ingestor.wait_applied(timeout=30)
    stuck.durable.result()
    sent[0].durable.result()
    sent[2].durable.result()
    if logged:
        sent[1].durable.result()
    else:
        with pytest.raises(Exception, match="refused"):
            sent[1].durable.result()
    assert [totals(factory, agent)[:2] for agent in ("a0", "a1", "bad", "a2")] == [(1, 2), (3, 4), (0, 0), (3, 4)]
    assert ingestor.stats()["failed"] == 1
    ingestor.close()


def test_mode_applied_answers_once_committed(factory: Any) -> None:
    """No log, no `start`: the first export starts the applier; its answer comes once its rollups are committed."""
    ingestor = Ingestor(factory)
    submitted = ingestor.submit("a1", export("a1", T0, T0 + 10**9, 6, 2))
    submitted.durable.result(timeout=10)
    assert totals(factory)[:2] == (6, 2)
    assert ingestor.accepted_seq == 1 and ingestor.wait_applied(1)
    ingestor.close()


def test_mode_logged_answers_before_the_database_is_written(factory: Any, db_url: str, tmp_path: Path) -> None:
    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log", fsync=False))
    ingestor.start()
    with writes_blocked(db_url):
        submitted = ingestor.submit("a1", export("a1", T0, T0 + 10**9, 6, 2))
        submitted.durable.result(timeout=10)  # in the log; the database is not writable yet
        assert not ingestor.wait_applied(timeout=0.2)
        stats = ingestor.stats()
        assert stats["queued_exports"] == 1 and stats["oldest_unapplied_s"] >= 0.2 and stats["log_bytes"] > 0
    assert ingestor.wait_applied(timeout=30)
    assert totals(factory)[:2] == (6, 2)
    ingestor.close()


def test_a_logged_export_the_database_refused_once_is_retried_not_skipped(factory: Any, db_url: str,
                                                                           tmp_path: Path) -> None:  # fmt: skip
    """A batch fails, its exports are applied one by one, and the database (not the data) refuses one of them:
    it is retried, and the exports after it wait, so that they cannot move the log's applied position past it
    (an export answered 200 would otherwise be lost for good)."""
    from sqlalchemy.exc import OperationalError

    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log", fsync=False))
    ingestor.start()
    real_apply = ingestor.applier.apply
    refused: list[str] = []

    def flaky(jobs: list[Any], durable: bool = True) -> None:
        agents = [job.folded.agent_id for job in jobs if job.folded is not None]
        if "flaky" in agents and len(jobs) > 1:
            raise ValueError("a batch with the flaky export fails")  # sends the batch one by one
        if agents == ["flaky"] and not refused:
            refused.append("flaky")
            raise OperationalError("INSERT", {}, Exception("database is locked"))
        real_apply(jobs, durable)

    ingestor.applier.apply = flaky  # type: ignore[method-assign]
    with writes_blocked(db_url):
        stuck = ingestor.submit("a0", export("a0", T0, T0 + 10**9, 1, 2))  # taken by the applier, which waits
        sent = [ingestor.submit(agent, export(agent, T0, T0 + 10**9, 3, 4)) for agent in ("a1", "flaky", "a2")]
    assert ingestor.wait_applied(timeout=30)
    for submitted in (stuck, *sent):
        submitted.durable.result()
    assert refused == ["flaky"]
    assert [totals(factory, agent)[:2] for agent in ("a0", "a1", "flaky", "a2")] == [(1, 2), (3, 4), (3, 4), (3, 4)]
    assert ingestor.stats()["failed"] == 0
    ingestor.close()


def _failing_write(*_: Any) -> int:
    raise OSError(5, "Input/output error")


def test_an_export_whose_log_write_failed_is_not_applied(factory: Any, tmp_path: Path) -> None:
    """(a) Answered 503 (its durable future failed): the agent sends it again, so it must not be applied as well."""
    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log"))
    ingestor.start()
    assert ingestor.log is not None
    ingestor.log._write = _failing_write  # type: ignore[method-assign]
    failed = ingestor.submit("a1", export("a1", T0, T0 + 10**9, 6, 2))
    with pytest.raises(OSError):
        failed.durable.result(timeout=10)
    assert ingestor.wait_applied(timeout=10)
    assert totals(factory)[:2] == (0, 0)
    del ingestor.log._write
    ingestor.ingest("a1", export("a1", T0, T0 + 10**9, 6, 2))  # the agent's retry
    ingestor.ingest("a1", export("a1", T0, T0 + 2 * 10**9, 9, 4))
    assert ingestor.wait_applied(timeout=10)
    assert totals(factory)[:2] == (9, 4)
    ingestor.close()


def test_a_log_write_error_without_fsync_is_overloaded_and_not_counted(factory: Any, tmp_path: Path) -> None:
    """(b) An OSError from the unsynced append is a 503, and the failed submission is not waited for."""
    from controlplane.errors import Overloaded

    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log", fsync=False))
    ingestor.start()
    assert ingestor.log is not None
    ingestor.log._write = _failing_write  # type: ignore[method-assign]
    with pytest.raises(Overloaded) as raised:
        ingestor.submit("a1", export("a1", T0, T0 + 10**9, 6, 2))
    assert raised.value.details == {"retry_after_s": 1}
    assert ingestor.accepted_seq == 0 and ingestor.wait_applied(timeout=1)
    del ingestor.log._write
    ingestor.ingest("a1", export("a1", T0, T0 + 10**9, 6, 2))
    assert ingestor.wait_applied(timeout=10)
    assert totals(factory)[:2] == (6, 2)
    ingestor.close()


def test_the_applier_survives_errors(factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """(c) A segment that cannot be deleted is said; an unexpected error fails its batch, not the applier thread."""
    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log", fsync=False, segment_bytes=200))
    ingestor.start()

    def denied(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", denied)
    for i in range(3):
        ingestor.ingest("a1", export("a1", T0, T0 + (i + 1) * 10**9, 2 * (i + 1), 2))
    assert ingestor.wait_applied(timeout=10)
    assert "cannot delete the applied segment" in caplog.text
    monkeypatch.undo()
    real_apply = ingestor._apply
    ingestor._apply = lambda batch: (_ for _ in ()).throw(KeyError("bug"))  # type: ignore[method-assign]
    ingestor.submit("a1", export("a1", T0, T0 + 4 * 10**9, 8, 2))
    assert ingestor.wait_applied(timeout=10)
    assert ingestor.stats()["failed"] == 1 and "the applier failed on a batch" in caplog.text
    ingestor._apply = real_apply  # type: ignore[method-assign]
    ingestor.ingest("a1", export("a1", T0, T0 + 5 * 10**9, 10, 4))
    assert ingestor.wait_applied(timeout=10)
    assert totals(factory)[:2] == (10, 4)
    assert ingestor._thread is not None and ingestor._thread.is_alive()
    ingestor.close()


def test_the_syncer_survives_an_unexpected_error(tmp_path: Path) -> None:
    """(d) Anything the syncer meets fails the waiting records' futures; later appends still complete."""
    log = IngestLog(tmp_path / "log")
    log.replay(0)
    log.resume(1)

    def bug(*_: Any) -> int:
        raise ValueError("bug")

    log._write = bug  # type: ignore[method-assign]
    with pytest.raises(ValueError):
        log.append("a1", b"x")[1].result(timeout=10)
    del log._write
    log.append("a1", b"y")[1].result(timeout=10)
    log.close()
    assert records(tmp_path / "log") == [2]


def test_close_during_a_start_that_retries_sets_closing_first(factory: Any, tmp_path: Path) -> None:
    """(e) A SIGTERM while `start` replays against a database that is down: the replay's retry loop must see
    `_closing` at once, so close cannot wait for the start lock first."""
    import threading

    ingestor = Ingestor(factory, log=IngestLog(tmp_path / "log"))
    with ingestor._start_lock:  # a start in progress
        closer = threading.Thread(target=ingestor.close, daemon=True)
        closer.start()
        closer.join(0.5)
        assert ingestor._closing
    closer.join(10)
    assert not closer.is_alive()
