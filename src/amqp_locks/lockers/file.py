"""Shared file locker: the OS lock on `<directory>/lock` (ActiveMQ's default for KahaDB).

`flock` ends with the process, so a crashed master frees the lock at once. What an OS lock
does not see is a third party deleting, replacing or rewriting the file: then a standby can
lock a *new* file while the master still holds the old one — two masters (AMQ-4705). So
the keep-alive checks that the path still names the very file we locked (same inode) and
that nobody modified it (same mtime); the new master waits one keep-alive period before
working, so an old master gets its keep-alive in first. Each acquisition writes a counter
into the file: the fencing token.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from ..errors import ConfigurationError
from .base import Locker

#: Paths locked by this process: a second locker on the same file is refused at once
#: (flock would also refuse it, but only per open file, which is easy to get wrong).
_LOCAL_GUARD: set[str] = set()
_GUARD_LOCK = threading.Lock()


class SharedFileLocker(Locker):
    settle_before_work = True

    def __init__(
        self, directory: str | os.PathLike[str], name: str = "lock", **options: object
    ) -> None:
        super().__init__(name, **options)  # type: ignore[arg-type]
        if "/" in name or name in (".", ".."):
            raise ConfigurationError(f"file locker name must be a file name, got {name!r}")
        self.directory = Path(directory)
        self.path = self.directory / name
        self._fd: int | None = None
        self._identity: tuple[int, int, int] | None = None  # (dev, ino, mtime_ns)

    def _try_acquire(self) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        with _GUARD_LOCK:
            if key in _LOCAL_GUARD:
                return False
            _LOCAL_GUARD.add(key)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            with _GUARD_LOCK:
                _LOCAL_GUARD.discard(key)
            return False
        try:
            st_fd, st_path = os.fstat(fd), os.stat(self.path)
            if (st_fd.st_dev, st_fd.st_ino) != (st_path.st_dev, st_path.st_ino):
                raise FileNotFoundError("lock file replaced while locking")
            raw = os.pread(fd, 64, 0).decode(errors="replace").strip()
            counter = int(raw.split()[0]) if raw[:1].isdigit() else 0
            self.fencing_token = counter + 1
            payload = f"{self.fencing_token} {self.holder_id}\n".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, payload, 0)
            os.fsync(fd)
            st = os.fstat(fd)
            self._identity = (st.st_dev, st.st_ino, st.st_mtime_ns)
        except BaseException:
            os.close(fd)
            with _GUARD_LOCK:
                _LOCAL_GUARD.discard(key)
            return False
        self._fd = fd
        return True

    def _keep_alive(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino, st.st_mtime_ns) == self._identity

    def _release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        with _GUARD_LOCK:
            _LOCAL_GUARD.discard(os.path.realpath(self.path))

    def __repr__(self) -> str:
        return f"SharedFileLocker({str(self.path)!r})"
