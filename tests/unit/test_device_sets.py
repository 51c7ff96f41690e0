"""The kubelet's counting of a ListAndWatch message (core/device_sets.py), against a line-by-line transcription of
the spec's algorithm (§4.4 genericDeviceUpdateCallback, §4.5 GetCapacity)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.core.device_sets import device_sets, kubelet_counts
from deviceplane.core.registry import Device
from tests.support.fuzz import fuzz_settings

# A small alphabet so that IDs repeat; health strings around "Healthy"; NUMA IDs around 64 and over int64.
IDS = st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=3))
HEALTH = st.one_of(st.sampled_from(["Healthy", "Unhealthy", "healthy", "", "Healthy ", "HEALTHY"]), st.text(max_size=3))
NUMA = st.one_of(st.integers(-2, 3), st.integers(60, 70), st.integers(-(2**63), 2**63 - 1))
DEVICES = st.lists(st.builds(Device, IDS, HEALTH, st.lists(NUMA, max_size=2).map(tuple)), max_size=8)


class Kubelet(NamedTuple):
    all_devices: dict[str, Device]
    healthy: set[str]
    unhealthy: set[str]
    capacity: int
    allocatable: int


def spec_message(devices: Sequence[Device]) -> Kubelet:
    """§4.4 genericDeviceUpdateCallback steps 1-2, then §4.5 GetCapacity for a resource whose endpoint is live."""
    # 1. reset healthyDevices[resource], unhealthyDevices[resource], allDevices[resource]
    all_devices: dict[str, Device] = {}
    healthy_devices: set[str] = set()
    unhealthy_devices: set[str] = set()
    # 2. for each device: allDevices[resource][ID] = dev; "Healthy" (exact) -> healthy, otherwise -> unhealthy
    for dev in devices:
        all_devices[dev.id] = dev
        if dev.health == "Healthy":
            healthy_devices.add(dev.id)
        else:
            unhealthy_devices.add(dev.id)
    return spec_capacity(all_devices, healthy_devices, unhealthy_devices)


def spec_capacity(all_devices: dict[str, Device], healthy_devices: set[str], unhealthy_devices: set[str]) -> Kubelet:
    # GetCapacity: for each resource in healthyDevices, capacity[r] = allocatable[r] = len(healthy); for each resource
    # in unhealthyDevices, capacity[r] += len(unhealthy)
    capacity = allocatable = len(healthy_devices)
    capacity += len(unhealthy_devices)
    return Kubelet(all_devices, healthy_devices, unhealthy_devices, capacity, allocatable)


@fuzz_settings(bounded=300, long=50_000)
@given(DEVICES)
def test_device_sets_are_the_kubelets(devices: list[Device]) -> None:
    kubelet = spec_message(devices)
    sets = device_sets(devices)
    assert (sets.devices, sets.healthy, sets.unhealthy) == kubelet[:3]
    assert kubelet_counts(sets.healthy, sets.unhealthy) == (kubelet.capacity, kubelet.allocatable)
