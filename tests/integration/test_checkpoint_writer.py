"""The background checkpoint's writer on a real event loop and real files: the encoding runs in slices with the
loop's other work between them, requests share writes, and a snapshot that cannot be encoded fails its request
without touching the file or stopping later writes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Generator
from pathlib import Path

import pytest

from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.core.checkpoint import CheckpointData, CheckpointEncoder, PodDevicesEntry, encode

RESPONSE = bytes([0x0A, 0x05, 0x0A, 0x01, 0x41, 0x12, 0x00])


def data_of(count: int) -> CheckpointData:
    entries = [PodDevicesEntry(f"pod-{i}", "main", "example.com/r", {0: [f"d-{i}"]}, RESPONSE) for i in range(count)]
    return CheckpointData(entries, {"example.com/r": [f"d-{i}" for i in range(count)]})


class CountingEncoder(CheckpointEncoder):
    """The real encoder, noting how far `progress` moved while its encoding ran."""

    def __init__(self, progress: Callable[[], int]) -> None:
        super().__init__()
        self._progress = progress
        self.moved_during: int | None = None

    def encode_in_slices(
        self, data: CheckpointData, clock: Callable[[], float], slice_seconds: float
    ) -> Generator[None, None, bytes]:
        started = self._progress()
        encoded = yield from super().encode_in_slices(data, clock, slice_seconds)
        self.moved_during = self._progress() - started
        return encoded


async def test_the_loop_runs_its_other_work_between_slices_of_an_encoding(tmp_path: Path) -> None:
    """With no time allowed per slice, the encoding of 320 entries pauses after each chunk of 32 and between its
    three final steps: a task counting loop iterations runs that often while it lasts, and the file holds exactly
    what `encode` makes."""
    store = CheckpointStore(tmp_path)
    data = data_of(320)
    iterations = 0
    encoder = CountingEncoder(lambda: iterations)
    writer = CheckpointWriter(store.write_encoded, lambda: data, encoder, slice_seconds=0.0)
    done = False

    async def count_iterations() -> None:
        nonlocal iterations
        while not done:
            iterations += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_iterations())
    await writer.request()
    done = True
    await counter
    assert encoder.moved_during is not None and encoder.moved_during >= 320 // 32 + 3
    assert store.path.read_bytes() == encode(data)


async def test_an_encoding_that_fails_fails_its_request_and_leaves_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    good = data_of(3)
    bad = CheckpointData([PodDevicesEntry("p", "c", "example.com/r", {0: ["\ud800"]}, RESPONSE)], {})
    snapshots = iter([good, bad, good])
    writer = CheckpointWriter(store.write_encoded, lambda: next(snapshots), CheckpointEncoder())
    await writer.request()
    written = store.path.read_bytes()
    with pytest.raises(ValueError, match="lone surrogate"):
        await writer.request()
    assert store.path.read_bytes() == written
    assert "checkpoint write failed" in caplog.text
    await writer.request()
    assert store.path.read_bytes() == encode(good) == written
    assert os.listdir(tmp_path) == [store.path.name]  # no temporary file left
