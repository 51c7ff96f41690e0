"""Checks on one ListAndWatch snapshot before the registry sees it: what a plugin may not say.

- A device id sent twice. Upstream would put the id in both its healthy and unhealthy sets when the copies'
  health differs, and count it twice in capacity (core/device_sets.py).
- A NUMA node id no topology bitmask can hold (upstream's is a uint64, so ids >= 64).

Agent mode is the device manager, so it corrects them (`checked_snapshot`): the last copy of an id counts, and a
device with such a NUMA id is reported Unhealthy (no policy could place it, and every mask computation would be
huge). Proxy mode is not: the kubelet gets the plugin's message unchanged and counts and allocates by its own rules,
so the agent's view takes the snapshot as sent too (`as_sent`) and shows what the kubelet publishes. Either way each
problem is returned with the device it concerns, for the caller to log.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deviceplane.core.constants import UNHEALTHY
from deviceplane.core.registry import Device
from deviceplane.core.topology import MAX_NUMA_NODES

Problems = list[tuple[Device, str]]
REPEATED = "device id sent more than once"
_COUNTED_TWICE = "counted as the kubelet counts it, twice in capacity if its copies' health differs"


def _numa_problem(device: Device) -> str | None:
    if device.numa_nodes and max(device.numa_nodes) >= MAX_NUMA_NODES:
        return f"NUMA node id {max(device.numa_nodes)} is out of range (ids must be below {MAX_NUMA_NODES})"
    return None


def _repeated(devices: Sequence[Device]) -> list[int] | None:
    """The positions of the copies an id's last copy replaces; None when every id is sent once (the usual case,
    found with one set)."""
    if len({d.id for d in devices}) == len(devices):
        return None
    last = {d.id: i for i, d in enumerate(devices)}
    return [i for i, d in enumerate(devices) if last[d.id] != i]


def checked_snapshot(devices: Sequence[Device]) -> tuple[list[Device], Problems]:
    """Agent mode: the devices to apply, and (device, problem) for each one changed or dropped."""
    problems: Problems = []
    out = list(devices)
    repeated = _repeated(out)
    if repeated is not None:
        problems += [(out[i], f"{REPEATED}; the last one counts") for i in repeated]
        dropped = set(repeated)
        out = [d for i, d in enumerate(out) if i not in dropped]
    for index, device in enumerate(out):
        problem = _numa_problem(device)
        if problem is not None:
            problems.append((device, problem))
            out[index] = Device(device.id, UNHEALTHY, device.numa_nodes)
    return out, problems


def as_sent(devices: list[Device]) -> tuple[list[Device], Problems]:
    """Proxy mode: the devices unchanged, and (device, problem) for each one `checked_snapshot` would change or
    drop, saying what the kubelet makes of it."""
    problems: Problems = []
    repeated = _repeated(devices)
    if repeated is not None:
        problems += [(devices[i], f"{REPEATED}; {_COUNTED_TWICE}") for i in repeated]
    for device in devices:
        problem = _numa_problem(device)
        if problem is not None:
            problems.append((device, f"{problem}; the kubelet gets it as sent and counts the device by its health"))
    return devices, problems  # not copied: the caller's list is fresh from the message


@dataclass(frozen=True, slots=True)
class SnapshotRules:
    """What a plugin connection does with each snapshot before the registry sees it, and how it logs a problem."""

    apply: Callable[[list[Device]], tuple[list[Device], Problems]]
    logged_as: str


CORRECTED = SnapshotRules(checked_snapshot, "device snapshot corrected: the plugin sent what it may not")
AS_SENT = SnapshotRules(as_sent, "device snapshot taken as sent: the plugin sent what it may not")
