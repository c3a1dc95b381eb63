"""The async queue's store: FIFO claims, a bound, expiry, retries, and no accepted job lost to a crash."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.overflow.jobs import Job, JobNotRunning, JobStore, QueueFull, StoreFull
from tests.utils.fullfs import SmallDisk, small_disk

RESPONSE = json.dumps({"model_name": "mlp", "outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1]}]})


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.db", max_jobs=3, ttl_s=60.0, clock=clock) as opened:
        yield opened


def claimed(store: JobStore, models: list[str] | None = None) -> Job:
    job = store.claim(models)
    assert job is not None
    return job


def test_claims_are_first_in_first_out_and_carry_the_request(store: JobStore, clock: FakeClock) -> None:
    first = store.submit("mlp", "1", b'{"inputs": []}', None)
    clock.now += 1
    second = store.submit("mlp", None, b"\x00binary", 14)
    assert first.status == "queued" and first.request is None and second.header_length == 14
    job = claimed(store)
    assert (job.id, job.status, job.attempts, job.started_at) == (first.id, "running", 1, clock.now)
    assert job.request == b'{"inputs": []}'
    job = claimed(store)
    assert (job.id, job.request, job.header_length, job.version) == (second.id, b"\x00binary", 14, None)
    assert store.claim() is None


def test_claim_takes_only_the_models_asked_for(store: JobStore) -> None:
    mlp = store.submit("mlp", None, b"{}", None)
    cnn = store.submit("cnn", None, b"{}", None)
    assert claimed(store, ["cnn", "other"]).id == cnn.id
    assert store.claim(["cnn"]) is None and store.claim([]) is None
    assert claimed(store, {"mlp"}).id == mlp.id
    with pytest.raises(TypeError):
        store.claim("mlp")


def test_ids_are_unguessable() -> None:
    ids = set()
    with JobStore(Path(":memory:"), max_jobs=100) as store:
        for _ in range(100):
            ids.add(store.submit("mlp", None, b"{}", None).id)
    assert len(ids) == 100 and all(len(i) >= 22 for i in ids)  # 16 random bytes, url-safe base64


def test_the_queue_is_bounded_and_has_room_again_once_a_job_ends(store: JobStore) -> None:
    jobs = [store.submit("mlp", None, b"{}", None) for _ in range(3)]
    with pytest.raises(QueueFull, match="max_jobs=3"):
        store.submit("mlp", None, b"{}", None)
    running = claimed(store)  # running jobs count against the bound too
    with pytest.raises(QueueFull):
        store.submit("mlp", None, b"{}", None)
    store.finish(running.id, RESPONSE.encode())
    store.submit("mlp", None, b"{}", None)
    assert store.counts() == {"queued": 3, "running": 0, "done": 1, "failed": 0, "expired": 0}
    assert jobs[0].id == running.id


def test_finish_keeps_the_response_and_drops_the_request(store: JobStore, clock: FakeClock) -> None:
    job = store.submit("mlp", "2", b"{}", None)
    claimed(store)
    clock.now += 0.5
    store.finish(job.id, RESPONSE.encode())
    done = store.get(job.id, with_request=True)
    assert done is not None and done.status == "done" and done.finished_at == clock.now
    assert done.request is None and done.response == RESPONSE.encode()
    with pytest.raises(JobNotRunning):
        store.finish(job.id, RESPONSE.encode())  # only a running job ends


def test_finish_refuses_a_response_that_is_not_a_json_object(store: JobStore) -> None:
    job = store.submit("mlp", None, b"{}", None)
    claimed(store)
    for bad in (b"not json", b"[1, 2]"):
        with pytest.raises(ValueError):
            store.finish(job.id, bad)
    got = store.get(job.id)
    assert got is not None and got.status == "running"  # the drainer can still fail it


def test_json_has_everything_but_the_request_with_the_response_decoded(store: JobStore, clock: FakeClock) -> None:
    job = store.submit("mlp", "1", b"secret input", 5)
    assert job.json() == {"id": job.id, "model": "mlp", "version": "1", "status": "queued",
                          "created_at": clock.now, "expires_at": clock.now + 60, "started_at": None,
                          "finished_at": None, "attempts": 0, "error": None, "header_length": 5,
                          "response": None}  # fmt: skip
    claimed(store)
    store.finish(job.id, RESPONSE.encode())
    done = store.get(job.id, with_request=True)
    assert done is not None
    shape = done.json()
    assert shape["response"] == json.loads(RESPONSE) and shape["status"] == "done"
    assert "request" not in shape and b"secret" not in json.dumps(shape).encode()


def test_get_of_an_unknown_id_is_none(store: JobStore) -> None:
    assert store.get("no-such-job") is None
    for call in (store.requeue, lambda i: store.fail(i, "x"), lambda i: store.finish(i, b"{}")):
        with pytest.raises(JobNotRunning):
            call("no-such-job")


def test_get_leaves_the_request_out_unless_asked(store: JobStore) -> None:
    job = store.submit("mlp", None, b"body", 4)
    got, full = store.get(job.id), store.get(job.id, with_request=True)
    assert got is not None and got.request is None and got.header_length == 4
    assert full is not None and full.request == b"body"


def test_fail_with_retry_queues_it_again_until_max_attempts(store: JobStore) -> None:
    job = store.submit("mlp", None, b"{}", None)
    for attempt in (1, 2):
        assert claimed(store).attempts == attempt
        store.fail(job.id, f"backend error {attempt}", retry=True, max_attempts=3)
        again = store.get(job.id)
        assert again is not None and again.status == "queued" and again.error == f"backend error {attempt}"
    assert claimed(store).attempts == 3
    store.fail(job.id, "backend error 3", retry=True, max_attempts=3)
    failed = store.get(job.id, with_request=True)
    assert failed is not None and failed.status == "failed" and failed.error == "backend error 3"
    assert failed.finished_at is not None and failed.request is None


def test_fail_without_retry_ends_it_at_once(store: JobStore) -> None:
    job = store.submit("mlp", None, b"{}", None)
    claimed(store)
    store.fail(job.id, "bad input")
    got = store.get(job.id)
    assert got is not None and (got.status, got.attempts) == ("failed", 1)


def test_requeue_gives_the_attempt_back_and_keeps_its_place(store: JobStore) -> None:
    first = store.submit("mlp", None, b"{}", None)
    store.submit("mlp", None, b"{}", None)
    job = claimed(store)
    store.requeue(job.id)  # refused by admission: not an attempt
    again = claimed(store)
    assert again.id == first.id and again.attempts == 1


def test_queued_jobs_expire_and_ended_jobs_are_deleted_ttl_after(store: JobStore, clock: FakeClock) -> None:
    stale = store.submit("mlp", None, b"{}", None)
    clock.now += 30
    fresh = store.submit("mlp", None, b"{}", None)
    run = claimed(store)  # the oldest
    assert run.id == stale.id
    store.finish(run.id, RESPONSE.encode())  # ended at t0 + 30
    clock.now += 30  # t0 + 60: `fresh` has 30 s left, `run` ended 30 s ago
    late = store.submit("mlp", None, b"{}", None)
    assert store.expire() == 0
    clock.now += 30  # t0 + 90: `fresh` is past its expires_at
    assert store.claim() is not None  # `late` (t0 + 60), never the expired one
    assert store.expire() == 1  # `run` ended 60 s ago: deleted; `fresh` was marked expired by claim
    assert store.get(run.id) is None
    got = store.get(fresh.id, with_request=True)
    assert got is not None and got.status == "expired" and got.request is None
    assert got.finished_at == got.expires_at == fresh.created_at + 60  # kept ttl_s from when it expired
    clock.now = fresh.created_at + 120
    assert store.get(fresh.id) is None  # gone for get at once, before a sweep deletes it
    assert late.id != fresh.id


def test_get_expires_a_queued_job_lazily(store: JobStore, clock: FakeClock) -> None:
    job = store.submit("mlp", None, b"{}", None)
    clock.now += 60
    got = store.get(job.id)
    assert got is not None and got.status == "expired"
    assert store.counts()["expired"] == 1 and store.counts()["queued"] == 0


def test_expired_jobs_free_their_place_in_the_queue(store: JobStore, clock: FakeClock) -> None:
    for _ in range(3):
        store.submit("mlp", None, b"{}", None)
    clock.now += 61
    store.submit("mlp", None, b"{}", None)  # no QueueFull: the three expired
    assert store.counts()["queued"] == 1


def test_a_submitted_job_survives_closing_and_reopening(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as store:
        queued = store.submit("mlp", "1", b"payload", 7)
        running = store.submit("mlp", "1", b"other", None)
        store.claim()
        store.claim()
    with JobStore(path) as store:
        got = store.get(queued.id, with_request=True)
        assert got is not None and (got.status, got.request, got.header_length) == ("queued", b"payload", 7)
        again = store.get(running.id)
        assert again is not None and (again.status, again.attempts, again.started_at) == ("queued", 1, None)
        assert [claimed(store).id, claimed(store).id] == [queued.id, running.id]


def _in_a_child(path: Path, code: str) -> str:
    """Run `code` against a store at `path` in a fresh interpreter that dies with os._exit: no cleanup at all."""
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from edge_agent.overflow.jobs import JobStore\n"
        f"store = JobStore(Path({str(path)!r}))\n"
        f"{code}\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_job_submitted_just_before_the_process_dies_is_there_after_a_restart(tmp_path: Path) -> None:
    # os._exit skips closing the database and every finaliser; the WAL file is all that holds the job.
    # (A power cut is what synchronous=FULL is for; a test cannot cut the power, so this covers the process.)
    path = tmp_path / "jobs.db"
    job_id = _in_a_child(path, "print(store.submit('mlp', '1', b'accepted', None).id)")
    with JobStore(path) as store:
        got = store.get(job_id, with_request=True)
        assert got is not None and got.status == "queued" and got.request == b"accepted"


def test_a_job_running_when_the_process_dies_is_queued_again_with_its_attempts(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    job_id = _in_a_child(path, "job = store.submit('mlp', None, b'x', None); store.claim(); print(job.id)")
    with JobStore(path) as store:
        got = store.get(job_id)
        assert got is not None and (got.status, got.attempts) == ("queued", 1)


def test_a_job_that_keeps_killing_the_process_is_failed_not_queued_forever(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    job_id = _in_a_child(path, "job = store.submit('mlp', None, b'poison', None); print(job.id)")
    for _ in range(2):
        _in_a_child(path, "store.claim()")
    with JobStore(path, max_attempts=3) as store:
        got = store.get(job_id)
        assert got is not None and got.status == "queued" and got.attempts == 2
    _in_a_child(path, "store.claim()")  # the third process to die running it
    with JobStore(path, max_attempts=3) as store:
        got = store.get(job_id, with_request=True)
        assert got is not None and got.status == "failed" and "interrupted 3 times" in (got.error or "")
        assert got.request is None


def test_concurrent_submits_from_threads_lose_nothing(tmp_path: Path) -> None:
    threads, each = 8, 25
    with JobStore(tmp_path / "jobs.db", max_jobs=threads * each) as store:
        ids: list[str] = []
        errors: list[BaseException] = []
        start = threading.Barrier(threads)

        def submit_many() -> None:
            try:
                start.wait()
                mine = [store.submit("mlp", None, b"{}", None).id for _ in range(each)]
                ids.extend(mine)
            except BaseException as error:
                errors.append(error)

        workers = [threading.Thread(target=submit_many) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert errors == []
        assert len(set(ids)) == threads * each
        assert store.counts()["queued"] == threads * each
        with pytest.raises(QueueFull):
            store.submit("mlp", None, b"{}", None)
        claims = [store.claim() for _ in range(threads * each)]
        assert {job.id for job in claims if job is not None} == set(ids)


@pytest.mark.parametrize(("setting", "value"), [("max_jobs", 0), ("ttl_s", 0.0), ("ttl_s", float("nan")),
                                                ("max_attempts", 0)])  # fmt: skip
def test_the_store_refuses_nonsense_naming_the_setting(tmp_path: Path, setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        JobStore(tmp_path / "jobs.db", **{setting: value})  # type: ignore[arg-type]
    assert not (tmp_path / "jobs.db").exists()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path / "disk") as mounted:
        yield mounted


def test_a_full_disk_is_store_full_reads_still_work_and_writes_work_again_once_space_returns(
    disk: SmallDisk, clock: FakeClock
) -> None:
    with JobStore(disk.root / "jobs.db", ttl_s=60.0, clock=clock) as store:
        waiting = store.submit("mlp", None, b"x" * 20_000, None)
        running = claimed(store)
        stale = store.submit("mlp", None, b"{}", None)
        disk.fill()
        for _ in range(3):  # each refusal leaves the store as it was, and usable
            with pytest.raises(StoreFull) as refused:
                store.submit("mlp", None, b"x" * 20_000, None)
            assert refused.value.reason == "async_storage_full" and "database or disk is full" in str(refused.value)
            assert isinstance(refused.value.__cause__, sqlite3.OperationalError)
        with pytest.raises(StoreFull):
            store.finish(running.id, RESPONSE.encode())
        with pytest.raises(StoreFull):
            store.fail(running.id, "x", retry=True)
        # Reads never write: a client still gets its job, counts still count (expiry shown, not written).
        got = store.get(running.id)
        assert got is not None and got.status == "running" and got.id == waiting.id
        clock.now += 61
        expired = store.get(stale.id, with_request=True)
        assert expired is not None and (expired.status, expired.request) == ("expired", None)
        assert store.counts() == {"queued": 0, "running": 1, "done": 0, "failed": 0, "expired": 1}

        disk.free()
        again = store.submit("mlp", None, b"x" * 20_000, None)
        store.finish(running.id, RESPONSE.encode())
        assert store.counts() == {"queued": 1, "running": 0, "done": 1, "failed": 0, "expired": 1}
        assert claimed(store).id == again.id
