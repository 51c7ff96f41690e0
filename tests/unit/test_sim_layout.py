"""The sim builds its device list once: the same devices and NUMA nodes as before, refused at the same counts.

Until 2026-11-28 the sim built a second list, every device unhealthy, and its ListAndWatch message, only to check that
it fit; its size is now computed (sim_layout.all_unhealthy_message_bytes). The construction before is kept here.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.plugin.devices import MAX_MESSAGE_BYTES, DeviceListTooLarge
from deviceplane.plugin.models import Device
from deviceplane.plugin.sim import SimPlugin
from deviceplane.plugin.sim_bounds import MAX_COUNT
from deviceplane.plugin.sim_layout import all_unhealthy_message_bytes, numa_layout

# Counts crossing the id lengths' steps (sim-9 / sim-10 ...); NUMA node counts up to the largest accepted, so that node
# ids take every varint length (a node id of 0 is left out of the encoding).
COUNTS = st.integers(0, 1500) | st.sampled_from([9, 10, 11, 99, 100, 101, 999, 1000, 1001])
NUMA = st.integers(0, 8) | st.integers(0, MAX_COUNT) | st.sampled_from([127, 128, 129, 16383, 16384, 16385, MAX_COUNT])


def devices_before(count: int, numa: int, healthy: bool = True) -> list[Device]:
    """The sim's devices as built before: sim-0..N-1 in contiguous blocks over the NUMA nodes."""
    return [Device(f"sim-{i}", healthy=healthy, numa_nodes=(i * numa // count,) if numa else ()) for i in range(count)]


def all_unhealthy_bytes_before(count: int, numa: int) -> int:
    """The size of the list the sim built only to check it fit."""
    return int(pb.ListAndWatchResponse(devices=[d.to_proto() for d in devices_before(count, numa, False)]).ByteSize())


@settings(max_examples=300, deadline=None)
@given(count=COUNTS, numa=NUMA)
def test_the_same_devices_and_numa_nodes(count: int, numa: int) -> None:
    sim = SimPlugin("example.com/sim", count, numa, plugin_dir="/nonexistent")
    assert list(sim.plugin.devices) == devices_before(count, numa)
    assert sim.numa_of == {d.id: d.numa_nodes for d in devices_before(count, numa)}  # what GetPreferredAllocation packs


@settings(max_examples=300, deadline=None)
@given(count=COUNTS, numa=NUMA)
def test_the_longest_message_size_is_the_built_ones(count: int, numa: int) -> None:
    assert all_unhealthy_message_bytes(numa_layout(count, numa)) == all_unhealthy_bytes_before(count, numa)


# The largest count that fit by the construction before, per NUMA node count (found by bisection with it): ids of six
# digits, nodes of every varint length.
LARGEST_BEFORE = {0: 172_216, 1: 148_462, 2: 143_513, 1000: 135_093, MAX_COUNT: 130_747}


@pytest.mark.parametrize(("numa", "largest"), LARGEST_BEFORE.items())
def test_refused_from_the_same_count(numa: int, largest: int) -> None:
    assert all_unhealthy_message_bytes(numa_layout(largest, numa)) <= MAX_MESSAGE_BYTES
    assert all_unhealthy_message_bytes(numa_layout(largest + 1, numa)) > MAX_MESSAGE_BYTES


def test_the_sim_refuses_what_does_not_fit_with_every_device_unhealthy() -> None:
    largest = LARGEST_BEFORE[1]
    assert len(SimPlugin("example.com/sim", largest, 1, plugin_dir="/nonexistent").plugin.devices) == largest
    with pytest.raises(DeviceListTooLarge, match=rf"--count {largest + 1} --numa 1: .* when all are unhealthy"):
        SimPlugin("example.com/sim", largest + 1, 1, plugin_dir="/nonexistent")
