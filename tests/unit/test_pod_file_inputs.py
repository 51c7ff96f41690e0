"""Finding 1 of issue 9: a pod file whose content Python cannot canonicalise (mixed-type mapping keys, huge YAML
integers) must be reported as that file's problem; the static pod source goes on reading every other file."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

from deviceplane.agent.admission.pod_source import StaticPodDirectory, load_manifest
from deviceplane.core.pods import Pod, PodError, parse_pod

MIXED_KEYS = (
    "apiVersion: v1\nkind: Pod\nmetadata:\n  name: mixed\n  labels: {1: a, b: c}\nspec: {containers: [{name: c}]}\n"
)
GOOD = "apiVersion: v1\nkind: Pod\nmetadata: {name: good}\nspec: {containers: [{name: c}]}\n"


class Sink:
    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self.errors: dict[str, str] = {}
        self.synced_once = asyncio.Event()

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        self.pods[key] = pod

    def pod_error(self, source: str, key: str, error: str) -> None:
        self.errors[key] = error

    def pod_gone(self, source: str, key: str) -> None:
        self.pods.pop(key, None)
        self.errors.pop(key, None)

    def synced(self, source: str) -> None:
        self.synced_once.set()


def test_mixed_key_types_get_a_uid_as_the_kubelet_would_spell_the_keys() -> None:
    obj = load_manifest(MIXED_KEYS.encode(), "mixed.yaml")
    pod = parse_pod(obj, "node", "mixed.yaml")
    # {1: a} reads as {"1": a}, as the kubelet's YAML-to-JSON conversion has it
    same = parse_pod(load_manifest(MIXED_KEYS.replace("{1: a", '{"1": a').encode(), "mixed.yaml"), "node", "mixed.yaml")
    assert pod.uid == same.uid


def test_uid_of_an_ordinary_pod_did_not_change() -> None:
    """Upgrading the agent must not change static pods' UIDs (they would be freed and admitted again)."""
    obj = json.loads('{"apiVersion":"v1","kind":"Pod","metadata":{"name":"a","labels":{"x":"1"}},'
                     '"spec":{"containers":[{"name":"c"}]}}')  # fmt: skip
    digest = hashlib.sha256()
    digest.update(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())
    digest.update(b"host:node")
    digest.update(b"file:a.json")
    assert parse_pod(obj, "node", "a.json").uid == digest.hexdigest()[:32]


def test_set_values_give_the_same_uid_in_every_process() -> None:
    a = parse_pod(load_manifest((GOOD + "x: !!set {p, q, r, s}\n").encode(), "s.yaml"), "n", "s.yaml")
    b = parse_pod(load_manifest((GOOD + "x: !!set {s, r, q, p}\n").encode(), "s.yaml"), "n", "s.yaml")
    assert a.uid == b.uid


def test_huge_yaml_integer_is_a_pod_error() -> None:
    try:
        load_manifest(b"a: " + b"1" * 5000, "big.yaml")
    except PodError as err:
        assert "invalid YAML" in str(err)
    else:
        raise AssertionError("a 5000-digit integer was accepted")


async def test_source_reports_the_bad_file_and_keeps_reading(tmp_path: Path) -> None:
    (tmp_path / "mixed.yaml").write_text(MIXED_KEYS)
    (tmp_path / "big.yaml").write_text(GOOD.replace("good", "big") + "x: " + "9" * 5000 + "\n")
    (tmp_path / "good.yaml").write_text(GOOD)
    source = StaticPodDirectory(tmp_path, "node", rescan_interval=0.05)
    sink = Sink()
    task = asyncio.create_task(source.run(sink))
    try:
        await asyncio.wait_for(sink.synced_once.wait(), 5)
        assert set(sink.pods) == {"mixed.yaml", "good.yaml"}
        assert "big.yaml" in sink.errors and "invalid YAML" in sink.errors["big.yaml"]
        # the source is still running: a new file is read, a removed one reported gone
        (tmp_path / "later.yaml").write_text(GOOD.replace("good", "later"))
        (tmp_path / "mixed.yaml").unlink()
        for _ in range(100):
            if "later.yaml" in sink.pods and "mixed.yaml" not in sink.pods:
                break
            await asyncio.sleep(0.05)
        assert not task.done(), task
        assert set(sink.pods) == {"good.yaml", "later.yaml"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_file_name_that_is_not_utf8_is_a_pod_and_the_watch_goes_on(tmp_path: Path) -> None:
    """The kubelet reads a static pod whatever bytes its file name holds. watchfiles cannot report such a name and
    failed the watch, which ended unseen; the pod's UID could not be made either (the name did not encode)."""
    source = StaticPodDirectory(tmp_path, "node", rescan_interval=0.3)
    sink = Sink()
    task = asyncio.create_task(source.run(sink))
    try:
        await asyncio.wait_for(sink.synced_once.wait(), 5)
        (tmp_path / os.fsdecode(b"caf\xe9.yaml")).write_text(GOOD.replace("good", "odd"))
        await _until(lambda: "caf\udce9.yaml" in sink.pods)
        assert not sink.errors
        # The watch was set up again: changes are seen by it, not only by the next rescans.
        (tmp_path / "later.yaml").write_text(GOOD.replace("good", "later"))
        await _until(lambda: "later.yaml" in sink.pods)
        watches = [t for t in asyncio.all_tasks() if t.get_name() == "pod-dir-watch"]
        assert len(watches) == 1 and not watches[0].done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _until(check, within: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(within / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")
