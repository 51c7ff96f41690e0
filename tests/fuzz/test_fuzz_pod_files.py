"""Fuzzing static pod files through the real source (`StaticPodDirectory`): every file gets exactly one report,
a pod or that file's error; pods that come out are valid; the same bytes always give the same pod (UID
included); and the source keeps running (a later good file is still read)."""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

from hypothesis import given

from deviceplane.agent.admission.pod_source import StaticPodDirectory
from deviceplane.core.names import is_extended_resource_name
from deviceplane.core.pods import PHASES, Pod
from tests.fuzz.pod_strategies import pod_file
from tests.support.fuzz import fuzz_settings

GOOD = b"apiVersion: v1\nkind: Pod\nmetadata: {name: sentinel}\nspec: {containers: [{name: c}]}\n"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class Sink:
    def __init__(self) -> None:
        self.reports: list[tuple[str, str, object]] = []

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        self.reports.append(("set", key, pod))

    def pod_error(self, source: str, key: str, error: str) -> None:
        assert isinstance(error, str) and error.startswith(f"{key}: "), error
        self.reports.append(("error", key, error))

    def pod_gone(self, source: str, key: str) -> None:
        self.reports.append(("gone", key, None))

    def synced(self, source: str) -> None:
        pass


def check_pod(pod: Pod) -> None:
    assert pod.uid and isinstance(pod.uid, str)
    assert DNS_LABEL.fullmatch(pod.namespace)
    assert pod.phase in PHASES
    assert pod.containers, "a pod without app containers was accepted"
    names = [c.name for c in pod.all_containers]
    assert len(names) == len(set(names))
    for container in pod.all_containers:
        for resource, count in container.limits:
            assert is_extended_resource_name(resource) and isinstance(count, int) and count >= 0


@fuzz_settings(bounded=400, long=30_000)
@given(pod_file())
def test_fuzz_pod_files(file: tuple[str, bytes]) -> None:
    name, content = file
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / name).write_bytes(content)
        source = StaticPodDirectory(directory, "node")
        sink = Sink()
        asyncio.run(source._rescan(sink))
        assert len(sink.reports) == 1 and sink.reports[0][1] == name, sink.reports
        kind, _key, result = sink.reports[0]
        if kind == "set":
            assert isinstance(result, Pod)
            check_pod(result)
            again = StaticPodDirectory(directory, "node")._load(name)
            assert again == result  # deterministic, UID included
        # the source goes on: a good file written next is read
        (directory / "sentinel.yaml").write_bytes(GOOD)
        asyncio.run(source._rescan(sink))
        assert [(k, key) for k, key, _ in sink.reports[1:]] == [("set", "sentinel.yaml")]
