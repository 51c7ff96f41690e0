"""The JSON of `/api/v1/devices` and `/api/v1/pods`, read from the registry, the pod table and the allocations."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from deviceplane import __version__
from deviceplane.api.models import AgentView
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodTable
from deviceplane.core.pod_view import holders, pods_view
from deviceplane.core.registry import DeviceRegistry
from deviceplane.core.view import devices_status, rfc3339


class ApiViews:
    """Reads only: a GET changes nothing (grace-period expiry runs on its own timer, DeviceManager.expire_loop)."""

    def __init__(
        self,
        registry: DeviceRegistry,
        table: PodTable,
        pod_devices: PodDevices,
        node_name: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._table = table
        self._pod_devices = pod_devices
        self._node_name = node_name
        self._wall_clock = wall_clock

    def devices(self, request: web.Request | None = None) -> dict[str, Any]:
        query = request.query if request is not None else {}
        limit = None
        if "limit" in query:
            # ASCII digits only ("²".isdigit() is true, int() refuses it), and short enough for int() to take
            if not re.fullmatch(r"[0-9]{1,9}", query["limit"]):
                raise web.HTTPBadRequest(text=f"limit must be an integer from 0 to 999999999, got {query['limit']!r}")
            limit = int(query["limit"])
        wanted = query.get("resource")
        agent = AgentView(version=__version__, node=self._node_name, lastHeartbeatTime=rfc3339(self._wall_clock()))
        status = devices_status(
            self._registry,
            self._registry.capacity(),
            agent,
            holders=holders(self._pod_devices, self._table),
            device_limit=limit,
            resource_filter=(lambda name: name == wanted) if wanted else None,
        )
        return status.model_dump(mode="json")

    def pods(self, _request: web.Request | None = None) -> list[dict[str, Any]]:
        return pods_view(self._table, self._pod_devices, self._registry)
