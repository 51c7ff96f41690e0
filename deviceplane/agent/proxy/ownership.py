"""Who holds which device, as the kubelet decided: its PodResources API (List + GetAllocatableResources), polled at a
bounded rate (v1 has no Watch), joined with the Allocate calls the proxy forwarded.

A device the kubelet allocated through the proxy but that PodResources does not list yet (the kubelet lists a pod
once its containers are being created) shows up as a pending allocation in `/api/v1/pods`, so nothing the kubelet
allocated is invisible in between.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.models import AllocatedTo
from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplane.core.conditions import PodResourcesLink

log = logging.getLogger("deviceplane.agent.proxy.ownership")

# Two calls per poll: 4 polls/s stay far below the kubelet's PodResources rate limit (100 qps, burst 10).
POLL_INTERVAL_SECONDS = 0.25
CALL_TIMEOUT_SECONDS = 2.0
PENDING_TTL_SECONDS = 60.0  # a pending allocation no pod ever claimed (a failed admission) is forgotten

DeviceKey = tuple[str, str]  # (resource, device id)


class PodResourcesClient(Protocol):
    """The two PodResourcesLister v1 calls made here (protoc's stub carries no annotations)."""

    def List(
        self, request: pr.ListPodResourcesRequest, *, timeout: float | None = None
    ) -> Awaitable[pr.ListPodResourcesResponse]: ...

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, *, timeout: float | None = None
    ) -> Awaitable[pr.AllocatableResourcesResponse]: ...


def pod_resources_stub(channel: grpc.aio.Channel) -> PodResourcesClient:
    return cast(PodResourcesClient, pr_grpc.PodResourcesListerStub(channel))  # type: ignore[no-untyped-call]


@dataclass
class KubeletView:
    holders: dict[DeviceKey, AllocatedTo] = field(default_factory=dict)
    allocated_counts: dict[str, int] = field(default_factory=dict)  # held devices per resource (from `holders`)
    pods: list[dict[str, Any]] = field(default_factory=list)
    allocatable: dict[str, set[str]] = field(default_factory=dict)  # healthy devices per resource, per the kubelet


@dataclass(frozen=True)
class Outage:
    """Since when and why the kubelet's PodResources stopped answering (its first failed call)."""

    since: float  # the poller's clock, for how long
    since_wall: float  # Unix time, for the OwnersCurrent condition
    code: str  # the gRPC status code's name
    details: str

    @property
    def why(self) -> str:
        return f"{self.code}: {self.details}" if self.details else self.code


def kubelet_view(listed: pr.ListPodResourcesResponse, allocatable: pr.AllocatableResourcesResponse) -> KubeletView:
    view = KubeletView()
    for pod in listed.pod_resources:
        containers = []
        for container in pod.containers:
            devices: dict[str, list[str]] = {}
            holder = AllocatedTo(namespace=pod.namespace, pod=pod.name, container=container.name)
            for entry in container.devices:
                for device_id in entry.device_ids:
                    devices.setdefault(entry.resource_name, [])
                    if device_id not in devices[entry.resource_name]:
                        devices[entry.resource_name].append(device_id)
                    view.holders[(entry.resource_name, device_id)] = holder
            containers.append({"name": container.name, "devices": {k: sorted(v) for k, v in devices.items()}})
        view.pods.append(
            {
                "namespace": pod.namespace,
                "name": pod.name,
                "uid": None,  # PodResources does not say
                "source": "kubelet",
                "admitted": True,
                "reason": None,
                "containers": containers,
            }
        )
    for entry in allocatable.devices:
        view.allocatable.setdefault(entry.resource_name, set()).update(entry.device_ids)
    view.allocated_counts = dict(Counter(resource for resource, _device in view.holders))
    return view


