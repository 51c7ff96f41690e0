"""What one NodeDevices write costs the agent, and what the bound on listed devices buys.

For 10 resources x N devices, the time to build the status model and encode it (what the publisher does at most
once per debounce interval, and what its change check compares), with the default bound of 128 devices per
resource and unbounded, and the size of the JSON sent. In process, from a real DeviceRegistry.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deviceplane.agent.kube.mode import NODEDEVICES_MAX_DEVICES
from deviceplane.agent.kube.node_devices import without_heartbeat
from deviceplane.api.models import AgentView
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from deviceplane.core.view import devices_status

RESOURCES = 10
RUNS = 5


def registry(devices_per_resource: int) -> DeviceRegistry:
    reg = DeviceRegistry(grace_period=300.0)
    for r in range(RESOURCES):
        name = f"example.com/r{r}"
        reg.plugin_connected(name, f"/p/{r}.sock", PluginOptions(), time.monotonic())
        devices = [Device(f"d{i}", "Healthy" if i % 7 else "Unhealthy", (i % 2,)) for i in range(devices_per_resource)]
        reg.apply_snapshot(name, f"/p/{r}.sock", devices)
    return reg


def measure(reg: DeviceRegistry, limit: int | None) -> tuple[float, int]:
    agent = AgentView(version="bench", node="n", lastHeartbeatTime="2026-01-01T00:00:00Z")
    times = []
    size = 0
    for _ in range(RUNS):
        started = time.perf_counter()
        status = devices_status(reg, reg.capacity(), agent, device_limit=limit).model_dump(mode="json")
        without_heartbeat(status)
        size = len(json.dumps(status, separators=(",", ":")))
        times.append(time.perf_counter() - started)
    return statistics.median(times), size


def main() -> None:
    print(f"{RESOURCES} resources; median of {RUNS}: build + encode the NodeDevices status")
    print(f"{'devices/resource':>16} {'bound':>8} {'ms':>9} {'JSON bytes':>12}")
    for n in (100, 1_000, 10_000):
        reg = registry(n)
        for limit in (NODEDEVICES_MAX_DEVICES, None):
            seconds, size = measure(reg, limit)
            print(f"{n:>16} {limit if limit is not None else 'none':>8} {seconds * 1000:>9.1f} {size:>12,}")


if __name__ == "__main__":
    main()
