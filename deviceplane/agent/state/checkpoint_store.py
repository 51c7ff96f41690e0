"""The checkpoint file on disk: atomic writes, and reads that never stop the agent from starting (spec §4.6, §4.9).

Same layout as the kubelet's checkpoint manager: `<dir>/kubelet_internal_checkpoint`, written through a temp file
`.<random>` (mode 0600) in the same directory that is fsynced, closed and renamed over it. The directory is fsynced
too, so a write that returned survives a crash or SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from deviceplane.agent.state.directories import fsync_directory
from deviceplane.core.checkpoint import (
    CheckpointData,
    CheckpointError,
    CorruptCheckpointError,
    decode,
    encode,
)
from deviceplane.core.constants import CHECKPOINT_NAME, CHECKPOINT_TEMP_PREFIX

log = logging.getLogger("deviceplane.checkpoint")

_DIRECTORY_MODE = 0o750  # what the kubelet's registration server creates its directory with


def _utc_now() -> datetime:
    return datetime.now(UTC)


class CheckpointStore:
    """Reads and writes `kubelet_internal_checkpoint` in `directory`. Blocking: call it off the event loop."""

    def __init__(self, directory: str | os.PathLike[str], clock: Callable[[], datetime] = _utc_now) -> None:
        self.directory = Path(directory)
        self.path = self.directory / CHECKPOINT_NAME
        self._clock = clock  # names moved-aside files
        self._lock = threading.Lock()  # one writer/reader at a time, as the kubelet's checkpoint manager

    def write(self, data: CheckpointData) -> None:
        """Replace the checkpoint with `data`, atomically and durably. On failure the old file is left as it was."""
        self.write_encoded(encode(data))

    def write_encoded(self, blob: bytes) -> None:
        """`write`, of data already encoded (CheckpointEncoder: the agent encodes on its event loop)."""
        with self._lock:
            self.directory.mkdir(mode=_DIRECTORY_MODE, parents=True, exist_ok=True)
            fd, temp_name = tempfile.mkstemp(prefix=CHECKPOINT_TEMP_PREFIX, dir=self.directory)  # mode 0600
            try:
                try:
                    _write_all(fd, blob)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temp_name, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp_name)
                raise
            fsync_directory(self.directory)

    def read(self) -> CheckpointData | None:
        """The checkpoint's data, or None when there is none to use.

        None when the file is absent; also when it is unreadable or is not a valid checkpoint, so that the agent
        starts with empty state as the kubelet does. An invalid file is moved aside (not deleted) for inspection.
        """
        with self._lock:
            try:
                blob = self.path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as err:
                log.warning(
                    "checkpoint unreadable; starting with empty state",
                    extra={"checkpoint": str(self.path), "error": str(err)},
                )
                return None
            try:
                return decode(blob)
            except CheckpointError as err:
                self._set_aside(err)
                return None

    def _set_aside(self, err: CheckpointError) -> None:
        details: dict[str, object] = {"checkpoint": str(self.path), "error": str(err)}
        if isinstance(err, CorruptCheckpointError):
            details |= {"actual_checksum": err.actual, "expected_checksum": err.expected}
        try:
            moved_to = self._aside_path()
            os.rename(self.path, moved_to)
            fsync_directory(self.directory)
            details["moved_to"] = str(moved_to)
        except OSError as move_err:
            details["move_error"] = str(move_err)  # the next write replaces the file anyway
        log.warning("checkpoint invalid; moved aside, starting with empty state", extra=details)

    def _aside_path(self) -> Path:
        stamp = self._clock().astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
        candidate = self.path.with_name(f"{CHECKPOINT_NAME}.corrupt-{stamp}")
        counter = 1
        while os.path.lexists(candidate):  # never overwrite an earlier one from the same second
            candidate = self.path.with_name(f"{CHECKPOINT_NAME}.corrupt-{stamp}.{counter}")
            counter += 1
        return candidate

    def list_checkpoints(self) -> list[str]:
        """Upstream `ListCheckpoints`: every entry of the directory whose name does not start with `.` (sockets too)."""
        return sorted(name for name in os.listdir(self.directory) if not name.startswith(CHECKPOINT_TEMP_PREFIX))

    def should_reset_extended_resources(self) -> bool:
        """Upstream `ShouldResetExtendedResourceCapacity`: nothing in the directory means the node was recreated.

        False when the directory cannot be listed, as upstream.
        """
        try:
            return not self.list_checkpoints()
        except OSError:
            return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
