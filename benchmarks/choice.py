"""Device choice alone: CPU µs per devices_to_allocate + reserve + commit cycle of a 1-device request, in one
process, the allocator before the free-device index (tests/unit/allocator_oracle.py, main's code verbatim: "old")
against the current one ("new").

Cases: a resource of 1,024 or 10,000 devices (dev-0..dev-N), with nothing held, with 5,000 containers holding one
device each of a second resource (as benchmarks/allocation.py's filler), and, at 10,000 devices, with 5,000 holding
devices of the measured resource itself. Each round admits 500 pods and then releases them (not timed); the figure
is the median over rounds of process time per cycle. `--preferred`: the plugin offers GetPreferredAllocation, so a
cycle is the question (every free ID, in plain order), then the decision with a 1-ID answer.

    python benchmarks/choice.py [--rounds 7] [--preferred]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb  # noqa: E402
from deviceplane.core.allocator import Allocator as NewAllocator  # noqa: E402
from deviceplane.core.allocator import AskPreferred, Chosen  # noqa: E402
from deviceplane.core.pod_devices import PodDevices  # noqa: E402
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions  # noqa: E402
from tests.unit.allocator_oracle import OracleAllocator  # noqa: E402

RESOURCE = "example.com/sim"
FILLER = "example.com/filler"
BATCH = 500
RESPONSE = pb.ContainerAllocateResponse()


def build(kind: type[Any], devices: int, held: int, held_resource: str, preferred: bool) -> Any:
    registry = DeviceRegistry(grace_period=300)
    options = PluginOptions(get_preferred_allocation_available=preferred)
    sizes = {RESOURCE: devices, FILLER: held if held_resource == FILLER else 0}
    for resource, count in sizes.items():
        registry.plugin_connected(resource, f"/tmp/{resource}.sock", options, now=0)
        shown = [Device(f"dev-{i}", "Healthy") for i in range(count)]
        registry.apply_snapshot(resource, f"/tmp/{resource}.sock", shown)
    allocator = kind(registry, PodDevices())
    for i in range(held):  # the holders: the last IDs of the resource, so the free ones come first
        device = (f"dev-{sizes[held_resource] - 1 - i}",)
        allocator.reserve(f"held-{i}", "c", held_resource, device)
        allocator.commit(f"held-{i}", "c", held_resource, device, RESPONSE)
    return allocator


def cycle(allocator: Any, uid: str) -> None:
    decision = allocator.devices_to_allocate(uid, "c", RESOURCE, 1)
    if isinstance(decision, AskPreferred):
        answer = {decision.available[len(decision.available) // 2]}
        decision = allocator.devices_to_allocate(uid, "c", RESOURCE, 1, preferred=answer)
    assert isinstance(decision, Chosen) and len(decision.devices) == 1
    allocator.reserve(uid, "c", RESOURCE, decision.devices)
    allocator.commit(uid, "c", RESOURCE, decision.devices, RESPONSE)


def measure(allocator: Any, rounds: int) -> float:
    """Median µs of process time per cycle over `rounds` rounds of BATCH admissions (released after each round)."""
    per_cycle = []
    for r in range(rounds + 1):
        uids = [f"pod-{r}-{i}" for i in range(BATCH)]
        started = time.process_time()
        for uid in uids:
            cycle(allocator, uid)
        elapsed = time.process_time() - started
        for uid in uids:
            allocator.release_pod(uid)
        if r:  # the first round warms the caches (natural keys, ranks, the index)
            per_cycle.append(elapsed / BATCH * 1e6)
    return statistics.median(per_cycle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--preferred", action="store_true", help="the plugin offers GetPreferredAllocation")
    args = parser.parse_args()
    cases = [
        (1024, 0, RESOURCE),
        (1024, 5000, FILLER),
        (10_000, 0, RESOURCE),
        (10_000, 5000, FILLER),
        (10_000, 5000, RESOURCE),
    ]
    print(f"µs of CPU per devices_to_allocate + reserve + commit, 1-device request{' + preferred' * args.preferred}")
    print(f"{'devices':>8} {'held (of)':>20} {'old':>9} {'new':>9} {'old/new':>8}")
    for devices, held, held_resource in cases:
        figures = [
            measure(build(kind, devices, held, held_resource, args.preferred), args.rounds)
            for kind in (OracleAllocator, NewAllocator)
        ]
        where = "" if not held else " (same)" if held_resource == RESOURCE else " (other)"
        ratio = figures[0] / figures[1]
        print(f"{devices:>8} {str(held) + where:>20} {figures[0]:>9.1f} {figures[1]:>9.1f} {ratio:>7.1f}x")


if __name__ == "__main__":
    main()
