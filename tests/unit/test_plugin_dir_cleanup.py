"""The plugin directory's clean-up at start, as upstream CleanupPluginDirectory (spec §4.2): every socket goes, judged
by what each entry points to; the checkpoint, directories and other files stay."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplane.agent.plugins.registration import cleanup_plugin_dir
from deviceplane.core.constants import CHECKPOINT_NAME


@pytest.fixture
def bound() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


def make_socket(path: Path, bound: list[socket.socket]) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    bound.append(sock)


def test_sockets_and_links_to_sockets_go_everything_else_stays(tmp_path: Path, bound: list[socket.socket]) -> None:
    plugin_dir = tmp_path / "dp"
    elsewhere = tmp_path / "elsewhere"
    plugin_dir.mkdir()
    elsewhere.mkdir()
    make_socket(plugin_dir / "stale.sock", bound)
    make_socket(elsewhere / "target.sock", bound)
    os.symlink(elsewhere / "target.sock", plugin_dir / "link-to-socket.sock")
    (elsewhere / "file").write_text("x")
    os.symlink(elsewhere / "file", plugin_dir / "link-to-file")
    os.symlink(elsewhere / "gone", plugin_dir / "dangling")
    (plugin_dir / "subdir").mkdir()
    make_socket(plugin_dir / "subdir" / "nested.sock", bound)
    (plugin_dir / CHECKPOINT_NAME).write_text("{}")
    (plugin_dir / "notes.txt").write_text("kept")

    removed = cleanup_plugin_dir(plugin_dir)

    assert sorted(removed) == ["link-to-socket.sock", "stale.sock"]
    kept = {CHECKPOINT_NAME, "dangling", "link-to-file", "notes.txt", "subdir"}
    assert {p.name for p in plugin_dir.iterdir()} == kept
    # The link went, never what it pointed to; nothing below a subdirectory is touched (upstream reads one level).
    assert (elsewhere / "target.sock").is_socket()
    assert (plugin_dir / "subdir" / "nested.sock").is_socket()
