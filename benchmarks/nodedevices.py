"""What one NodeDevices write costs the agent, and what the bound on listed devices buys.

For 10 resources x N devices, the time to build the status model and encode it (what the publisher does at most
once per debounce interval, and what its change check compares), with the default bound of 128 devices per
resource and unbounded, and the size of the JSON sent. In process, from a real DeviceRegistry.

Then the same with containers holding devices (1 device each): a count poll (`/api/v1/devices?resource=R&limit=0`)
and the NodeDevices status (bound 128), from real PodDevices. Who holds a device is looked up only for the devices
listed (core.pod_view.AllocationHolders); before, every call built a holder for every allocation on the node.
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
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.models import AgentView
from deviceplane.core.conditions import ConditionTimes
from deviceplane.core.pod_devices import PodDevices, make_allocation
from deviceplane.core.pod_table import PodTable
from deviceplane.core.pod_view import AllocationHolders
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


def held(reg: DeviceRegistry, containers: int) -> PodDevices:
    """`containers` pods of one container, each holding one device of the first resource."""
    pods = PodDevices()
    resource = "example.com/r0"
    for i, device_id in zip(range(containers), sorted(reg.devices(resource)), strict=False):
        pods.insert(make_allocation(f"uid-{i}", "main", resource, {0: (device_id,)}, pb.ContainerAllocateResponse()))
    return pods


def measure(
    reg: DeviceRegistry, limit: int | None, pods: PodDevices | None = None, resource: str | None = None
) -> tuple[float, int]:
    agent = AgentView(version="bench", node="n", lastHeartbeatTime="2026-01-01T00:00:00Z")
    times = []
    size = 0
    for _ in range(RUNS):
        started = time.perf_counter()
        holders = AllocationHolders(pods, PodTable()) if pods is not None else None
        shown = (lambda name: name == resource) if resource else None
        status = devices_status(  # with the node's conditions, judged over every resource, as the API and NodeDevices
            reg, agent, holders, device_limit=limit, resource_filter=shown, conditions=ConditionTimes()
        ).model_dump(mode="json")
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
    reg = registry(10_000)
    print(f"{RESOURCES} resources x 10,000 devices, containers holding one device each; median of {RUNS}")
    print(f"{'held':>16} {'call':>34} {'ms':>9}")
    for containers in (0, 5_000):
        pods = held(reg, containers)
        calls = (("count poll (limit=0, one resource)", 0, "example.com/r0"), ("NodeDevices (bound 128)", 128, None))
        for label, limit, resource in calls:
            seconds, _ = measure(reg, limit, pods, resource)
            print(f"{containers:>16,} {label:>34} {seconds * 1000:>9.3f}")


if __name__ == "__main__":
    main()
