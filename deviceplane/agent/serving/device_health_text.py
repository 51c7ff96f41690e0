"""The per-device families written as exposition text directly: `deviceplane_device_health`, one block per resource
kept while the resource's IDs and healthy set are the same, and `deviceplane_device_health_transitions_total` (with
its `_created`), kept until a count changes.

Each has a series per device, and a scrape runs on the agent's event loop: through prometheus_client (a sample
object per device, then a label dict sorted and escaped per line) the health of 10 resources x 1,000 devices took
44 ms of the loop per scrape and of 10 x 10,000 565 ms, every scrape, with nothing changed. Written here, a resource
of 10,000 whose health changed costs ~3 ms and an unchanged one nothing (benchmarks/reads.py). The text is byte for
byte what prometheus_client writes for the same families (tests/unit/test_device_health_text.py compares them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Set
from typing import cast

from prometheus_client import utils

from deviceplane.core.registry import DeviceRegistry

NAME = "deviceplane_device_health"
DOCUMENTATION = "Device health as the agent sees it: 1 healthy, 0 unhealthy (or its plugin disconnected)."
LABELS = ("node", "resource_name", "device_id")

# prometheus_client's float formatting (Go's: 1.0, 1.764e+09), so the text is what it would write; the module is untyped
float_text = cast(Callable[[float], str], utils.floatToGoString)

TRANSITIONS = "deviceplane_device_health_transitions"
TRANSITIONS_DOCUMENTATION = "Health changes reported by device plugins, per device."


def escape_label_value(value: str) -> str:
    """The text format's escaping of a label value (backslash, newline, double quote), as prometheus_client's."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class DeviceHealthText:
    """The family's HELP, TYPE and samples; the resources in the registry's order, devices by ID."""

    def __init__(self, registry: DeviceRegistry, node: str) -> None:
        self._registry = registry
        self._node = node
        self._head = f"# HELP {NAME} {DOCUMENTATION}\n# TYPE {NAME} gauge\n".encode()
        # resource -> (the sorted IDs and the healthy set the block was written from, the block)
        self._blocks: dict[str, tuple[list[str], Set[str], bytes]] = {}

    def pieces(self) -> tuple[bytes, ...]:
        """The text in pieces, to be sent one after another: the head, then each resource's block."""
        blocks: dict[str, tuple[list[str], Set[str], bytes]] = {}
        for state in self._registry.statuses():
            ids, healthy = state.sorted_ids(), state.healthy
            kept = self._blocks.get(state.name)
            # Both are replaced, never changed in place (the registry's contract for `healthy`; `sorted_ids` is a
            # new list whenever the IDs change), so the same objects mean the same text.
            if kept is None or kept[0] is not ids or kept[1] is not healthy:
                kept = (ids, healthy, self._block(state.name, ids, healthy))
            blocks[state.name] = kept
        self._blocks = blocks  # a removed resource's block goes with it
        # Never joined: at 10 x 10,000 devices the blocks are 12 MB, kept once.
        return (self._head, *(block for _ids, _healthy, block in blocks.values()))

    def _block(self, resource: str, ids: list[str], healthy: Set[str]) -> bytes:
        # prometheus_client writes labels sorted by name: device_id, node, resource_name
        prefix = NAME + '{device_id="'
        rest = f'",node="{escape_label_value(self._node)}",resource_name="{escape_label_value(resource)}"}} '
        up, down = rest + "1.0\n", rest + "0.0\n"
        return "".join(
            [prefix + escape_label_value(device_id) + (up if device_id in healthy else down) for device_id in ids]
        ).encode()


class DeviceTransitions:
    """`deviceplane_device_health_transitions_total{node,resource_name,device_id}` and its `_created`, as
    prometheus_client writes a Counter's (series in the order first counted, `_created` the wall time of that). Through
    prometheus_client, a scrape cost ~12 µs per series, every scrape: 122 ms once 10,000 devices had each flipped
    once (a plugin that marks every device unhealthy and back). Here the text is kept until a count changes."""

    def __init__(self, node: str, clock: Callable[[], float] = time.time) -> None:
        self._node = node
        self._clock = clock
        # (resource, device) -> [count, created], in the order first counted
        self._series: dict[tuple[str, str], list[float]] = {}
        self._by_resource: dict[str, set[str]] = {}
        self._kept: tuple[bytes, ...] | None = None
        self._head = f"# HELP {TRANSITIONS}_total {TRANSITIONS_DOCUMENTATION}\n# TYPE {TRANSITIONS}_total counter\n"
        self._created_head = (
            f"# HELP {TRANSITIONS}_created {TRANSITIONS_DOCUMENTATION}\n# TYPE {TRANSITIONS}_created gauge\n"
        )

    def count(self, resource: str, device_ids: Iterable[str]) -> None:
        for device_id in device_ids:
            series = self._series.get((resource, device_id))
            if series is None:
                self._series[resource, device_id] = [1.0, self._clock()]
                self._by_resource.setdefault(resource, set()).add(device_id)
            else:
                series[0] += 1.0
            self._kept = None

    def forget_missing(self, resource: str, present: Container[str]) -> None:
        """Drop the series of the resource's devices not in `present` (gone from its list, or the resource gone)."""
        counted = self._by_resource.get(resource)
        if not counted:
            return
        for device_id in [d for d in counted if d not in present]:
            del self._series[resource, device_id]
            counted.discard(device_id)
            self._kept = None
        if not counted:
            del self._by_resource[resource]

    def pieces(self) -> tuple[bytes, ...]:
        if self._kept is None:
            totals, created = [self._head], []
            node = escape_label_value(self._node)
            for (resource, device_id), (count, since) in self._series.items():
                # prometheus_client writes labels sorted by name: device_id, node, resource_name
                device, owner = escape_label_value(device_id), escape_label_value(resource)
                labels = f'{{device_id="{device}",node="{node}",resource_name="{owner}"}}'
                totals.append(f"{TRANSITIONS}_total{labels} {float_text(count)}\n")
                created.append(f"{TRANSITIONS}_created{labels} {float_text(since)}\n")
            if created:
                created.insert(0, self._created_head)
            self._kept = ("".join(totals).encode(), "".join(created).encode())
        return self._kept
