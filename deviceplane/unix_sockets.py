"""Unix socket facts shared by the agent and the plugin SDK: how long a socket path may be, how to tell a socket
replaced at the same path from the one that was there, and how the agent serves a socket of its own again when
someone removes it."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes, NUL included
SOCKET_CHECK_INTERVAL_SECONDS = 1.0

SocketIdentity = tuple[int, ...]


def _socket_stat(path: Path) -> os.stat_result | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info if stat.S_ISSOCK(info.st_mode) else None


def socket_identity(path: Path) -> SocketIdentity | None:
    """A socket we created: the same one as long as its inode is (device, inode). Not the ctime: a chmod, chown,
    touch or SELinux relabel changes it, and must not count as a replacement (that cut the kubelet's streams).
    None when no socket is there."""
    info = _socket_stat(path)
    return None if info is None else (info.st_dev, info.st_ino)


def kubelet_socket_identity(path: Path) -> SocketIdentity | None:
    """kubelet.sock: (device, inode, ctime). The kubelet deletes and re-creates it at once when it starts, and the new
    one may get the old inode number; a metadata change then costs one needless registration, a missed restart would
    leave a plugin unregistered."""
    info = _socket_stat(path)
    return None if info is None else (info.st_dev, info.st_ino, info.st_ctime_ns)


async def serve_again_when_removed(
    path: Path, serve: Callable[[], Awaitable[None]], what: str, log: logging.Logger
) -> None:
    """Runs until cancelled: once a second, when nothing is at `path` any more (a clean-up script, an operator's `rm`),
    logs a warning and calls `serve` (after making the directory again), which binds a new socket there, so clients
    that dial by path reach the server again. Anything at the path (our socket, a regular file, another
    process's socket) is left alone: not ours to remove. `serve` stops the old server before binding the new one:
    grpc's stop unlinks whatever socket is at its path by then. A failed serve is logged and tried again a second
    later."""
    while True:
        await asyncio.sleep(SOCKET_CHECK_INTERVAL_SECONDS)
        if path.exists():  # noqa: ASYNC240 - one stat of a local path a second: not worth a thread
            continue
        log.warning("%s socket disappeared; serving again", what, extra={"socket": str(path)})
        try:
            path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            await serve()
        except (OSError, RuntimeError) as err:
            log.error("cannot serve the %s socket: %s", what, err, extra={"socket": str(path)})
