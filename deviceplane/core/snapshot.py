"""Checks on one ListAndWatch snapshot before the registry sees it: what a plugin may not say.

- A device id sent twice: the last one counts (as a map keyed by id would have it). Upstream would put the id in
  both its healthy and unhealthy sets and count it twice in capacity.
- A NUMA node id no topology bitmask can hold (upstream's is a uint64, so ids >= 64): the device cannot be placed
  by any policy and would make every mask computation huge, so it is reported Unhealthy, with the reason.
Each problem is returned with the device it concerns, for the caller to log.
"""

from __future__ import annotations

from collections.abc import Sequence

from deviceplane.core.constants import UNHEALTHY
from deviceplane.core.registry import Device
from deviceplane.core.topology import MAX_NUMA_NODES


def checked_snapshot(devices: Sequence[Device]) -> tuple[list[Device], list[tuple[Device, str]]]:
    """The devices to apply, and (device, problem) for each one changed or dropped."""
    problems: list[tuple[Device, str]] = []
    out = list(devices)
    if len({d.id for d in out}) != len(out):
        last = {d.id: i for i, d in enumerate(out)}
        problems += [(d, "device id sent more than once; the last one counts") for i, d in enumerate(out)
                     if last[d.id] != i]  # fmt: skip
        out = [d for i, d in enumerate(out) if last[d.id] == i]
    for index, device in enumerate(out):
        if device.numa_nodes and max(device.numa_nodes) >= MAX_NUMA_NODES:
            problems.append(
                (device, f"NUMA node id {max(device.numa_nodes)} is out of range (ids must be below {MAX_NUMA_NODES})")
            )
            out[index] = Device(device.id, UNHEALTHY, device.numa_nodes)
    return out, problems
