"""Directory changes made durable: a file created, renamed or removed survives a crash only once its directory is
fsynced, and a new directory only once its parent is."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make the entries created, renamed or removed in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory(directory: Path, mode: int) -> None:
    """Create `directory` (and its parents) if missing, durably: its entry in the parent is fsynced, so a file made
    durable inside it cannot vanish with the directory at a crash."""
    if directory.is_dir():
        return
    directory.mkdir(mode=mode, parents=True, exist_ok=True)
    fsync_directory(directory.parent)
