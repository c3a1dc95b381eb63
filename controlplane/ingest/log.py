"""The ingest log: each acknowledged OTLP export, appended before the answer, so a crash after the 200 loses nothing.

Layout: `<folder>/<database>/slot-<k>/` (the database's subfolder is a hash of its URL without the password), one
slot per process, held with `fcntl.flock` on its `lock` file (the first free slot; a new one when all are busy). A
slot's `id` file names it in the database (`ingest_log_positions`: how far its records have been applied, written
in the transaction that applies them). Records go to segment files `seg-<first seq>.log` (0600), a new one past
`segment_bytes`; a segment is deleted once every record in it is applied.

A record: `<u32 length><u32 crc32 of the payload>` then the payload `<u64 seq><u16 agent id length><agent id><the
export's protobuf encoding>`. A write cut short by a crash leaves a torn record at the end of the newest segment:
reading stops there, the file is cut back to its last whole record and a warning says so; the exports after it were
never acknowledged. With `fsync`, appends are made durable by a syncer thread, one `fsync` for all the records
written since its last one (group commit); the future of each record completes then. With `fsync` the syncer also
does the writes: `append` only queues the record, so a caller on the event loop never waits on a lock held across a
write or an fsync.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import queue
import struct
import threading
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

from sqlalchemy.engine import make_url

from controlplane.db.session import normalise_url
from controlplane.settings import Settings

log = logging.getLogger("spillway.controlplane")

SEGMENT_BYTES = 8 << 20
_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
_PAYLOAD = struct.Struct("<QH")  # seq, agent id length
_MAX_PAYLOAD = 1 << 30  # a larger length is not a record: the rest of the file is torn


class Record(NamedTuple):
    seq: int
    agent_id: str
    body: bytes  # the export's protobuf encoding


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class IngestLog:
    """One slot of the ingest log, held (flock) from construction to `close`. Appends are thread-safe."""

    def __init__(self, folder: Path, *, fsync: bool = True, segment_bytes: int = SEGMENT_BYTES,
                 slot: Path | None = None) -> None:  # fmt: skip
        """Take the first free slot under `folder` (the database's subfolder), or exactly `slot` (BlockingIOError
        if another process holds it)."""
        self.folder = folder
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if slot is not None:
            self.path, self._lock_fd = slot, self._take(slot)
        else:
            self.path, self._lock_fd = self._first_free()
        self.log_id = self._slot_id()
        self._segments: list[tuple[int, Path]] = sorted(
            (int(p.name[4:-4]), p) for p in self.path.glob("seg-*.log") if p.name[4:-4].isdigit()
        )
        self._sizes = {path: path.stat().st_size for _, path in self._segments}
        self.last_seq = 0  # the last record's seq found by `replay` (then: appended)
        self.cut_records = 0  # torn records cut by `replay`
        self._fd: int | None = None  # the segment appended to
        self._next = 1
        self._lock = threading.Lock()  # seqs, the queued records, the segment list (never held across I/O)
        # With fsync: records taken, not written yet (seq, agent id, body, future completed once written and
        # fsynced); None once closing. A SimpleQueue: putting never waits for the syncer.
        self._pending: queue.SimpleQueue[tuple[int, bytes, bytes, Future[None]] | None] = queue.SimpleQueue()
        self._append_lock = threading.Lock()  # the seqs and their order in `_pending` (appenders only)
        self._retired: list[int] = []  # rotated segments' descriptors, fsynced and closed by the syncer
        self._syncer: threading.Thread | None = None
        self._closing = False

    # ---- the slot -----------------------------------------------------------------------------------------------

    @staticmethod
    def _take(slot: Path) -> int:
        slot.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        return fd

    def _first_free(self) -> tuple[Path, int]:
        k = 0
        while True:
            slot = self.folder / f"slot-{k}"
            with contextlib.suppress(BlockingIOError):
                return slot, self._take(slot)
            k += 1

    def _slot_id(self) -> str:
        id_file = self.path / "id"
        if not id_file.exists():
            temporary = self.path / "id.tmp"
            temporary.write_text(uuid.uuid4().hex)
            temporary.replace(id_file)
        return id_file.read_text().strip()

    def idle_slots(self) -> list[IngestLog]:
        """The other slots of this database that no process holds now, each taken (close each when done): a process
        that held one crashed or is gone (fewer workers), and their unapplied records are this process's to apply."""
        taken = []
        for slot in sorted(self.folder.glob("slot-*")):
            if slot == self.path or not slot.is_dir():
                continue
            with contextlib.suppress(BlockingIOError):
                taken.append(IngestLog(self.folder, fsync=self.fsync, segment_bytes=self.segment_bytes, slot=slot))
        return taken

    # ---- reading back -------------------------------------------------------------------------------------------

    def replay(self, after: int) -> Iterator[Record]:
        """The records with seq > `after`, oldest first; a torn tail is cut. Before `resume`."""
        for i, (_, path) in enumerate(self._segments):
            data = path.read_bytes()
            end = 0
            while end < len(data):
                record, size = _parse(data, end)
                if record is None:
                    break
                end += size
                self.last_seq = max(self.last_seq, record.seq)
                if record.seq > after:
                    yield record
            if end < len(data):
                self.cut_records += 1
                newest = i == len(self._segments) - 1
                why = "a write cut short by a crash" if newest else "damaged: what follows is gone"
                log.warning("ingest log %s: %d bytes at the end of %s are not a whole record (%s); cut there",
                            self.path, len(data) - end, path.name, why)  # fmt: skip
                os.truncate(path, end)
                self._sizes[path] = end

    def resume(self, next_seq: int) -> None:
        """Append from `next_seq` on (past every record replayed and every seq the database has seen applied), in a
        new segment."""
        with self._lock:
            self._next = max(next_seq, self.last_seq + 1)
            self._rotate()

    # ---- appending ----------------------------------------------------------------------------------------------

    def append(self, agent_id: str, body: bytes) -> tuple[int, Future[None]]:
        """Take a record; its seq, and a future done once it is durable (written; with `fsync`, fsynced).

        Without `fsync` the record is written here. With it, nothing slow happens under the lock a caller may wait
        on (the event loop does): the record is queued and the syncer thread writes every queued record, fsyncs them
        at once (group commit) and completes their futures."""
        agent = agent_id.encode()
        if not self.fsync:
            with self._lock:
                if self._fd is None:
                    raise RuntimeError("the ingest log is not open for appends (resume) or is closed")
                seq = self._next
                self._next += 1
                self.last_seq = seq
                self._write([(seq, _record(seq, agent, body))], self._fd)
            return seq, _done()
        future: Future[None] = Future()
        with self._append_lock:  # only appenders take it: the syncer takes records from a SimpleQueue
            if self._fd is None or self._closing:
                raise RuntimeError("the ingest log is not open for appends (resume) or is closed")
            seq = self._next
            self._next += 1
            self.last_seq = seq
            self._pending.put((seq, agent, body, future))  # framed by the syncer (crc32 releases the GIL)
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_loop, name="spillway-ingest-log-sync", daemon=True)
                self._syncer.start()
        return seq, future

    def _write(self, records: list[tuple[int, bytes]], fd: int) -> int:
        """Write `records` to the newest segment (`fd`), a new segment whenever it reaches `segment_bytes`; the
        descriptor written last. Without `fsync` under the lock; with it, by the syncer alone (it owns the segment
        files then), taking the lock only to update the segment list."""
        i = 0
        while i < len(records):
            path = self._segments[-1][1]
            room = self.segment_bytes - self._sizes[path]
            j, size = i, 0
            while j < len(records) and (j == i or size + len(records[j][1]) <= room):
                size += len(records[j][1])
                j += 1
            chunk = b"".join(record for _, record in records[i:j])
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                with contextlib.suppress(OSError):  # no torn record before the next ones: they would be cut with it
                    os.ftruncate(fd, self._sizes[path])
                raise
            if self.fsync:
                with self._lock:
                    self._sizes[path] += size
            else:
                self._sizes[path] += size
            i = j
            if self._sizes[path] >= self.segment_bytes:
                next_seq = records[i][0] if i < len(records) else records[-1][0] + 1
                if self.fsync:
                    self._retired.append(fd)
                    with self._lock:
                        fd = self._open_segment(next_seq)
                    _fsync_folder(self.path)
                else:
                    os.close(fd)
                    fd = self._open_segment(next_seq)
        return fd

    def _open_segment(self, first_seq: int) -> int:
        """Open the segment `seg-<first_seq>.log` and make it the newest (under the lock): its descriptor."""
        path = self.path / f"seg-{first_seq:020d}.log"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        if self._segments and self._segments[-1][1] == path:
            self._segments.pop()  # an empty segment left by the last process (its name is the next seq)
        self._segments.append((first_seq, path))
        self._sizes[path] = 0
        return self._fd

    def _rotate(self) -> None:
        """A new segment for the next record (under the lock; before the syncer runs)."""
        if self._fd is not None:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
        self._open_segment(self._next)
        if self.fsync:
            _fsync_folder(self.path)

    def _sync_loop(self) -> None:
        pending = self._pending
        closing = False
        while not closing:
            taken = [pending.get()]  # blocks until a record (or None: closing) comes
            with contextlib.suppress(queue.Empty):
                while True:
                    taken.append(pending.get_nowait())
            closing = taken[-1] is None
            waiting = [future for *_, future in filter(None, taken)]
            fd = self._fd
            error: BaseException | None = None
            try:
                records = [(seq, _record(seq, agent, body)) for seq, agent, body, _ in filter(None, taken)]
                if records:
                    if fd is None:  # closed under it (a simulated crash): these were never acknowledged
                        raise OSError("the ingest log's segment is closed")
                    fd = self._write(records, fd)
                for old in self._retired:
                    os.fsync(old)
                    os.close(old)
                self._retired.clear()
                if fd is not None and waiting:
                    os.fdatasync(fd)  # every record of `waiting` was written to `fd` or to a retired one
            except OSError as exc:
                log.error("ingest log %s: write or fsync failed: %s", self.path, exc)
                error = exc
            except BaseException as exc:  # a bug: these records fail (answered 503), the syncer goes on
                log.error("ingest log %s: the syncer failed", self.path, exc_info=True)
                error = exc
            for future in waiting:
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

    # ---- applied ------------------------------------------------------------------------------------------------

    def deletable(self, seq: int) -> bool:
        """Whether applying every record up to `seq` frees a segment."""
        with self._lock:
            return len(self._segments) > 1 and self._segments[1][0] - 1 <= seq

    def applied(self, seq: int, durable: bool = True) -> None:
        """Every record up to `seq` is in the database: delete the segments that hold nothing newer. Not `durable`
        (a commit a power loss may undo): only when the log is not fsynced either."""
        if not durable and self.fsync:
            return
        with self._lock:
            while len(self._segments) > 1 and self._segments[1][0] - 1 <= seq:
                _, path = self._segments.pop(0)
                self._sizes.pop(path, None)
                _unlink(path)

    def drop_all(self) -> None:
        """Delete every segment (an idle slot whose records are all applied)."""
        with self._lock:
            for _, path in self._segments:
                _unlink(path)
            self._segments, self._sizes = [], {}

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def close(self) -> None:
        """Make every record durable, close the segment and release the slot. Idempotent."""
        with self._append_lock:
            if self._syncer is not None and not self._closing:
                self._pending.put(None)
            self._closing = True
            syncer = self._syncer
        if syncer is not None:
            syncer.join()
        with self._lock:
            if self._fd is not None:
                if self.fsync:
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1