class Ownership:
    def __init__(
        self,
        socket_path: Path,
        interval: float = POLL_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._socket_path = socket_path
        self._interval = interval
        self._clock = clock
        self._view = KubeletView()
        self._pending: dict[DeviceKey, float] = {}  # allocated through the proxy, not yet listed -> when
        self._wall_clock = wall_clock
        self.last_listed = 0.0  # Unix time of the last successful listing; 0 before the first
        self._lost: Outage | None = None
        # Set by the first successful listing: before it, every device would look free.
        self.listed = asyncio.Event()
        # Bumped whenever the kubelet's owners change, or whether they are current does (OwnersCurrent), so a
        # NodeDevices publisher knows to write again.
        self.generation = 0

    # -- the join -----------------------------------------------------------------------------------------------------

    def allocated(self, resource: str, request: bytes) -> None:
        """A successful Allocate the proxy forwarded: its devices are held from now on."""
        parsed = pb.AllocateRequest.FromString(request)
        now = self._clock()
        for container in parsed.container_requests:
            for device_id in container.devices_ids:
                self._pending[(resource, device_id)] = now

    def _settle(self) -> None:
        now = self._clock()
        for key, since in list(self._pending.items()):
            if key in self._view.holders or now - since > PENDING_TTL_SECONDS:
                del self._pending[key]

    # -- views --------------------------------------------------------------------------------------------------------

    def holder(self, resource: str, device_id: str) -> AllocatedTo | None:
        return self._view.holders.get((resource, device_id))

    def allocated_count(self, resource: str) -> int:
        return self._view.allocated_counts.get(resource, 0)

    def held(self, resource: str) -> Collection[str]:
        return {device_id for (name, device_id) in self._view.holders if name == resource}

    def ready(self) -> str | None:
        """Not ready before the first listing (every device would look free), nor while the kubelet does not answer
        after it: the owners shown are those of the last listing, and may be wrong (docs/proxy.md, Readiness)."""
        if not self.listed.is_set():
            return "kubelet PodResources not listed yet" + (f": {self._lost.code}" if self._lost else "")
        if self._lost is None:
            return None
        return (
            f"kubelet PodResources unreachable for {self._clock() - self._lost.since:.0f} s ({self._lost.code}): "
            "device owners are as of its last listing"
        )

    def link(self) -> PodResourcesLink:
        """What the OwnersCurrent condition is judged from."""
        lost = self._lost
        return PodResourcesLink(
            last_listed=self.last_listed if self.listed.is_set() else None,
            lost_since=lost.since_wall if lost is not None else None,
            error=lost.why if lost is not None else None,
        )

    def kubelet_allocatable(self) -> dict[str, int]:
        return {resource: len(ids) for resource, ids in self._view.allocatable.items()}

    def pods_json(self) -> list[dict[str, Any]]:
        self._settle()
        pods = list(self._view.pods)
        pending: dict[str, list[str]] = {}
        for resource, device_id in sorted(self._pending):
            pending.setdefault(resource, []).append(device_id)
        if pending:
            pods.append(
                {
                    "namespace": None,
                    "name": None,
                    "uid": None,
                    "source": "allocate",
                    "admitted": True,
                    "reason": "allocated by the kubelet through the proxy; PodResources does not list its pod yet",
                    "containers": [{"name": None, "devices": pending}],
                }
            )
        return pods

    # -- polling ------------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        channel: grpc.aio.Channel | None = None
        try:
            while True:
                if channel is None:
                    channel = grpc.aio.insecure_channel(
                        f"unix://{self._socket_path}", options=[("grpc.default_authority", "localhost")]
                    )
                try:
                    await self.poll_once(pod_resources_stub(channel))
                except grpc.aio.AioRpcError as err:
                    self._unreachable(err)
                    # A fresh channel: the kubelet may have restarted on a new socket.
                    await channel.close(None)
                    channel = None
                await asyncio.sleep(self._interval)
        finally:
            if channel is not None:
                await channel.close(None)

    async def poll_once(self, stub: PodResourcesClient) -> None:
        listed = await stub.List(pr.ListPodResourcesRequest(), timeout=CALL_TIMEOUT_SECONDS)
        allocatable = await stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=CALL_TIMEOUT_SECONDS)
        view = kubelet_view(listed, allocatable)
        if view.holders != self._view.holders:
            self.generation += 1
        self._view = view
        self._settle()
        if not self.reachable:
            log.info("kubelet PodResources reachable", extra={"socket": str(self._socket_path)})
            self.generation += 1  # the owners are current again
        self.listed.set()
        self.last_listed = self._wall_clock()
        self._lost = None

    def _unreachable(self, err: grpc.aio.AioRpcError) -> None:
        """Logged once per outage; /readyz and the metrics say it for as long as it lasts."""
        if self._lost is None:
            log.warning(
                "kubelet PodResources unreachable: %s",
                err.details() or err.code().name,
                extra={"socket": str(self._socket_path)},
            )
            self._lost = Outage(self._clock(), self._wall_clock(), err.code().name, err.details() or "")
            self.generation += 1  # the owners shown are no longer current

    @property
    def reachable(self) -> bool:
        """The last poll answered (the metric `deviceplane_kubelet_pod_resources_up`)."""
        return self.listed.is_set() and self._lost is None
