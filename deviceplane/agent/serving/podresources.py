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
from pathlib import Path

import grpc

from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplane.api.typed_grpc import Context, add_pod_resources, bind_unix_socket
from deviceplane.core.pod_devices import DeviceInstance, PodDevices
from deviceplane.core.pod_table import PodRecord, PodTable
from deviceplane.core.registry import DeviceRegistry

log = logging.getLogger("deviceplane.podresources")


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

    def _pod_resources(self, record: PodRecord) -> pr.PodResources:
        pod = record.pod
        containers = []
        for container in (*[c for c in pod.init_containers if c.restartable], *pod.containers):
            rows = self._pod_devices.device_instances(pod.uid, container.name)
            containers.append(pr.ContainerResources(name=container.name, devices=container_devices(rows)))
        return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    async def List(self, request: pr.ListPodResourcesRequest, context: Context) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=[self._pod_resources(r) for r in self._table.active()])

    async def Get(self, request: pr.GetPodResourcesRequest, context: Context) -> pr.GetPodResourcesResponse:
        record = self._table.find(request.pod_namespace, request.pod_name)
        if record is not None:
            return pr.GetPodResourcesResponse(pod_resources=self._pod_resources(record))
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )
        raise AssertionError("unreachable")  # abort raises

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: Context
    ) -> pr.AllocatableResourcesResponse:
        rows = [
            DeviceInstance(resource, device.id, numa)
            for resource, devices in sorted(self._registry.allocatable_devices().items())
            for device in devices
            for numa in (device.numa_nodes or (None,))
        ]
        return pr.AllocatableResourcesResponse(devices=container_devices(rows))


async def serve_pod_resources(servicer: PodResourcesServicer, socket_path: Path) -> grpc.aio.Server:
    socket_path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)  # a stale socket from a previous run
    server = grpc.aio.server()
    add_pod_resources(servicer, server)
    bind_unix_socket(server, socket_path)
    await server.start()
    log.info("pod resources API serving", extra={"socket": str(socket_path)})
    return server