def _record(seq: int, agent: bytes, body: bytes) -> bytes:
    payload = _PAYLOAD.pack(seq, len(agent)) + agent + body
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _parse(data: bytes, at: int) -> tuple[Record | None, int]:
    """The record at `at` and its size; (None, 0) where no whole, intact record starts."""
    if at + _HEADER.size > len(data):
        return None, 0
    length, crc = _HEADER.unpack_from(data, at)
    start = at + _HEADER.size
    if length < _PAYLOAD.size or length > _MAX_PAYLOAD or start + length > len(data):
        return None, 0
    payload = data[start : start + length]
    if zlib.crc32(payload) != crc:
        return None, 0
    seq, agent_length = _PAYLOAD.unpack_from(payload)
    if _PAYLOAD.size + agent_length > length:
        return None, 0
    agent_end = _PAYLOAD.size + agent_length
    try:
        agent_id = payload[_PAYLOAD.size : agent_end].decode()
    except UnicodeDecodeError:
        return None, 0
    return Record(seq, agent_id, payload[agent_end:]), _HEADER.size + length


def _unlink(path: Path) -> None:
    """Delete an applied segment; a failure (permissions, I/O) is said, never raised: the applier goes on."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("ingest log: cannot delete the applied segment %s: %s", path, exc)


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def log_folder(settings: Settings) -> Path | None:
    """The database's folder of the ingest log (None: an in-memory SQLite database, nothing to replay into)."""
    url = make_url(normalise_url(settings.database_url))
    if url.get_backend_name() == "sqlite" and (not url.database or url.database == ":memory:" or
                                               "mode=memory" in str(url)):  # fmt: skip
        return None
    if settings.ingest_log_dir:
        base = Path(settings.ingest_log_dir).expanduser()
    elif url.get_backend_name() == "sqlite":
        assert url.database is not None
        database = Path(url.database).expanduser().absolute()
        base = database.with_name(database.name + ".ingest-log")
    else:
        state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        base = Path(state) / "spillway" / "ingest-log"
    if url.get_backend_name() == "sqlite" and url.database:
        identity = str(Path(url.database).expanduser().absolute())
    else:
        identity = url._replace(password=None).render_as_string(hide_password=False)  # (`set` keeps it)
    return base / hashlib.sha256(identity.encode()).hexdigest()[:16]


def open_ingest_log(settings: Settings) -> IngestLog | None:
    """This process's slot of the ingest log, taken; None in mode `applied` or for an in-memory database."""
    if settings.ingest_ack != "logged":
        return None
    folder = log_folder(settings)
    if folder is None:
        return None
    return IngestLog(folder, fsync=settings.ingest_log_fsync)


__all__ = ["IngestLog", "Record", "log_folder", "open_ingest_log"]
