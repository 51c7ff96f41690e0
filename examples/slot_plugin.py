"""example.com/slot: a complete device plugin - four slots on two NUMA nodes, with a health check."""
import logging
import os
import threading
import time

from deviceplane.plugin import Allocation, Device, DevicePlugin

logging.basicConfig(level=logging.INFO)  # the SDK logs registration, restarts and failing hooks, with tracebacks
STATE_DIR = os.environ.get("SLOT_STATE_DIR", "/run/slots")  # slot-N is unhealthy while STATE_DIR/slot-N.broken exists

def slots() -> list[Device]:
    return [Device(f"slot-{i}", healthy=not os.path.exists(f"{STATE_DIR}/slot-{i}.broken"), numa_nodes=[i // 2])
            for i in range(4)]

def allocate(device_ids: list[str]) -> Allocation:  # called once per container that gets slots
    return Allocation(envs={"SLOTS": ",".join(device_ids)})

def health_check() -> None:  # set_devices may be called at any time, from any thread
    while True:
        time.sleep(1)
        plugin.set_devices(slots())  # streamed to the kubelet only if something changed

plugin = DevicePlugin("example.com/slot", slots(), allocate=allocate)
threading.Thread(target=health_check, daemon=True).start()
plugin.run()  # serves, registers, re-registers after kubelet restarts; returns on SIGTERM/SIGINT
