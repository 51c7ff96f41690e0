"""The agent's parts that exist only with an API server, built together by the composition root (agent/app.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from deviceplane.agent.kube.client import KubeApi
from deviceplane.agent.kube.events import AdmissionEvents
from deviceplane.agent.kube.node_devices import NodeDevicesPublisher
from deviceplane.agent.kube.node_status import NodeStatusPublisher
from deviceplane.agent.kube.pod_watch import ApiPodSource
from deviceplane.agent.plugins.contracts import DeviceListener


@dataclass(frozen=True)
class ClusterMode:
    api: KubeApi
    pods: ApiPodSource  # a pod source: run by the agent's pod-sources task
    events: AdmissionEvents  # an admission-failure listener
    node_status: NodeStatusPublisher  # a device listener
    node_devices: NodeDevicesPublisher  # a device listener

    def device_listeners(self) -> list[DeviceListener]:
        return [self.node_status.changed, self.node_devices.changed]

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """The long-lived loops, (task name, coroutine function)."""
        return [
            ("node-status", self.node_status.run),
            ("node-devices", self.node_devices.run),
            ("pod-events", self.events.run),
        ]

    def readiness(self) -> str | None:
        """Ready once the API pods are listed and the first Node status and NodeDevices writes succeeded."""
        for part in (self.pods, self.node_status, self.node_devices):
            problem = part.ready()
            if problem is not None:
                return problem
        return None
