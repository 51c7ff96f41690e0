"""The allocator's device choice against the algorithm it replaced (tests/unit/allocator_oracle.py, main's code
copied verbatim): random sequences of plugin connections and snapshots (odd IDs, duplicates, any health, NUMA nodes
or none), disconnects and expiry, requests (0..k devices, reusable pools, affinity masks, plugins that offer
GetPreferredAllocation or not, answers with bogus, taken and unhealthy IDs), reservations, commits, releases and
changes made to PodDevices behind the allocator's back (checkpoint load, journal replay) drive two separate worlds,
and every decision, every error (message, kind, resource) and the resulting state must be identical.

Bounded to ~30 s; DEVICEPLANE_FUZZ=long runs many more and longer sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.allocator import AllocationError, Allocator, AskPreferred, Chosen
from deviceplane.core.pod_devices import DevicesPerNuma, PodDevices, devices_per_numa, make_allocation
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from tests.support.fuzz import LONG, fuzz_settings
from tests.unit.allocator_oracle import OracleAllocator

RESOURCES = ("example.com/a", "example.com/b")
SOCKETS = ("/dp/one.sock", "/dp/two.sock")
PODS = tuple(f"p{i}" for i in range(6))
CONTAINERS = ("c0", "c1", "c2")
# Natural order's corner cases: numbers of different lengths, leading zeros (ties), letters around digits.
ODD_IDS = ("10", "9", "a-2", "a-10", "a02", "a2", "dev-1", "dev-01", "x", "0", "Z", "dev-")
BOGUS = ("bogus", "", "dev-999")
HEALTH = ("Healthy", "Healthy", "Healthy", "Unhealthy", "healthy", "")

device_ids = st.one_of(st.sampled_from(ODD_IDS), st.integers(0, 60).map(lambda i: f"dev-{i}"))
numa_nodes = st.one_of(st.just(()), st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True).map(tuple))
devices = st.lists(st.builds(Device, device_ids, st.sampled_from(HEALTH), numa_nodes), max_size=40)
affinities = st.one_of(st.none(), st.integers(0, 15))

A = TypeVar("A", Allocator, OracleAllocator)


class World(Generic[A]):
    def __init__(self, allocator: Callable[[DeviceRegistry, PodDevices], A]) -> None:
        self.registry = DeviceRegistry(grace_period=10)
        self.pod_devices = PodDevices()
        self.allocator = allocator(self.registry, self.pod_devices)


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", call())
    except AllocationError as err:
        return ("error", str(err), err.kind, err.resource)


class Differential(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.old = World(OracleAllocator)
        self.new = World(Allocator)
        self.worlds: tuple[World[Any], ...] = (self.old, self.new)
        self.now = 0.0
        self.reserved: dict[tuple[str, str, str], tuple[str, ...]] = {}
        self.decisions = 0

    def both(self, call: Callable[[World[Any]], Any]) -> Any:
        old, new = (outcome(lambda w=w: call(w)) for w in self.worlds)  # type: ignore[misc]
        assert new == old
        return new

    def known_ids(self, resource: str) -> list[str]:
        return sorted(self.new.registry.devices(resource))

    @initialize(
        first=st.one_of(devices, st.integers(0, 300)),
        second=st.one_of(devices, st.integers(0, 300)),
        preferred=st.tuples(st.booleans(), st.booleans()),
    )
    def start(self, first: list[Device] | int, second: list[Device] | int, preferred: tuple[bool, bool]) -> None:
        """Both resources served from the start: most sequences should admit rather than find nothing registered."""
        for resource, shown, offers in zip(RESOURCES, (first, second), preferred, strict=True):
            self.connect(resource, SOCKETS[0], offers)
            self.snapshot(resource, SOCKETS[0], shown)

    @rule(
        data=st.data(),
        event=st.sampled_from(("connect", "snapshot", "resend", "disconnect", "expire", "insert", "remove")),
    )
    def disturb(self, data: st.DataObject, event: str) -> None:
        """One rule for everything that changes the state under the allocator's index, so that sequences also
        run long stretches of admissions on one index (its incremental updates) between them."""
        resource = data.draw(st.sampled_from(RESOURCES), "resource")
        socket = data.draw(st.sampled_from(SOCKETS), "socket")
        pod = data.draw(st.sampled_from(PODS), "pod")
        if event == "connect":
            self.connect(resource, socket, data.draw(st.booleans(), "offers preferred"))
        elif event == "snapshot":
            self.snapshot(resource, socket, data.draw(st.one_of(devices, st.integers(0, 300)), "devices"))
        elif event == "resend":
            self.resend(resource, socket, data.draw(st.sets(st.integers(0, 300), max_size=4), "flipped"))
        elif event == "disconnect":
            self.disconnect(resource, socket)
        elif event == "expire":
            self.expire()
        elif event == "insert":
            self.replay_insert(data, pod, data.draw(st.sampled_from(CONTAINERS), "container"), resource)
        else:
            self.replay_remove(pod)

    # -- the plugins ------------------------------------------------------------------------------------------------

    def connect(self, resource: str, socket: str, preferred: bool) -> None:
        self.now += 1
        options = PluginOptions(get_preferred_allocation_available=preferred)
        for world in self.worlds:
            if socket in world.registry.connected_sockets(resource):
                world.registry.plugin_reconnected(resource, socket, options, self.now)
            else:
                world.registry.plugin_connected(resource, socket, options, self.now)

    def snapshot(self, resource: str, socket: str, shown: list[Device] | int) -> None:
        if isinstance(shown, int):  # a bigger plugin: dev-0..dev-N, every 7th unhealthy
            shown = [Device(f"dev-{i}", "Unhealthy" if i % 7 == 3 else "Healthy") for i in range(shown)]
        self.both(lambda w: w.registry.apply_snapshot(resource, socket, shown))

    def resend(self, resource: str, socket: str, flipped: set[int]) -> None:
        """The plugin's list again, the same IDs in the same order, with the health of the devices at `flipped`
        positions changed (none: an identical resend), as plugins send on a health change: the new allocator keeps
        its device order and updates its index in place then."""
        endpoint = self.new.registry.primary_endpoint(resource)
        if endpoint is None:
            return
        shown = [
            Device(d.id, ("Unhealthy" if d.is_healthy else "Healthy") if i in flipped else d.health, d.numa_nodes)
            for i, d in enumerate(endpoint.devices)
        ]
        self.both(lambda w: w.registry.apply_snapshot(resource, socket, shown))

    def disconnect(self, resource: str, socket: str) -> None:
        self.now += 1
        self.both(lambda w: w.registry.plugin_disconnected(resource, socket, self.now))

    def expire(self) -> None:
        self.now += 11
        self.both(lambda w: w.registry.expire(self.now))

    # -- admissions -------------------------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        pod=st.sampled_from(PODS),
        container=st.sampled_from(CONTAINERS),
        resource=st.sampled_from(RESOURCES),
        required=st.integers(0, 5),
        affinity=affinities,
        then=st.sampled_from(("reserve", "commit", "nothing")),
    )
    def request(
        self,
        data: st.DataObject,
        pod: str,
        container: str,
        resource: str,
        required: int,
        affinity: int | None,
        then: str,
    ) -> None:
        known = self.known_ids(resource)
        reusable = data.draw(st.sets(st.sampled_from([*known, *BOGUS])) if known else st.just(set[str]()), "reusable")
        if data.draw(st.integers(0, 2), "reuse") != 0:
            reusable = set()  # most containers have no init container's devices to reuse
        preferred: frozenset[str] | None = None
        if data.draw(st.integers(0, 4), "answer unasked") == 0:
            preferred = data.draw(st.frozensets(st.sampled_from([*known, *BOGUS])), "preferred")
        args = (pod, container, resource, required, frozenset(reusable), affinity)
        result = self.both(lambda w: w.allocator.devices_to_allocate(*args, preferred=preferred))
        self.decisions += 1
        if result[0] == "ok" and isinstance(result[1], AskPreferred):
            asked: AskPreferred = result[1]
            # an honest answer, a partial one, or a lying one (bogus, taken or unhealthy IDs)
            answer = data.draw(
                st.one_of(
                    st.frozensets(st.sampled_from(asked.available), max_size=asked.size) if asked.available else
                    st.just(frozenset[str]()),
                    st.frozensets(st.sampled_from([*asked.available, *known, *BOGUS])),
                ),
                "answer",
            )  # fmt: skip
            result = self.both(lambda w: w.allocator.devices_to_allocate(*args, preferred=answer))
        if result[0] != "ok" or not isinstance(result[1], Chosen) or not result[1].devices or then == "nothing":
            return
        chosen: tuple[str, ...] = result[1].devices
        key = (pod, container, resource)
        self.both(lambda w: w.allocator.reserve(*key, chosen))
        self.reserved[key] = chosen
        if then == "commit":
            self.commit_key(key)

    def commit_key(self, key: tuple[str, str, str]) -> None:
        chosen = self.reserved.pop(key)
        response = pb.ContainerAllocateResponse(envs={"K": ",".join(chosen)})
        self.both(lambda w: w.allocator.commit(*key, chosen, response))

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def finish_reservation(self, data: st.DataObject, commit: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.reserved)), "reservation")
        if commit:
            self.commit_key(key)
        else:
            del self.reserved[key]
            self.both(lambda w: w.allocator.unreserve(*key))

    def holding_pods(self) -> list[str]:
        return sorted(self.new.pod_devices.pods() | {key[0] for key in self.reserved})

    @precondition(lambda self: self.holding_pods())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pod = data.draw(st.sampled_from(self.holding_pods()), "pod")
        for key in [k for k in self.reserved if k[0] == pod]:
            del self.reserved[key]
        self.both(lambda w: w.allocator.release_pod(pod))

    # -- PodDevices changed by others (checkpoint load, journal replay) ---------------------------------------------

    def replay_insert(self, data: st.DataObject, pod: str, container: str, resource: str) -> None:
        def per_numa(world: World[Any], ids: list[str]) -> DevicesPerNuma:
            return devices_per_numa(ids, world.registry.devices(resource))

        ids = data.draw(st.lists(st.sampled_from([*self.known_ids(resource), *BOGUS]), max_size=3), "held")
        self.both(
            lambda w: w.pod_devices.insert(
                make_allocation(pod, container, resource, per_numa(w, ids), pb.ContainerAllocateResponse())
            )
        )

    def replay_remove(self, pod: str) -> None:
        self.both(lambda w: w.pod_devices.remove_pod(pod))

    # -- the state is the same --------------------------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        for resource in RESOURCES:
            assert self.new.allocator.allocated(resource) == self.old.allocator.allocated(resource)
        assert self.new.pod_devices.entries() == self.old.pod_devices.entries()


# A long run (DEVICEPLANE_FUZZ=long) takes as long as it takes: no per-test timeout for it.
TestDifferential = pytest.mark.timeout(0 if LONG else 300)(Differential.TestCase)
TestDifferential.settings = fuzz_settings(250, 20_000, stateful_step_count=100 if LONG else 40)


def first_free_after(allocator: Allocator, resource: str, held: Sequence[str]) -> tuple[str, ...]:
    for index, device_id in enumerate(held):
        allocator.reserve(f"h{index}", "c", resource, (device_id,))
    decision = allocator.devices_to_allocate("p", "c", resource, 2)
    assert isinstance(decision, Chosen)
    return decision.devices


def test_index_follows_a_snapshot_and_a_release() -> None:
    """A direct check of what the differential test covers at random: the free devices in natural order, after a
    reservation, a new snapshot and a release."""
    registry = DeviceRegistry(grace_period=10)
    registry.plugin_connected(RESOURCES[0], SOCKETS[0], PluginOptions(), 0)
    registry.apply_snapshot(RESOURCES[0], SOCKETS[0], [Device(i, "Healthy") for i in ("10", "9", "a-2", "a-10")])
    allocator = Allocator(registry, PodDevices())
    assert first_free_after(allocator, RESOURCES[0], ["9"]) == ("10", "a-2")
    registry.apply_snapshot(RESOURCES[0], SOCKETS[0], [Device(i, "Healthy") for i in ("10", "a-10", "a-2", "b")])
    assert first_free_after(allocator, RESOURCES[0], []) == ("10", "a-2")
    allocator.release_pod("h0")
    registry.apply_snapshot(RESOURCES[0], SOCKETS[0], [Device(i, "Healthy") for i in ("10", "9")])
    assert first_free_after(allocator, RESOURCES[0], []) == ("9", "10")


def test_a_commit_that_replaces_an_entry_frees_the_devices_it_no_longer_holds() -> None:
    """Not reachable through admit_pod (a container with an entry needs nothing), so checked here, against the
    oracle: committing again for a container frees the devices of its previous entry."""
    worlds = (World(OracleAllocator), World(Allocator))
    for world in worlds:
        world.registry.plugin_connected(RESOURCES[0], SOCKETS[0], PluginOptions(), 0)
        world.registry.apply_snapshot(RESOURCES[0], SOCKETS[0], [Device(f"d{i}", "Healthy") for i in range(4)])
        world.allocator.commit("p", "c", RESOURCES[0], ("d0", "d1"), pb.ContainerAllocateResponse())
        assert world.allocator.devices_to_allocate("q", "c", RESOURCES[0], 1) == Chosen(("d2",))
        world.allocator.commit("p", "c", RESOURCES[0], ("d3",), pb.ContainerAllocateResponse())
    old, new = (w.allocator.devices_to_allocate("q", "c", RESOURCES[0], 3) for w in worlds)
    assert new == old == Chosen(("d0", "d1", "d2"))
