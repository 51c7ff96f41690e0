"""What a plugin's repeated ListAndWatch messages cost the agent's event loop, in one process (core objects only).

Plugins send their whole device list on every change, and some resend it unchanged. Each message replaces what the
registry shows; what the agent derived from the old objects (the allocator's device order and free-device index, the
checkpoint's sorted RegisteredDevices) is then made again, on the loop, by whoever needs it next. Two messages are
measured, alternated `--rounds` times against a resource of 1,024 and of 10,000 devices (5,000 of them held, as in
compare.py's filler):

    identical   the same list again (new message objects, equal content)
    one flips   the same IDs in the same order, one device's health changed (and changed back the next time)

Printed per case, the median ms of wall time on the loop:

    apply            DeviceRegistry.apply_snapshot
    next admission   one 1-device admission right after (device choice, reservation, commit), minus a steady one
    RegisteredDevices  the checkpoint's sorted healthy IDs of the resource (ResourceState.sorted_healthy)

    python benchmarks/snapshot_churn.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb  # noqa: E402
from deviceplane.core.allocator import Allocator, Chosen  # noqa: E402
from deviceplane.core.pod_devices import PodDevices  # noqa: E402
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions  # noqa: E402

RESOURCE = "example.com/gpu"
SOCKET = "/tmp/gpu.sock"
RESPONSE = pb.ContainerAllocateResponse()


def message(count: int, flipped: str | None) -> list[Device]:
    """A fresh list as a plugin client decodes one: new strings and tuples every time."""
    return [Device(f"dev-{i}", "Unhealthy" if f"dev-{i}" == flipped else "Healthy") for i in range(count)]


def admit(allocator: Allocator, uid: str) -> float:
    started = time.perf_counter()
    decision = allocator.devices_to_allocate(uid, "c", RESOURCE, 1)
    assert isinstance(decision, Chosen) and len(decision.devices) == 1
    allocator.reserve(uid, "c", RESOURCE, decision.devices)
    allocator.commit(uid, "c", RESOURCE, decision.devices, RESPONSE)
    return time.perf_counter() - started


def measure(count: int, held: int, kind: str, rounds: int) -> tuple[float, float, float]:
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(RESOURCE, SOCKET, PluginOptions(), now=0)
    registry.apply_snapshot(RESOURCE, SOCKET, message(count, None))
    allocator = Allocator(registry, PodDevices())
    for i in range(held):  # the last IDs held, so the free ones come first
        device = (f"dev-{count - 1 - i}",)
        allocator.reserve(f"held-{i}", "c", RESOURCE, device)
        allocator.commit(f"held-{i}", "c", RESOURCE, device, RESPONSE)
    registry.registered_healthy()
    applied, admitted, sorted_ = [], [], []
    for r in range(rounds + 1):
        steady = admit(allocator, f"steady-{r}")
        flipped = "dev-3" if kind == "one flips" and r % 2 == 0 else None
        shown = message(count, flipped)
        started = time.perf_counter()
        registry.apply_snapshot(RESOURCE, SOCKET, shown)
        applied_at = time.perf_counter()
        first = admit(allocator, f"after-{r}")
        listed_at = time.perf_counter()
        registry.registered_healthy()
        done = time.perf_counter()
        allocator.release_pod(f"steady-{r}")
        allocator.release_pod(f"after-{r}")
        if r:  # the first round warms the caches
            applied.append(applied_at - started)
            admitted.append(first - steady)
            sorted_.append(done - listed_at)
    return statistics.median(applied) * 1e3, statistics.median(admitted) * 1e3, statistics.median(sorted_) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    print("ms on the loop per ListAndWatch message (medians)")
    print(f"{'devices':>8} {'held':>6} {'message':>10} {'apply':>8} {'next admission':>15} {'RegisteredDevices':>18}")
    for count, held in ((1024, 0), (10_000, 5000)):
        for kind in ("identical", "one flips"):
            apply_ms, admission_ms, listed_ms = measure(count, held, kind, args.rounds)
            print(f"{count:>8,} {held:>6,} {kind:>10} {apply_ms:>8.2f} {admission_ms:>15.2f} {listed_ms:>18.2f}")


if __name__ == "__main__":
    main()
