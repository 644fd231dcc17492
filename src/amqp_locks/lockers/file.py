"""Shared file locker: the OS lock on `<directory>/lock` (ActiveMQ's default for KahaDB).

`flock` ends with the process, so a crashed master frees the lock at once. What an OS lock
does not see is a third party deleting, replacing or rewriting the file: then a standby can
lock a *new* file while the master still holds the old one — two masters (AMQ-4705). So
the keep-alive checks that the path still names the very file we locked (same inode) and
that nobody modified it (same mtime); the new master waits one keep-alive period before
working, so an old master gets its keep-alive in first. Each acquisition writes a counter
into the file: the fencing token. The counter is also kept beside it in `<name>.fence`, so
that a deleted or replaced lock file does not restart the tokens at 1 (a fencing resource
would then refuse the new master and accept the old one).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

from ..errors import ConfigurationError, FeatureUnavailable
from .base import Locker

#: Paths locked by this process: a second locker on the same file is refused at once
#: (flock would also refuse it, but only per open file, which is easy to get wrong).
_LOCAL_GUARD: set[str] = set()
_GUARD_LOCK = threading.Lock()


def _fcntl() -> ModuleType:
    """POSIX ``fcntl``, imported where it is used, so the package imports everywhere."""
    try:
        import fcntl
    except ImportError:  # Windows
        raise FeatureUnavailable(
            "SharedFileLocker needs POSIX flock (fcntl), which this platform lacks; use "
            "DatabaseLocker with SQLite, or the AmqpLocker"
        ) from None
    return fcntl


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
        self.fence_path = self.directory / f"{name}.fence"
        self._flock = _fcntl()  # fail at construction, not at the first election
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
            self._flock.flock(fd, self._flock.LOCK_EX | self._flock.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            with _GUARD_LOCK:
                _LOCAL_GUARD.discard(key)
            return False
        try:
            st_fd, st_path = os.fstat(fd), os.stat(self.path)
            if (st_fd.st_dev, st_fd.st_ino) != (st_path.st_dev, st_path.st_ino):
                raise FileNotFoundError("lock file replaced while locking")
            counter = max(_counter(os.pread(fd, 64, 0)), self._read_fence())
            self.fencing_token = counter + 1
            self._write_fence(self.fencing_token)
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

    def _read_fence(self) -> int:
        try:
            return _counter(self.fence_path.read_bytes())
        except FileNotFoundError:
            return 0

    def _write_fence(self, token: int) -> None:
        """Replace `<name>.fence` atomically (a crash leaves the old or the new counter)."""
        tmp = self.directory / f".{self.fence_path.name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"{token}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.fence_path)

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
                self._flock.flock(fd, self._flock.LOCK_UN)
            finally:
                os.close(fd)
        with _GUARD_LOCK:
            _LOCAL_GUARD.discard(os.path.realpath(self.path))

    def __repr__(self) -> str:
        return f"SharedFileLocker({str(self.path)!r})"


def _counter(raw: bytes) -> int:
    """The counter at the start of a lock or fence file (0 when empty or unreadable)."""
    text = raw.decode(errors="replace").strip()
    head = text.split()[0] if text else ""
    return int(head) if head.isdigit() else 0
