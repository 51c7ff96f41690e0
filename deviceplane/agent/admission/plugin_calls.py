"""The plugin RPCs of an admission (Allocate, GetPreferredAllocation, PreStartContainer): each finds the resource's
plugin, runs with its deadline, counts its outcome, and turns a gRPC failure into an `AllocationError` carrying
upstream's message."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import grpc

from deviceplane.agent.plugins.contracts import PluginLookup, PluginRpc
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.admission_plan import AllocateCall, PreferredCall, PreStartCall
from deviceplane.core.allocator import AllocationError, AllocationResult
from deviceplane.core.constants import ALLOCATE_TIMEOUT_SECONDS, PRE_START_TIMEOUT_SECONDS
from deviceplane.lean_grpc import RpcError

NO_ENDPOINT = "endpoint not found in cache for a registered resource: {}"


class PluginCalls:
    """Counts each successful Allocate; failures are raised, and counted once per admission by the admitter."""

    def __init__(
        self, plugins: PluginLookup, metrics: AgentMetrics, allocate_timeout: float = ALLOCATE_TIMEOUT_SECONDS
    ) -> None:
        self._plugins = plugins
        self._metrics = metrics
        self._allocate_timeout = allocate_timeout

    async def allocate(self, call: AllocateCall) -> pb.ContainerAllocateResponse:
        client = self._client(call.resource, "unknown Device Plugin {}")
        started = time.perf_counter()
        try:
            with _failures(call.resource, "{}", AllocationResult.RPC_ERROR, timeout=AllocationResult.TIMEOUT):
                response = await client.allocate(call.devices, self._allocate_timeout)
        finally:
            self._metrics.observe_allocate(call.resource, time.perf_counter() - started)
        if not response.container_responses:
            raise AllocationError(
                f"no containers return in allocation response {response}",
                AllocationResult.EMPTY_RESPONSE,
                call.resource,
            )
        self._metrics.count_allocation(call.resource, AllocationResult.SUCCESS)
        return response.container_responses[0]

    async def preferred(self, call: PreferredCall) -> set[str]:
        client = self._client(call.resource, NO_ENDPOINT)
        request = call.request
        message = "device plugin GetPreferredAllocation rpc failed with err: {}"
        with _failures(call.resource, message, AllocationResult.PREFERRED_RPC_ERROR):
            response = await client.get_preferred_allocation(
                request.available, request.must_include, request.size, self._allocate_timeout
            )
        if not response.container_responses:
            return set()
        return set(response.container_responses[0].deviceIDs)

    async def pre_start(self, call: PreStartCall) -> None:
        client = self._client(call.resource, NO_ENDPOINT)
        message = "device plugin PreStartContainer rpc failed with err: {}"
        with _failures(call.resource, message, AllocationResult.PRE_START_ERROR):
            await client.pre_start_container(call.devices, PRE_START_TIMEOUT_SECONDS)

    def _client(self, resource: str, missing: str) -> PluginRpc:
        client = self._plugins.client(resource)
        if client is None:
            raise AllocationError(missing.format(resource), AllocationResult.NO_ENDPOINT, resource)
        return client


@contextlib.contextmanager
def _failures(
    resource: str, message: str, kind: AllocationResult, timeout: AllocationResult | None = None
) -> Iterator[None]:
    """A failed RPC raised as AllocationError(`message` with Go's rendering of the error)."""
    try:
        yield
    except RpcError as err:
        if timeout is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            kind = timeout
        raise AllocationError(message.format(err.go_text()), kind, resource) from err
