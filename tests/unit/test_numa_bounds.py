"""Finding 2 of issue 9, at the conversion boundary: NUMA ids beyond upstream's 64-bit bitmask."""

from __future__ import annotations

from deviceplane.core.registry import Device
from deviceplane.core.topology import mask_of, refuse_unrepresentable_topology


def test_conversion_refuses_ids_beyond_the_bitmask() -> None:
    devices = [Device("a", "Healthy", (0,)), Device("b", "Healthy", (64,)), Device("c", "Healthy", (-1,))]
    refused = refuse_unrepresentable_topology(devices)
    assert [(d.id, reason) for d, reason in refused] == [
        ("b", "NUMA node id 64 is out of range (ids must be below 64)")
    ]
    assert [d.health for d in devices] == ["Healthy", "Unhealthy", "Healthy"]
    assert devices[1].numa_nodes == (64,)  # what the plugin said stays visible
    assert mask_of([0, 63, 64, 2**62, -1]) == (1 | 1 << 63)
