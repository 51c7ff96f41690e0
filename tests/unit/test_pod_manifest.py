"""Reading static pod files: one document, YAML or JSON, bounded, with clear errors."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from deviceplane.agent.admission.pod_source import MAX_MANIFEST_BYTES, StaticPodDirectory, load_manifest
from deviceplane.core.pods import Pod, PodError


def test_yaml_and_json() -> None:
    assert load_manifest(b"kind: Pod\nmetadata: {name: a}\n", "a.yaml") == {"kind": "Pod", "metadata": {"name": "a"}}
    assert load_manifest(b'{"kind": "Pod"}', "a.json") == {"kind": "Pod"}


@pytest.mark.parametrize(
    ("raw", "name", "message"),
    [
        (b"kind: Pod\n---\nkind: Pod\n", "a.yaml", "expected exactly one Pod per file, found 2 documents"),
        (b"", "a.yaml", "found 0 documents"),
        (b"metadata: {name: x\n", "a.yaml", "invalid YAML"),
        (b"{nope", "a.json", "invalid JSON"),
        (b"\xff\xfe", "a.yaml", "not UTF-8 text"),
        (b" " * (MAX_MANIFEST_BYTES + 1), "a.yaml", "larger than"),
    ],
)
def test_bad_files(raw: bytes, name: str, message: str) -> None:
    with pytest.raises(PodError) as err:
        load_manifest(raw, name)
    assert message in str(err.value)


def test_alias_bomb_is_refused() -> None:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    previous = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
        previous = name
    with pytest.raises(PodError, match="expands to more than"):
        load_manifest("\n".join(lines).encode(), "bomb.yaml")


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        self.events.append(("set", key))

    def pod_error(self, source: str, key: str, error: str) -> None:
        self.events.append(("error", key))

    def pod_gone(self, source: str, key: str) -> None:
        self.events.append(("gone", key))

    def synced(self, source: str) -> None:
        pass


MANIFEST = "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n"


async def test_overlapping_rescans_do_not_revive_a_deleted_pod(tmp_path: Path) -> None:
    # The periodic rescan and the watch's rescan can run at once. One that read a changed file before it was
    # deleted must not report the pod again after the other has reported it gone.
    (tmp_path / "a.yaml").write_text(MANIFEST)
    source = StaticPodDirectory(tmp_path, "node")
    sink = RecordingSink()
    await source._rescan(sink)
    (tmp_path / "a.yaml").write_text(MANIFEST + "# changed\n")

    read, release = threading.Event(), threading.Event()
    load_all = source._load_all

    def slow_load_all(names: list[str]) -> list[tuple[str, Pod | str | None]]:
        loaded = load_all(names)
        read.set()
        release.wait(5)
        return loaded

    source._load_all = slow_load_all  # type: ignore[method-assign]
    first = asyncio.create_task(source._rescan(sink))
    assert await asyncio.to_thread(read.wait, 5)
    (tmp_path / "a.yaml").unlink()
    second = asyncio.create_task(source._rescan(sink))
    await asyncio.wait({second}, timeout=0.3)
    release.set()
    await asyncio.gather(first, second)
    assert sink.events == [("set", "a.yaml"), ("set", "a.yaml"), ("gone", "a.yaml")]
