"""A real inotify watch on one directory (not recursive, as device plugins set theirs), through libc: for tests and
benchmarks that check which file events the agent causes where plugins look."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

IN_ALL_EVENTS = 0xFFF
# What Go's fsnotify watches for on Linux, which device plugins use on their directory: creations, writes, attribute
# changes, renames and removals (IN_CREATE, IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM/TO, IN_DELETE, and the directory's own
# move and removal), not opens or reads.
FSNOTIFY_EVENTS = 0x100 | 0x2 | 0x4 | 0x40 | 0x80 | 0x200 | 0x400 | 0x800
_EVENT_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name, NUL-padded


@contextmanager
def watch(directory: Path, mask: int = IN_ALL_EVENTS) -> Iterator[int]:
    """A non-blocking inotify fd watching `mask`'s events in `directory`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        yield fd
    finally:
        os.close(fd)


def read_events(fd: int) -> list[tuple[int, str]]:
    """Every (mask, file name) queued on the fd now; [] when none is."""
    events: list[tuple[int, str]] = []
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return events
        offset = 0
        while offset < len(data):
            _wd, mask, _cookie, size = _EVENT_HEADER.unpack_from(data, offset)
            offset += _EVENT_HEADER.size
            events.append((mask, os.fsdecode(data[offset : offset + size].rstrip(b"\0"))))
            offset += size
