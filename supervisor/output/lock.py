"""The output folder's lock: one live supervisor per output folder.

`OUT/.export/lock` is held with flock(LOCK_EX | LOCK_NB) for the whole run and holds the owner's pid. The kernel
drops the lock when its owner dies, so a lock left by a killed supervisor never blocks the next run.
Owns the lock file only.
"""
from __future__ import annotations

import fcntl
import os

from shared import layout
from supervisor.errors import LockedError, OutputError


def _owner(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 64).decode(errors="replace").strip() or "unknown"


def probe(output: str) -> None:
    """Raise LockedError if a live supervisor holds the lock; creates nothing."""
    p = layout.state_path(output, layout.LOCK)
    try:
        fd = os.open(p, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _owner(fd)
        raise LockedError(f"output {output!r} is being exported by another supervisor (pid {pid}); "
                          "wait for it to finish or stop it", pid=int(pid) if pid.isdigit() else None) from None
    finally:
        os.close(fd)


class Lock:
    def __init__(self, output: str):
        self.path = layout.state_path(output, layout.LOCK)
        self.output = output
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot create the lock in {self.output!r}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _owner(fd)
            os.close(fd)
            raise LockedError(f"output {self.output!r} is being exported by another supervisor (pid {pid}); "
                              "wait for it to finish or stop it", pid=int(pid) if pid.isdigit() else None) from None
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
