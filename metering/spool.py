"""The last resort when Redis and PostgreSQL are both down: an fsync'd local append-only file.

Each process appends to its own file (``usage-<host>-<pid>.spool``), one encoded event per
line, under an exclusive ``flock`` and followed by ``fsync`` before the append returns. A
replayer claims a file by renaming it to a unique ``*.replaying`` name, then takes the same
lock: a writer that was mid-append finishes first, and every writer checks after locking that
its path still names the file it holds, so nothing is written to a claimed file afterwards. The
replayer records the lines (request ids make a second replay of the same file harmless) and
deletes the file only after they are committed. A claimed file left by a replayer that died is
picked up by the next one.

Spool files are local to the host that wrote them: replay runs in the ingest process at start-up
and in the beat task, on the same host as the web processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SUFFIX = ".spool"
CLAIMED = ".replaying"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolWriter:
    """Appends encoded events to this process's spool file in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path: Path | None = None

    def _current_path(self) -> Path:
        return self.directory / f"usage-{socket.gethostname()}-{os.getpid()}{SUFFIX}"

    def _open(self) -> tuple[int, Path]:
        path = self._current_path()
        if self._fd is not None and self._path == path:
            return self._fd, path
        self._close()
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        _fsync_dir(self.directory)  # the new directory entry must survive a crash too
        self._fd, self._path = fd, path
        return fd, path

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = self._path = None

    def append(self, payload: bytes) -> None:
        """Append one line durably (written and fsync'd) or raise ``OSError``."""
        line = payload + b"\n"
        with self._lock:
            # a replayer may claim each new file before we write to it; it cannot keep that up
            for _ in range(100):
                fd, path = self._open()
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    try:
                        same = os.stat(path).st_ino == os.fstat(fd).st_ino
                    except FileNotFoundError:
                        same = False
                    if not same:  # a replayer claimed our file: start a new one
                        self._close()
                        continue
                    written = os.write(fd, line)
                    if written != len(line):
                        raise OSError(f"short write to the usage spool ({written} bytes)")
                    os.fsync(fd)
                    return
                finally:
                    if self._fd == fd:
                        fcntl.flock(fd, fcntl.LOCK_UN)
            raise OSError("could not hold a usage spool file")


@dataclass
class ReplayReport:
    """What one replay pass did."""

    files: int = 0
    lines: int = 0
    unreadable: list[str] = field(default_factory=list)
    left: int = 0  # files left for a later pass (locked by someone else, or the sink failed)


def _claim_all(directory: Path) -> list[Path]:
    claimed = []
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        target = path.with_name(f"{path.name}.{uuid.uuid4().hex}{CLAIMED}")
        try:
            path.rename(target)
        except FileNotFoundError:
            continue  # another replayer claimed it first
        claimed.append(target)
    if claimed:
        _fsync_dir(directory)
    return claimed


def _lines(data: bytes) -> Iterator[tuple[bytes, bool]]:
    """Yield (line, complete) for each line; an unterminated last line is a torn write."""
    *complete, last = data.split(b"\n")
    for line in complete:
        if line.strip():
            yield line, True
    if last.strip():
        yield last, False


def replay(directory: Path, sink: Callable[[list[bytes]], None], *, chunk: int = 5000
           ) -> ReplayReport:
    """Feed every spooled line to ``sink`` in chunks; delete each file once it is consumed.

    ``sink`` must make the lines durable (record them, or append them to the stream) before
    returning, and raise if it cannot: the file is then kept for the next pass.
    """
    report = ReplayReport()
    if not directory.is_dir():
        return report
    fresh = set(_claim_all(directory))
    for path in sorted(directory.glob(f"*{CLAIMED}")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            # our own fresh claims may still be locked by a writer finishing its line: wait;
            # an older claim locked by someone else is being replayed right now: skip it
            flags = fcntl.LOCK_EX if path in fresh else fcntl.LOCK_EX | fcntl.LOCK_NB
            try:
                fcntl.flock(fd, flags)
            except BlockingIOError:
                report.left += 1
                continue
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read()
            batch: list[bytes] = []
            try:
                for line, complete in _lines(data):
                    if not complete:
                        log.warning("usage spool %s ends in a torn line (the writer died "
                                    "mid-append, so that event was never acknowledged)", path)
                        report.unreadable.append(line.decode(errors="replace"))
                        continue
                    batch.append(line)
                    if len(batch) >= chunk:
                        sink(batch)
                        report.lines += len(batch)
                        batch = []
                if batch:
                    sink(batch)
                    report.lines += len(batch)
            except Exception:
                log.exception("usage spool replay of %s failed; kept for the next pass", path)
                report.left += 1
                continue
            path.unlink()
            _fsync_dir(directory)
            report.files += 1
        finally:
            os.close(fd)
    return report
