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
    node_devices: NodeDevicesPublisher  # a device listener
    # None in proxy mode, where the kubelet admits pods and owns the Node's capacity: only NodeDevices is published.
    pods: ApiPodSource | None = None  # a pod source: run by the agent's pod-sources task
    events: AdmissionEvents | None = None  # an admission-failure listener
    node_status: NodeStatusPublisher | None = None  # a device listener

    def device_listeners(self) -> list[DeviceListener]:
        listeners: list[DeviceListener] = [self.node_devices.changed]
        if self.node_status is not None:
            listeners.insert(0, self.node_status.changed)
        return listeners

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """The long-lived loops, (task name, coroutine function)."""
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if self.node_status is not None:
            loops.append(("node-status", self.node_status.run))
        loops.append(("node-devices", self.node_devices.run))
        if self.events is not None:
            loops.append(("pod-events", self.events.run))
        return loops

    def readiness(self) -> str | None:
        """Ready once the API pods are listed and the first Node status and NodeDevices writes succeeded; else every
        part's reason (the publishers often fail for different causes: a 403 on one, a missing Node on the other)."""
        parts = (self.pods, self.node_status, self.node_devices)
        problems = [problem for part in parts if part is not None and (problem := part.ready()) is not None]
        return "; ".join(problems) or None
