"""Finding 4 of issue 9: a torn tail ends a segment quietly; a corrupt record in the middle is logged loudly,
counted, and the valid records after it are still replayed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from deviceplane.agent.state.journal import JOURNAL_DIRNAME, Journal, alloc_record, list_segments
from deviceplane.core.pod_devices import PodDevices
from tests.integration.test_allocation_journal import alloc, state
from tests.support.procs import AgentProcess


async def written(directory: Path, pods: int) -> Path:
    journal = Journal(directory, segment_bytes=64 << 10)
    journal.replay(PodDevices())
    journal.open()
    for i in range(pods):
        await journal.append(alloc_record(alloc(f"p{i}", f"d{i}")))  # one line each: appended one by one
    await journal.close()
    (_seq, path), *_ = list_segments(directory)
    return path


def flip(path: Path, line: int, column: int = 20) -> None:
    data = bytearray(path.read_bytes())
    start = 0
    for _ in range(line):
        start = data.index(b"\n", start) + 1
    data[start + column] ^= 0x01
    path.write_bytes(bytes(data))


async def test_corrupt_record_in_the_middle_keeps_the_records_after_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = await written(tmp_path, 4)
    flip(path, 1)
    journal = Journal(tmp_path)
    pds = PodDevices()
    with caplog.at_level(logging.ERROR, logger="deviceplane.journal"):
        applied = journal.replay(pds)
    assert applied == 3
    assert state(pds) == {"p0": {"d0"}, "p2": {"d2"}, "p3": {"d3"}}
    assert journal.corrupt_records == 1
    [entry] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "corrupt" in entry.getMessage() and str(path) in str(entry.__dict__)


async def test_torn_tail_is_not_corruption(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = await written(tmp_path, 3)
    data = bytearray(path.read_bytes())
    end = data.rindex(b"\n", 0, data.index(b"\x00"))
    data[end + 1 : end + 20] = b'0badc0de {"op":"al'  # a crash in the middle of the next append
    path.write_bytes(bytes(data))
    journal = Journal(tmp_path)
    pds = PodDevices()
    with caplog.at_level(logging.WARNING, logger="deviceplane.journal"):
        assert journal.replay(pds) == 3
    assert journal.corrupt_records == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_corrupt_last_record_before_zeros_is_a_torn_tail(tmp_path: Path) -> None:
    """Nothing valid follows it: indistinguishable from a write torn at a crash, so not counted."""
    path = await written(tmp_path, 3)
    flip(path, 2)
    journal = Journal(tmp_path)
    pds = PodDevices()
    assert journal.replay(pds) == 2
    assert journal.corrupt_records == 0


async def test_agent_counts_and_logs_mid_segment_corruption(short_tmp: Path) -> None:
    plugin_dir = short_tmp / "dp"
    path = await written(plugin_dir / JOURNAL_DIRNAME, 3)
    flip(path, 0)
    agent = AgentProcess(short_tmp, plugin_dir=plugin_dir).start()
    try:
        assert agent.metric("deviceplane_journal_corrupt_records_total") == 1.0
        [entry] = [json.loads(line) for line in agent.log().splitlines() if "journal segment corrupt" in line]
        assert entry["level"] == "error" and entry["lines"] == [1] and entry["segment"] == str(path)
        assert agent.get_text("/readyz") == "ok"
    finally:
        agent.kill()
