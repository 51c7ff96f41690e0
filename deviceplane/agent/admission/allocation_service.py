"""Everything allocation adds to the agent, behind one start/stop: the admission controller, the pod sources that
feed it, and the PodResources API. Keeps the agent's wiring (app.py) to a few lines."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from deviceplane.agent.admission.admission import (
    ALLOCATE_TIMEOUT_SECONDS,
    STARTUP_PLUGIN_WAIT_SECONDS,
    AdmissionController,
)
from deviceplane.agent.admission.pod_source import PodSource, StaticPodDirectory, run_sources
from deviceplane.agent.plugins.manager import DeviceManager
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.serving.podresources import serve_pod_resources
from deviceplane.api.models import AllocatedTo
from deviceplane.core.checkpoint import CheckpointData

log = logging.getLogger("deviceplane.allocation")

SYS_NODES = Path("/sys/devices/system/node")


def detect_numa_nodes(sys_nodes: Path = SYS_NODES) -> list[int]:
    """NUMA node ids from sysfs (node0, node1, ...); [0] when sysfs says nothing."""
    try:
        found = sorted(int(m.group(1)) for e in os.listdir(sys_nodes) if (m := re.fullmatch(r"node(\d+)", e)))
    except OSError:
        found = []
    return found or [0]


class AllocationService:
    def __init__(
        self,
        manager: DeviceManager,
        plugin_dir: Path,
        node_name: str,
        pod_resources_socket: Path,
        pod_manifest_dir: Path | None = None,
        topology_policy: str = "none",
        numa_nodes: int | None = None,
        allocate_timeout: float = ALLOCATE_TIMEOUT_SECONDS,
        startup_wait: float = STARTUP_PLUGIN_WAIT_SECONDS,
    ) -> None:
        numa = list(range(numa_nodes)) if numa_nodes is not None else detect_numa_nodes()
        self.admission = AdmissionController(
            manager, plugin_dir, None, topology_policy, numa, allocate_timeout, startup_wait
        )
        self.pod_resources_socket = pod_resources_socket
        self.sources: list[PodSource] = []
        if pod_manifest_dir is not None:
            self.sources.append(StaticPodDirectory(pod_manifest_dir, node_name))
        for source in self.sources:
            self.admission.register_source(source.name)
        self._server: grpc.aio.Server | None = None
        self._sources_task: asyncio.Task[None] | None = None
        self._started = False

    def add_source(self, source: PodSource) -> None:
        """Another pod source (the API server's); call before start."""
        self.sources.append(source)
        self.admission.register_source(source.name)

    def attach_metrics(self, metrics: AgentMetrics) -> None:
        self.admission.metrics = metrics

    @property
    def allocated(self) -> Callable[[str], int]:
        return self.admission.allocated

    def restore(self, checkpoint: CheckpointData | None) -> None:
        """Blocking: call at start, after the device manager read the checkpoint."""
        self.admission.restore(checkpoint)

    async def start(self) -> None:
        self._started = True
        self.admission.start()
        self._server = await serve_pod_resources(self.admission, self.pod_resources_socket)
        self._sources_task = asyncio.create_task(
            run_sources(self.sources, self.admission, self._source_crashed), name="pod-sources"
        )

    def _source_crashed(self, name: str, err: BaseException) -> None:
        log.error("pod source crashed; its pods stay as they are", extra={"source": name, "error": repr(err)})

    async def stop(self) -> None:
        if self._sources_task is not None:
            self._sources_task.cancel()
            await asyncio.gather(self._sources_task, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
        if self._started:
            await self.admission.stop()

    # -- views --------------------------------------------------------------------------------------------------------

    def holders(self) -> dict[tuple[str, str], AllocatedTo]:
        return {
            key: AllocatedTo(namespace=ns, pod=pod, container=ctr)
            for key, (ns, pod, ctr) in self.admission.holders().items()
        }

    def pods_json(self) -> list[dict[str, Any]]:
        return self.admission.pods_json()
