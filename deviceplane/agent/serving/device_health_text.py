"""The `deviceplane_device_health` family written as exposition text directly, one block per resource kept while the
resource's IDs and healthy set are the same.

It has a series per device, and a scrape runs on the agent's event loop: through prometheus_client (a sample object
per device, then a label dict sorted and escaped per line) 10 resources x 1,000 devices took 44 ms of the loop per
scrape and 10 x 10,000 took 565 ms, every scrape, with nothing changed. Written here, a resource of 10,000 whose
health changed costs ~3 ms and an unchanged one nothing (benchmarks/reads.py). The text is byte for byte what
prometheus_client writes for the same family (tests/unit/test_device_health_text.py compares them).
"""

from __future__ import annotations

from collections.abc import Set

from deviceplane.core.registry import DeviceRegistry

NAME = "deviceplane_device_health"
DOCUMENTATION = "Device health as the agent sees it: 1 healthy, 0 unhealthy (or its plugin disconnected)."
LABELS = ("node", "resource_name", "device_id")


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
