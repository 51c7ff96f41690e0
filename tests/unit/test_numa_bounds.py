"""Findings 2 of issue 9, at the conversion boundary: NUMA ids beyond upstream's 64-bit bitmask; and duplicate ids."""

from __future__ import annotations

from deviceplane.core.registry import Device
from deviceplane.core.snapshot import checked_snapshot
from deviceplane.core.topology import mask_of


def test_conversion_refuses_ids_beyond_the_bitmask() -> None:
    devices = [Device("a", "Healthy", (0,)), Device("b", "Healthy", (64,)), Device("c", "Healthy", (-1,))]
    checked, problems = checked_snapshot(devices)
    assert [(d.id, reason) for d, reason in problems] == [
        ("b", "NUMA node id 64 is out of range (ids must be below 64)")
    ]
    assert [d.health for d in checked] == ["Healthy", "Unhealthy", "Healthy"]
    assert checked[1].numa_nodes == (64,)  # what the plugin said stays visible
    assert mask_of([0, 63, 64, 2**62, -1]) == (1 | 1 << 63)


def test_repeated_id_last_one_counts() -> None:
    devices = [Device("a", "Healthy"), Device("b", "Healthy"), Device("a", "Unhealthy")]
    checked, problems = checked_snapshot(devices)
    assert checked == [Device("b", "Healthy"), Device("a", "Unhealthy")]
    assert problems == [(Device("a", "Healthy"), "device id sent more than once; the last one counts")]
