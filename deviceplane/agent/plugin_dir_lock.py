"""One agent per plugin directory.

A second agent started on a directory another one serves would remove that agent's plugin sockets at start (the
stale-socket clean-up) and bind kubelet.sock over its socket, and gRPC raises no error for it: both would run, each
half broken. An exclusive `flock` on a file in the directory, held for the process's life, makes the second one fail
at start instead, before it touches anything. The kernel drops the lock when the process dies, `kill -9` included,
so a restart never finds a stale one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

# A leading dot: the kubelet's plugin watcher and checkpoint listing skip such names.
LOCK_NAME = ".deviceplane-agent.lock"


class PluginDirBusyError(Exception):
    """Another process holds the directory's lock."""


class PluginDirLock:
    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise PluginDirBusyError naming the process that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise PluginDirBusyError(
                f"another deviceplane agent (pid {holder}) is serving {self.path.parent}: it holds {self.path}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
