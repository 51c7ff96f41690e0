"""The JSON of `/api/v1/devices` and `/api/v1/pods`, read from the registry, the pod table and the allocations."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from deviceplane import __version__
from deviceplane.agent.serving.lean_http import HttpError
from deviceplane.api.models import AgentView, DevicesStatus
from deviceplane.core.conditions import ConditionTimes, PodResourcesLink
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodTable
from deviceplane.core.pod_view import AllocationHolders, pods_view
from deviceplane.core.registry import DeviceRegistry
from deviceplane.core.times import rfc3339
from deviceplane.core.view import Holders, KubeletRegistered, devices_status


class ApiViews:
    """Reads only: a GET changes nothing (grace-period expiry runs on its own timer, DeviceManager.expire_loop)."""

    def __init__(
        self,
        registry: DeviceRegistry,
        table: PodTable,
        pod_devices: PodDevices,
        node_name: str,
        wall_clock: Callable[[], float] = time.time,
        *,
        owners: Holders | None = None,
        pod_list: Callable[[], list[dict[str, Any]]] | None = None,
        kubelet_registered: KubeletRegistered | None = None,
        pod_resources: Callable[[], PodResourcesLink] | None = None,
    ) -> None:
        # owners / pod_list: where they come from when the agent does not allocate (proxy mode: the kubelet's
        # PodResources); by default the agent's own allocations and pod table.
        self._holders = owners or AllocationHolders(pod_devices, table)
        self._pod_list = pod_list
        self._kubelet_registered = kubelet_registered  # proxy mode: each resource's endpoint with the kubelet
        self._pod_resources = pod_resources  # proxy mode: whether the owners are current (the OwnersCurrent condition)
        self._registry = registry
        self._table = table
        self._pod_devices = pod_devices
        self._node_name = node_name
        self._wall_clock = wall_clock
        self._conditions = ConditionTimes()  # the view's: transition times kept while the agent runs

    def devices(self, query: Mapping[str, str] | None = None) -> bytes:
        """`/api/v1/devices`' JSON body: `limit` and `resource` from the query (others ignored); HttpError 400 for a bad
        limit."""
        query = query or {}
        limit = None
        if "limit" in query:
            # ASCII digits only ("²".isdigit() is true, int() refuses it), and short enough for int() to take
            if not re.fullmatch(r"[0-9]{1,9}", query["limit"]):
                raise HttpError(400, f"limit must be an integer from 0 to 999999999, got {query['limit']!r}")
            limit = int(query["limit"])
        # pydantic's own serializer writes the JSON: every device of 10 x 10,000 in ~25 ms in process, against ~270 ms
        # through model_dump and json.dumps; the whole GET held the agent's loop 297 -> 211 ms (benchmarks/reads.py)
        return self.status(limit, query.get("resource")).model_dump_json().encode()

    def status(self, device_limit: int | None = None, resource: str | None = None) -> DevicesStatus:
        """The devices model (also NodeDevices.status): at most `device_limit` devices per resource, and the node's
        conditions (over every resource, also when `resource` selects one), their transition times kept from one
        call to the next."""
        agent = AgentView(version=__version__, node=self._node_name, lastHeartbeatTime=rfc3339(self._wall_clock()))
        return devices_status(
            self._registry,
            agent,
            holders=self._holders,
            device_limit=device_limit,
            resource_filter=(lambda name: name == resource) if resource else None,
            conditions=self._conditions,
            kubelet_registered=self._kubelet_registered,
            pod_resources=self._pod_resources() if self._pod_resources is not None else None,
        )

    def pods(self) -> list[dict[str, Any]]:
        if self._pod_list is not None:
            return self._pod_list()
        return pods_view(self._table, self._pod_devices, self._registry)
