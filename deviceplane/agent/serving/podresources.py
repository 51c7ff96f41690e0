"""The kubelet's PodResources API v1 on `--pod-resources-socket`, answering as the kubelet does (spec §2).

- List: every active (admitted, not terminated) pod, with its app containers and restartable init containers (the
  kubelet lists those since sidecar support; regular init containers have finished by then).
- Get: one pod by namespace and name, any pod a source reports (the kubelet answers from its pod manager, which
  holds pods rejected at admission, ended, or still admitting until they are deleted): its containers, as List
  shows them, with whatever devices they hold (none but for an admitted pod). Only an unknown pod is "not found".
- GetAllocatableResources: every healthy device of every resource, allocated or not.
Devices are one `ContainerDevices` per device per NUMA node; a device without topology has no `topology`.
There is no CPU, memory or DRA manager here, so those fields stay empty.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Set
from pathlib import Path

import grpc

from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplane.api.typed_grpc import Context, add_pod_resources, bind_unix_socket
from deviceplane.core.pod_devices import DeviceInstance, PodDevices
from deviceplane.core.pod_table import PodRecord, PodTable
from deviceplane.core.pods import Pod
from deviceplane.core.registry import Device, DeviceRegistry
from deviceplane.unix_sockets import serve_again_when_removed

log = logging.getLogger("deviceplane.podresources")

STOP_GRACE_SECONDS = 0.5  # for the calls in flight when the server stops (agent stop, or the socket served again)


def container_devices(rows: list[DeviceInstance]) -> list[pr.ContainerDevices]:
    out = []
    for row in rows:
        topology = pr.TopologyInfo(nodes=[pr.NUMANode(ID=row.numa)]) if row.numa is not None else None
        out.append(pr.ContainerDevices(resource_name=row.resource, device_ids=[row.device_id], topology=topology))
    return out


class PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, table: PodTable, pod_devices: PodDevices, registry: DeviceRegistry) -> None:
        self._table = table
        self._pod_devices = pod_devices
        self._registry = registry
        # pod UID -> (the pod and its allocations' generation it was encoded from, its part of a List answer)
        self._encoded: dict[str, tuple[Pod, int, bytes]] = {}
        # resource -> (its devices and healthy set, its part of a GetAllocatableResources answer)
        self._allocatable: dict[str, tuple[Mapping[str, Device], Set[str], bytes]] = {}

    def _pod_resources(self, record: PodRecord) -> pr.PodResources:
        pod = record.pod
        containers = []
        for container in (*[c for c in pod.init_containers if c.restartable], *pod.containers):
            rows = self._pod_devices.device_instances(pod.uid, container.name)
            containers.append(pr.ContainerResources(name=container.name, devices=container_devices(rows)))
        return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    async def List(self, request: pr.ListPodResourcesRequest, context: Context) -> bytes:
        """The ListPodResourcesResponse, serialized (typed_grpc.add_pod_resources sends it as it is). Monitoring
        agents call List on every scrape (dcgm-exporter), on the event loop that admits pods: building every pod's
        messages took it 45 ms at 5,000 pods holding devices. Each pod's part is kept encoded while its pod and its
        allocations are the same objects; the answer is their concatenation, which is what protobuf makes of a
        repeated field serialized element by element (benchmarks/reads.py --agent)."""
        encoded: dict[str, tuple[Pod, int, bytes]] = {}
        parts = []
        for record in self._table.active():
            pod = record.pod
            generation = self._pod_devices.pod_generation(pod.uid)
            kept = self._encoded.get(pod.uid)
            if kept is None or kept[0] is not pod or kept[1] != generation:
                one = pr.ListPodResourcesResponse(pod_resources=[self._pod_resources(record)])
                kept = (pod, generation, one.SerializeToString())
            encoded[pod.uid] = kept
            parts.append(kept[2])
        self._encoded = encoded  # pods no longer listed are forgotten
        return b"".join(parts)

    async def Get(self, request: pr.GetPodResourcesRequest, context: Context) -> pr.GetPodResourcesResponse:
        record = self._table.find(request.pod_namespace, request.pod_name)
        if record is not None:
            return pr.GetPodResourcesResponse(pod_resources=self._pod_resources(record))
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )
        raise AssertionError("unreachable")  # abort raises

    async def GetAllocatableResources(self, request: pr.AllocatableResourcesRequest, context: Context) -> bytes:
        """The AllocatableResourcesResponse, serialized, as List's: each resource's part kept encoded while its
        devices and its healthy set are the same objects (the registry replaces them on every change)."""
        encoded: dict[str, tuple[Mapping[str, Device], Set[str], bytes]] = {}
        for state in self._registry.statuses():
            devices, healthy = state.all_devices, state.healthy
            kept = self._allocatable.get(state.name)
            if kept is None or kept[0] is not devices or kept[1] is not healthy:
                rows = [
                    DeviceInstance(state.name, device.id, numa)
                    for device in state.allocatable()
                    for numa in (device.numa_nodes or (None,))
                ]
                part = pr.AllocatableResourcesResponse(devices=container_devices(rows)).SerializeToString()
                kept = (devices, healthy, part)
            encoded[state.name] = kept
        self._allocatable = encoded
        return b"".join(part for _devices, _healthy, part in encoded.values())


class PodResourcesServer:
    """The gRPC server on `--pod-resources-socket`, kept serving while the agent runs: a removed socket is served
    again (`keep_serving`), as kubelet.sock is, so clients that dial by path (dcgm-exporter) find it again. The
    kubelet does not re-create its own; we do, on purpose (docs/agent.md)."""

    def __init__(self, servicer: PodResourcesServicer, socket_path: Path) -> None:
        self._servicer = servicer
        self.socket = socket_path
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.socket.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)  # a stale socket from a previous run
        await self._serve()
        log.info("pod resources API serving", extra={"socket": str(self.socket)})

    async def _serve(self) -> None:
        if self._server is not None:
            # First: grpc's stop unlinks the socket at its path, which would be the new one. Its clients are cut
            # (in-flight calls get the grace) and dial the path again.
            await self._server.stop(grace=STOP_GRACE_SECONDS)
            self._server = None
        server = grpc.aio.server()
        add_pod_resources(self._servicer, server)
        bind_unix_socket(server, self.socket)
        self._server = server  # ours from the bind on: stop() stops it, even if a cancellation cuts the start short
        await server.start()

    async def keep_serving(self) -> None:
        """Runs until cancelled (the supervised task `pod-resources-socket`): when the socket is removed, serve it
        again. A regular file or another socket put in its place is left alone, as for kubelet.sock."""
        await serve_again_when_removed(self.socket, self._serve, "pod resources", log)

    async def stop(self) -> None:
        if self._server is None:
            return
        await self._server.stop(grace=STOP_GRACE_SECONDS)
        self._server = None
