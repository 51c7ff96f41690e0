"""The referenced ConfigMaps' hashes: kept from the watch for referenced ConfigMaps only, read once when asked for
before the watch showed one, and a watch event arriving during that read wins over it.

The read is a stub: the test needs a watch event to arrive between the read being sent and answered, an order a
real API server does not produce on demand (the real read is covered by tests/e2e/test_operator_configmaps.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from deviceplane.operator.configmaps import ConfigMapHashes
from deviceplane.operator.render import configmap_hash


def body(value: str) -> dict[str, Any]:
    return {"metadata": {"name": "cm"}, "data": {"k": value}}


def test_only_referenced_configmaps_are_kept_and_a_deletion_is_remembered_as_missing() -> None:
    reads: list[tuple[str, str]] = []

    async def find(namespace: str, name: str) -> Mapping[str, Any] | None:
        reads.append((namespace, name))
        return None

    hashes = ConfigMapHashes(find)
    for i in range(100):
        hashes.observed("other", f"cm-{i}", body("x"), referenced=False)
    hashes.observed("ns", "cm", body("1"), referenced=True)
    assert len(hashes) == 1, "unreferenced ConfigMaps were kept"
    assert asyncio.run(hashes.hash("ns", "cm")) == configmap_hash({"k": "1"}, None)
    hashes.observed("ns", "cm", None, referenced=True)  # deleted
    assert asyncio.run(hashes.hash("ns", "cm")) is None
    assert reads == [], "the watch had shown both states: nothing to read"
    hashes.observed("ns", "cm", body("1"), referenced=False)  # no longer referenced: forgotten
    assert len(hashes) == 0


def test_a_reference_the_watch_has_not_shown_is_read_once_and_a_concurrent_event_wins() -> None:
    reads: list[tuple[str, str]] = []

    async def find(namespace: str, name: str) -> Mapping[str, Any] | None:
        reads.append((namespace, name))
        if name == "racing":
            hashes.observed(namespace, name, body("new"), referenced=True)  # the watch, during the read
            return body("old")
        return body("1") if name == "cm" else None

    hashes = ConfigMapHashes(find)
    assert asyncio.run(hashes.hash("ns", "cm")) == configmap_hash({"k": "1"}, None)
    assert asyncio.run(hashes.hash("ns", "cm")) == configmap_hash({"k": "1"}, None)
    assert asyncio.run(hashes.hash("ns", "absent")) is None
    assert asyncio.run(hashes.hash("ns", "absent")) is None
    assert asyncio.run(hashes.hash("ns", "racing")) == configmap_hash({"k": "new"}, None)
    assert reads == [("ns", "cm"), ("ns", "absent"), ("ns", "racing")]
