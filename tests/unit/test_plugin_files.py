"""files.list_devices in-process: the unreadable-file warning, which the process test can only see as non-root."""

from __future__ import annotations

import logging
import os

from deviceplane.plugin import Device, files


def test_unreadable_file_is_a_device_and_warned_about_once(tmp_path, monkeypatch, caplog):
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(files.os, "access", lambda path, mode: os.path.basename(path) != "b")
    warned: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="deviceplane.plugin.files"):
        assert files.list_devices(tmp_path, warned) == [Device("a"), Device("b")]
        assert files.list_devices(tmp_path, warned) == [Device("a"), Device("b")]
    assert warned == {"b"}
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'b'} is not readable by the plugin; it is still offered as a device"
    ]


def test_non_utf8_name_is_skipped_and_warned_about_once(tmp_path, caplog):
    """A name that is not valid UTF-8 cannot be a device id (protobuf strings); Device() of it made every listing
    fail. It is skipped, warned about once while it stays, and again if it comes back."""
    (tmp_path / "a").write_text("a")
    odd = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    open(odd, "w").close()
    warned: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="deviceplane.plugin.files"):
        assert files.list_devices(tmp_path, warned) == [Device("a")]
        assert files.list_devices(tmp_path, warned) == [Device("a")]
        os.unlink(odd)
        assert files.list_devices(tmp_path, warned) == [Device("a")]
        open(odd, "w").close()
        assert files.list_devices(tmp_path, warned) == [Device("a")]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"{odd!r}: the name is not valid UTF-8; not offered"] * 2
