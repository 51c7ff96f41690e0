"""One end-to-end property for static pod files: batches of fuzzed files in a real agent's --pod-manifest-dir, a real
plugin serving the resource. Every file is reported (a pod, or an invalid entry with its reason); no device is held
by two pods; removing the files frees everything; the agent stays live (every supervised task up)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import RESOURCE, assert_live
from tests.fuzz.pod_strategies import pod_file
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess, TestPlugin, wait_for

SETTLED = ("admitted", "failed", "terminated", "invalid")


def write_atomically(directory: Path, name: str, content: bytes) -> None:
    temp = directory / f".{name}.tmp"
    temp.write_bytes(content)
    os.replace(temp, directory / name)


@fuzz_settings(bounded=40, long=10_000)
@given(st.lists(pod_file(), min_size=1, max_size=4))
def test_fuzz_pod_files_through_the_agent(
    fuzz_agent: AgentProcess, fuzz_plugin: TestPlugin, files: list[tuple[str, bytes]]
) -> None:
    pod_dir = fuzz_agent.workdir / "pods"
    names = [f"f{i}-{name}" for i, (name, _content) in enumerate(files)]
    for name, (_, content) in zip(names, files, strict=True):
        write_atomically(pod_dir, name, content)

    def settled() -> list[dict[str, Any]] | None:
        entries = fuzz_agent.get("/api/v1/pods")
        sources = {e["source"]: e for e in entries}
        if all(f"file:{n}" in sources and sources[f"file:{n}"]["state"] in SETTLED for n in names):
            return list(entries)
        return None

    entries = wait_for(settled, timeout=20, what=f"every file reported: {names}")
    assert len(entries) == len(names), entries  # one entry per file, nothing else
    held: dict[str, str] = {}
    for entry in entries:
        if entry["state"] == "invalid":
            assert entry["reason"], entry
        devices = {d for c in entry["containers"] for d in c["devices"].get(RESOURCE, [])}
        assert not devices or entry["state"] == "admitted", entry
        for device in devices:
            assert device not in held, f"{device} held by {held[device]} and {entry['source']}"
            held[device] = entry["source"]
    resource = fuzz_agent.resource(RESOURCE)
    assert resource is not None and resource["allocated"] == len(held) <= resource["capacity"]
    assert_live(fuzz_agent)

    for name in names:
        (pod_dir / name).unlink()
    wait_for(lambda: fuzz_agent.get("/api/v1/pods") == [], timeout=20, what="every pod gone")
    wait_for(lambda: fuzz_agent.resource(RESOURCE)["allocated"] == 0, timeout=20, what="every device freed")
