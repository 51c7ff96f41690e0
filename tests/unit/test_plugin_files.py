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


def test_a_directory_too_large_for_one_message_keeps_the_last_list_that_fit(tmp_path, caplog):
    """20,000 names of 236 characters: a 5 MB ListAndWatch message, which the kubelet would drop with the stream.
    The plugin says so once, keeps offering what fit, and picks the directory up again once it fits."""
    cola = tmp_path / "cola"
    cola.mkdir()
    for name in ("dev-a", "dev-b"):
        (cola / name).touch()
    plugin = files.FilesPlugin("example.com/cola", cola, plugin_dir=tmp_path / "dp")
    big = [cola / (f"{i:06d}-" + "x" * 229) for i in range(20_000)]
    for path in big:
        path.touch()
    with caplog.at_level(logging.INFO, logger="deviceplane.plugin.files"):
        plugin.rescan()
        plugin.rescan()  # the watch re-lists on every change and tick: one error, not one per listing
        assert plugin.plugin.devices == (Device("dev-a"), Device("dev-b"))
        # Started on such a directory, a plugin offers nothing until it fits, rather than failing.
        assert files.FilesPlugin("example.com/cola", cola, plugin_dir=tmp_path / "dp").plugin.devices == ()
        for path in big[1:]:
            path.unlink()
        plugin.rescan()
    assert plugin.plugin.devices == (Device(big[0].name), Device("dev-a"), Device("dev-b"))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors  # this plugin's, and the one started on the large directory
    assert "20002 devices make a" in errors[0] and "still offering the 2 devices of the last list that fit" in errors[0]
    assert "still offering the 0 devices" in errors[1]
    assert caplog.records[-1].getMessage() == f"{cola}: the device list fits in a message again: 3 devices"
