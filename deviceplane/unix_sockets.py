"""Unix socket facts shared by the agent and the plugin SDK: how long a socket path may be, and how to tell a socket
replaced at the same path from the one that was there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes, NUL included

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
