"""The checkpoint file on disk (spec §4.6, §4.9): atomic private writes, reads that never block a start, and the real
kubelet checkpoint code (tests/k8s/checkpoint-peer, built by `make k8s-bins`) as the peer for both directions."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import stat
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.core.checkpoint import (
    CheckpointData,
    CheckpointFormatError,
    CorruptCheckpointError,
    PodDevicesEntry,
    checksum,
    decode,
    encode,
    fnv1a_32,
    spew_text,
)
from deviceplane.core.constants import CHECKPOINT_NAME
from tests.e2e.cluster import built_binary
from tests.unit.test_checkpoint import EXAMPLE, EXAMPLE_FILE, SPEC_VECTORS, checkpoints

FIXED_TIME = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
ASIDE_NAME = f"{CHECKPOINT_NAME}.corrupt-20260102T030405Z"


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "device-plugins", clock=lambda: FIXED_TIME)


def entries_of(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# -- writes -----------------------------------------------------------------------------------------------------------


def test_write_creates_a_private_file_with_the_encoded_data_and_nothing_else(store: CheckpointStore) -> None:
    store.write(EXAMPLE)
    assert entries_of(store.directory) == [CHECKPOINT_NAME]  # no temp file left behind
    assert store.path.read_bytes() == EXAMPLE_FILE
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert store.read() == EXAMPLE


def test_write_replaces_the_previous_checkpoint(store: CheckpointStore) -> None:
    store.write(EXAMPLE)
    empty = CheckpointData(None, {"example.com/resource": []})
    store.write(empty)
    assert entries_of(store.directory) == [CHECKPOINT_NAME]
    assert store.read() == empty


def test_write_goes_through_a_dot_temp_file_synced_before_the_rename(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: Any) -> None:
        events.append(("replace", src))
        assert stat.S_IMODE(os.stat(src).st_mode) == 0o600
        assert Path(src).read_bytes() == EXAMPLE_FILE  # complete before it becomes the checkpoint
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.write(EXAMPLE)

    temp = events[0][1]
    assert Path(temp).parent == store.directory
    assert Path(temp).name.startswith(".")  # the kubelet's temp prefix: not listed as a checkpoint
    # File synced, renamed, then the directory synced so the rename itself is durable.
    assert events == [("fsync", temp), ("replace", temp), ("fsync", str(store.directory))]


@pytest.mark.parametrize("failing", ["fsync", "replace", "write"])
def test_failed_write_keeps_the_old_checkpoint_and_leaves_no_temp_file(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    store.write(EXAMPLE)

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match="No space left"):
        store.write(CheckpointData(None, {}))
    monkeypatch.undo()
    assert entries_of(store.directory) == [CHECKPOINT_NAME]
    assert store.read() == EXAMPLE


def test_data_go_cannot_hold_is_rejected_before_touching_the_directory(store: CheckpointStore) -> None:
    store.write(EXAMPLE)
    with pytest.raises(ValueError):
        store.write(CheckpointData([PodDevicesEntry("p", "c", "r", {2**63: []}, b"")], None))
    assert entries_of(store.directory) == [CHECKPOINT_NAME]
    assert store.path.read_bytes() == EXAMPLE_FILE


# -- reads ------------------------------------------------------------------------------------------------------------


def test_read_without_a_checkpoint_is_none(store: CheckpointStore) -> None:
    assert store.read() is None
    store.directory.mkdir()
    assert store.read() is None


def test_read_of_the_spec_example_file(store: CheckpointStore) -> None:
    store.directory.mkdir()
    store.path.write_bytes(EXAMPLE_FILE)
    assert store.read() == EXAMPLE
    assert store.path.read_bytes() == EXAMPLE_FILE  # reading changes nothing


def test_corrupt_checkpoint_is_moved_aside_with_a_warning(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.directory.mkdir()
    tampered = EXAMPLE_FILE.replace(b'"Dev-2"]}', b'"Dev-9"]}')
    store.path.write_bytes(tampered)

    with caplog.at_level(logging.WARNING, logger="deviceplane.checkpoint"):
        assert store.read() is None

    assert entries_of(store.directory) == [ASIDE_NAME]
    assert (store.directory / ASIDE_NAME).read_bytes() == tampered  # kept for inspection, byte for byte
    (record,) = [r for r in caplog.records if r.name == "deviceplane.checkpoint"]
    assert record.levelno == logging.WARNING
    fields = record.__dict__
    assert fields["moved_to"] == str(store.directory / ASIDE_NAME)
    assert fields["expected_checksum"] == 1336083214
    as_tampered = CheckpointData(
        EXAMPLE.PodDeviceEntries, {"a.com/b": ["x"], "example.com/resource": ["Dev-1", "Dev-9"]}
    )
    assert fields["actual_checksum"] == checksum(as_tampered)
    assert fields["error"] == "checkpoint is corrupted"


@pytest.mark.parametrize("content", [b"", b"not json", b'{"Data":[]}', b"\x00\xff" * 10])
def test_unparseable_checkpoint_is_moved_aside(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    store.directory.mkdir()
    store.path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="deviceplane.checkpoint"):
        assert store.read() is None
    assert entries_of(store.directory) == [ASIDE_NAME]
    assert (store.directory / ASIDE_NAME).read_bytes() == content
    assert any(getattr(r, "moved_to", None) == str(store.directory / ASIDE_NAME) for r in caplog.records)


def test_the_agent_starts_empty_then_writes_a_fresh_checkpoint(store: CheckpointStore) -> None:
    store.directory.mkdir()
    store.path.write_bytes(b"{")
    assert store.read() is None
    store.write(EXAMPLE)
    assert store.read() == EXAMPLE
    assert entries_of(store.directory) == sorted([CHECKPOINT_NAME, ASIDE_NAME])


def test_corrupt_files_from_the_same_second_do_not_overwrite_each_other(store: CheckpointStore) -> None:
    store.directory.mkdir()
    for content in (b"first", b"second", b"third"):
        store.path.write_bytes(content)
        assert store.read() is None
    assert (store.directory / ASIDE_NAME).read_bytes() == b"first"
    assert (store.directory / f"{ASIDE_NAME}.1").read_bytes() == b"second"
    assert (store.directory / f"{ASIDE_NAME}.2").read_bytes() == b"third"


def test_aside_name_uses_utc(tmp_path: Path) -> None:
    east = datetime(2026, 1, 2, 12, 4, 5).astimezone()  # local time, whatever the zone
    store = CheckpointStore(tmp_path, clock=lambda: east)
    store.path.write_bytes(b"{")
    store.read()
    (aside,) = [name for name in os.listdir(tmp_path) if name != CHECKPOINT_NAME]
    assert re.fullmatch(rf"{CHECKPOINT_NAME}\.corrupt-\d{{8}}T\d{{6}}Z", aside)
    assert aside.endswith(east.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ"))


def test_unreadable_checkpoint_is_left_in_place(store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    store.path.mkdir(parents=True)  # not a file: cannot be read, and not ours to move
    with caplog.at_level(logging.WARNING, logger="deviceplane.checkpoint"):
        assert store.read() is None
    assert entries_of(store.directory) == [CHECKPOINT_NAME]
    assert any(r.name == "deviceplane.checkpoint" and r.levelno == logging.WARNING for r in caplog.records)


# -- ShouldResetExtendedResourceCapacity ------------------------------------------------------------------------------


def test_reset_extended_resource(store: CheckpointStore) -> None:
    """Upstream TestResetExtendedResource (§6.1 item 19)."""
    entry = PodDevicesEntry("pod", "con", "domain.com/resource", {-1: ["dev1"]}, b"\x1a\x00")
    store.write(CheckpointData([entry], {"domain.com/resource": ["dev1"]}))
    assert not store.should_reset_extended_resources()  # checkpoint present: the node was not recreated

    for name in store.list_checkpoints():
        os.remove(store.directory / name)
    assert store.should_reset_extended_resources()  # checkpoint absent: node recreation


def test_every_entry_not_starting_with_a_dot_counts_as_a_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    (tmp_path / ".temp").write_bytes(b"")
    (tmp_path / ".hidden-dir").mkdir()
    assert store.list_checkpoints() == []
    assert store.should_reset_extended_resources()

    (tmp_path / "DEPRECATION").write_bytes(b"")
    (tmp_path / "some-dir").mkdir()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "dp.sock"))  # sockets count too, as in the kubelet's directory
    assert store.list_checkpoints() == ["DEPRECATION", "dp.sock", "some-dir"]
    assert not store.should_reset_extended_resources()


def test_should_not_reset_when_the_directory_cannot_be_listed(tmp_path: Path) -> None:
    assert not CheckpointStore(tmp_path / "missing").should_reset_extended_resources()


# -- the real kubelet checkpoint code as the peer --------------------------------------------------------------------

# tests/k8s/checkpoint-peer (built by `make k8s-bins`): the kubelet's checkpoint code behind a JSON line protocol.


class KubeletCheckpointPeer:
    def __init__(self, binary: Path) -> None:
        self._process = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, op: str, directory: Path | None = None, blob: bytes = b"") -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        request = {"Op": op, "Dir": str(directory or ""), "Blob": base64.b64encode(blob).decode()}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        answer: dict[str, Any] = json.loads(self._process.stdout.readline())
        answer["file"] = base64.b64decode(answer["file"])
        return answer

    def read(self, directory: Path) -> dict[str, Any]:
        return self._ask("read", directory)

    def write(self, directory: Path, data: CheckpointData) -> None:
        assert self._ask("write", directory, encode(data))["error"] == ""

    def decode(self, raw: bytes) -> dict[str, Any]:
        return self._ask("decode", blob=raw)

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=10)


@pytest.fixture(scope="session")
def kubelet() -> Iterator[KubeletCheckpointPeer]:
    peer = KubeletCheckpointPeer(built_binary("checkpoint-peer"))
    yield peer
    peer.close()


@pytest.mark.parametrize(("data", "text", "fnv"), SPEC_VECTORS)
def test_kubelet_reads_what_we_write(
    kubelet: KubeletCheckpointPeer, store: CheckpointStore, data: CheckpointData, text: str, fnv: int
) -> None:
    store.write(data)
    seen = kubelet.read(store.directory)
    assert seen["error"] == ""  # decoded, checksum verified
    assert seen["spew"] == spew_text(data) == text
    assert seen["file"] == store.path.read_bytes()  # what it would write back is byte-identical


@pytest.mark.parametrize(("data", "text", "fnv"), SPEC_VECTORS)
def test_we_read_what_the_kubelet_writes(
    kubelet: KubeletCheckpointPeer, store: CheckpointStore, data: CheckpointData, text: str, fnv: int
) -> None:
    kubelet.write(store.directory, data)
    assert store.read() == data
    assert store.path.read_bytes() == encode(data)
    assert entries_of(store.directory) == [CHECKPOINT_NAME]


def test_kubelet_rejects_what_we_move_aside(kubelet: KubeletCheckpointPeer, store: CheckpointStore) -> None:
    store.directory.mkdir()
    store.path.write_bytes(EXAMPLE_FILE.replace(b"Dev-1", b"Dev-0"))
    assert kubelet.read(store.directory)["error"] == "checkpoint is corrupted"
    assert store.read() is None


@settings(max_examples=150)
@given(data=checkpoints)
def test_kubelet_and_we_agree_on_random_checkpoints(kubelet: KubeletCheckpointPeer, data: CheckpointData) -> None:
    raw = encode(data)
    seen = kubelet.decode(raw)
    assert seen["error"] == ""
    assert seen["spew"] == spew_text(data)
    assert seen["file"] == raw


# Files only a hand (or a bug) would write: the kubelet's JSON decoder has quirks, and we must agree with it.
ODD_FILES = [
    b'{"Data":{},"Checksum":2932075448}',
    b'{"Data":null,"Checksum":2932075448}',
    b'{"data":{"poddeviceentries":null,"REGISTEREDDEVICES":{}},"CHECKSUM":3467439661,"Other":[1]}',
    b'{"Data":{"PodDeviceEntries":null},"Chec\xe2\x84\xaasum":3467439661}',  # Kelvin sign K
    b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"+1":["a"],"01":["b"],"-0":null},"AllocResp":[1,2,null]}]}}',
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"a","AllocResp":"QUJDRA=="},{"PodUID":"b"}],'
    b'"PodDeviceEntries":[{"AllocResp":[null,null,null,null,null,null]}]}}',
    b'{"Data":{"RegisteredDevices":{"a":["x"]},"RegisteredDevices":{"b":null}}}',
    b'{"Data":{"RegisteredDevices":{"a\xff\xe2\x82b\\ud800\\udc00\\udc00":["\\u003c\\/"]}}}',
    b'{"Data":{"PodDeviceEntries":[{"AllocResp":"QU\\nJD\\r\\nRA=\\n="}]}}',
    b'{"Data":{"PodDeviceEntries":[{"AllocResp":"QQ="}]}}',
    b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"9223372036854775808":[]}}]}}',
    b'{"Data":{"PodDeviceEntries":[{"AllocResp":[256]}]}}',
    b'{"Checksum":1.0}',
    b'{"Checksum":18446744073709551615}',
    b'{"Data":{}}\n\t ',
    b'\xef\xbb\xbf{"Data":{}}',
    b'{"Data":{"RegisteredDevices":{"a":[]}}}\xff',
]


@pytest.mark.parametrize("raw", ODD_FILES)
def test_kubelet_and_we_agree_on_odd_files(kubelet: KubeletCheckpointPeer, raw: bytes) -> None:
    seen = kubelet.decode(raw)
    try:
        data = decode(raw)
    except CorruptCheckpointError as err:
        assert seen["error"] == "checkpoint is corrupted"
        assert err.actual == fnv1a_32(seen["spew"].encode())  # the same values decoded and hashed
    except CheckpointFormatError:
        assert seen["error"] not in ("", "checkpoint is corrupted")
    else:
        assert seen["error"] == ""
        assert seen["spew"] == spew_text(data)
        assert seen["file"] == encode(data)
