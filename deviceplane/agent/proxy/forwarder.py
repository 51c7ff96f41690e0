"""The DevicePlugin service a proxy endpoint serves to the kubelet, for one resource.

Unary RPCs go to the resource's primary plugin connection as wire bytes: same request, and the same response or the
same gRPC status code, details and trailing metadata. The kubelet's deadline, if it set one, travels with the call
(it has none for Allocate and GetPreferredAllocation, 30 s for PreStartContainer). ListAndWatch streams the
resource's feed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from deviceplane.agent.in_flight import InFlight
from deviceplane.agent.plugins.plugin_client import PluginClient
from deviceplane.agent.proxy.endpoint import device_plugin_options
from deviceplane.agent.proxy.feed import SnapshotFeed
from deviceplane.api.typed_grpc import Context
from deviceplane.core.registry import PluginOptions
from deviceplane.lean_grpc import RpcError

log = logging.getLogger("deviceplane.agent.proxy")

SERVICE = "v1beta1.DevicePlugin"
# Between the deadline the plugin is told, ours, and the kubelet's (plugin_deadline); PreStartContainer's 30 s reach the
# plugin as 29.5 s.
DEADLINE_MARGIN_SECONDS = 0.25


@dataclass(frozen=True, slots=True)
class ForwardedCall:
    """One forwarded RPC, for metrics and the ownership join."""

    resource: str
    method: str
    request: bytes
    seconds: float
    code: grpc.StatusCode
    reached_plugin: bool = True  # False: no plugin was connected to forward to


def plugin_deadline(remaining: float | None) -> tuple[float | None, float | None]:
    """The kubelet's deadline (seconds left, None: none) as (our timeout, the one the plugin is told).

    Directly, a plugin that does not answer in time answers the kubelet's deadline itself, in its own words (a grpc
    C-core or grpc.aio plugin: DEADLINE_EXCEEDED "Deadline Exceeded"), and the kubelet reads that. Passed on as is,
    three timers race for it: the plugin's, ours, and the endpoint server's own copy of the kubelet's deadline (which
    answers "Deadline Exceeded" itself). So the plugin is told a deadline shorter by two margins, and ours comes one
    margin after it: the plugin's answer is what the kubelet gets; ours ("context deadline exceeded", what the
    kubelet's own timer says directly) only when the plugin does not answer its deadline (a grpc-go plugin whose
    handler ignores it)."""
    if remaining is None:
        return None, None
    margin = min(DEADLINE_MARGIN_SECONDS, remaining / 4)
    return remaining - margin, remaining - 2 * margin


class ResourceForwarder:
    def __init__(
        self,
        resource: str,
        feed: SnapshotFeed,
        plugin: Callable[[str], PluginClient | None],
        options: Callable[[str], PluginOptions | None],
        on_call: Callable[[ForwardedCall], None],
        in_flight: InFlight,
        on_streams_dropped: Callable[[str], None] = lambda _resource: None,
    ) -> None:
        self._resource = resource
        self._feed = feed
        self._plugin = plugin
        self._options = options
        self._on_call = on_call
        self._in_flight = in_flight
        # Told when the kubelet ended the last of its streams itself (the feed did not end it).
        self._on_streams_dropped = on_streams_dropped
        self._streams = 0

    def handler(self) -> grpc.GenericRpcHandler[bytes, bytes]:
        # No (de)serializers: handlers get and return wire bytes.
        unary = {
            name: grpc.unary_unary_rpc_method_handler(self._unary(name))
            for name in ("GetDevicePluginOptions", "Allocate", "GetPreferredAllocation", "PreStartContainer")
        }
        stream = {"ListAndWatch": grpc.unary_stream_rpc_method_handler(self._list_and_watch)}
        return grpc.method_handlers_generic_handler(SERVICE, {**unary, **stream})

    def _unary(self, method: str) -> Callable[[bytes, Context], Awaitable[bytes]]:
        async def forward(request: bytes, context: Context) -> bytes:
            with self._in_flight:
                return await self._forward(method, request, context)

        return forward

    async def _forward(self, method: str, request: bytes, context: Context) -> bytes:
        client = self._plugin(self._resource)
        if client is None:
            if method == "GetDevicePluginOptions":
                # Between a plugin's restart and its re-registration the kubelet may ask (it re-registers us): the
                # options the plugin last gave are the answer it would give.
                return self._last_options()
            self._record(method, request, 0.0, grpc.StatusCode.UNAVAILABLE, False)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no device plugin connected for {self._resource}")
        assert client is not None
        start = time.perf_counter()
        timeout = context.time_remaining()
        try:
            response = await client.call_raw(method, request, *plugin_deadline(timeout))
        except RpcError as err:
            self._record(method, request, time.perf_counter() - start, err.code(), True)
            # The plugin's trailers too: a rich status (grpc-status-details-bin) reaches the kubelet as sent.
            context.set_trailing_metadata(err.trailing_metadata())
            await context.abort(err.code(), err.details() or "")
        # Recorded (metrics, the ownership join) on the loop's next turn: grpc sends the response as soon as this
        # returns, so the bookkeeping is off the kubelet's critical path.
        asyncio.get_running_loop().call_soon(
            self._record, method, request, time.perf_counter() - start, grpc.StatusCode.OK, True
        )
        return response

    def _last_options(self) -> bytes:
        options = self._options(self._resource) or PluginOptions()
        return device_plugin_options(options).SerializeToString()

    def _record(self, method: str, request: bytes, seconds: float, code: grpc.StatusCode, reached: bool) -> None:
        self._on_call(ForwardedCall(self._resource, method, request, seconds, code, reached))

    async def _list_and_watch(self, _request: bytes, _context: Context) -> AsyncIterator[bytes]:
        log.info("kubelet follows ListAndWatch", extra={"resource": self._resource})
        self._streams += 1
        ended_by_feed = False
        try:
            async for wire in self._feed.follow():
                yield wire
            ended_by_feed = True
        finally:
            self._streams -= 1
            if not ended_by_feed and self._streams == 0:
                self._on_streams_dropped(self._resource)
