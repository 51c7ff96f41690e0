"""A device plugin process for agent tests, steered line by line on stdin (JSON), answering on stdout.

It is a real plugin (real gRPC server on a real unix socket, separate process) whose behaviour tests can bend:
hang in GetDevicePluginOptions, refuse ListAndWatch, end its stream, push arbitrary snapshots. It deliberately does
not use the SDK, so the agent is tested against an independent peer.

Commands (one JSON object per line on stdin; every command is acknowledged with {"ok": ...} on stdout):
  {"cmd": "register", "resource": R, "endpoint": E?, "version": V?}  -> {"ok": true} or {"ok": false, "error": msg}
  {"cmd": "devices", "devices": [[id, health, [numa...]], ...]}       push a ListAndWatch snapshot
  {"cmd": "end-streams"}                                               end every ListAndWatch stream
  {"cmd": "notifications"}                                             -> plugin-watcher NotifyRegistrationStatus calls
  {"cmd": "calls"}                                 -> {"ok": true, "calls": {...}, "order": [options/stream calls]}
  {"cmd": "responses", "allocate": HEX?, "preferred": HEX?}  answer Allocate / GetPreferredAllocation with these
                                                       serialized messages from now on (unknown fields kept);
                                                       null: the default answers again
  {"cmd": "exit"}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter

import grpc
from google.protobuf import json_format

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplane.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc


def to_proto(devices: list[list[object]]) -> list[pb.Device]:
    out = []
    for entry in devices:
        device_id, health, numa = entry[0], entry[1], entry[2] if len(entry) > 2 else []
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=int(n)) for n in numa]) if numa else None  # type: ignore[union-attr]
        out.append(pb.Device(ID=str(device_id), health=str(health), topology=topology))
    return out


class Plugin(pb_grpc.DevicePluginServicer):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.devices = to_proto(json.loads(args.devices))
        self.queues: list[asyncio.Queue[list[pb.Device] | None]] = []
        self.calls: Counter[str] = Counter()
        self.order: list[str] = []  # GetDevicePluginOptions and ListAndWatch calls, as they arrived
        self.allocate_bytes: bytes | None = None  # set by the "responses" command
        self.preferred_bytes: bytes | None = None

    async def GetDevicePluginOptions(self, request, context):
        self.calls["GetDevicePluginOptions"] += 1
        self.order.append("GetDevicePluginOptions")
        if self.args.hang_options:
            await asyncio.sleep(3600)
        if self.args.refuse_options:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no options here")
        return pb.DevicePluginOptions(
            pre_start_required=self.args.pre_start, get_preferred_allocation_available=self.args.preferred
        )

    async def ListAndWatch(self, request, context):
        self.calls["ListAndWatch"] += 1
        self.order.append("ListAndWatch")
        if self.args.refuse_stream:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no ListAndWatch for you")
        queue: asyncio.Queue[list[pb.Device] | None] = asyncio.Queue()
        self.queues.append(queue)
        try:
            yield pb.ListAndWatchResponse(devices=self.devices)
            while (devices := await queue.get()) is not None:
                yield pb.ListAndWatchResponse(devices=devices)
        finally:
            self.queues.remove(queue)

    async def Allocate(self, request, context):
        self.calls["Allocate"] += 1
        if self.allocate_bytes is not None:
            return pb.AllocateResponse.FromString(self.allocate_bytes)
        if self.args.alloc_response:
            return json_format.Parse(self.args.alloc_response, pb.AllocateResponse())
        responses = [
            pb.ContainerAllocateResponse(envs={"TEST_DEVICES": ",".join(r.devices_ids)})
            for r in request.container_requests
        ]
        return pb.AllocateResponse(container_responses=responses)

    async def GetPreferredAllocation(self, request, context):
        self.calls["GetPreferredAllocation"] += 1
        if self.preferred_bytes is not None:
            return pb.PreferredAllocationResponse.FromString(self.preferred_bytes)
        if self.args.preferred_response:
            return json_format.Parse(self.args.preferred_response, pb.PreferredAllocationResponse())
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(deviceIDs=list(r.available_deviceIDs)[: r.allocation_size])
                for r in request.container_requests
            ]
        )

    async def PreStartContainer(self, request, context):
        self.calls["PreStartContainer"] += 1
        return pb.PreStartContainerResponse()

    def push(self, devices: list[pb.Device] | None) -> None:
        if devices is not None:
            self.devices = devices
        for queue in self.queues:
            queue.put_nowait(devices)


class WatcherRegistration(reg_grpc.RegistrationServicer):
    """pluginregistration.Registration on the same socket, as the upstream stub serves it in probe mode."""

    def __init__(self, info: dict[str, object]) -> None:
        self.info = info
        self.notifications: list[dict[str, object]] = []
        self.info_calls = 0

    async def GetInfo(self, request, context):
        self.info_calls += 1
        if self.info_calls == 1 and "first_info_delay" in self.info:  # a plugin slow to answer, once
            await asyncio.sleep(float(self.info["first_info_delay"]))  # type: ignore[arg-type]
        return reg_pb.PluginInfo(
            type=str(self.info.get("type", "DevicePlugin")),
            name=str(self.info["name"]),
            endpoint=str(self.info.get("endpoint", "")),
            supported_versions=list(self.info.get("versions", ["v1beta1"])),  # type: ignore[call-overload]
        )

    async def NotifyRegistrationStatus(self, request, context):
        self.notifications.append({"registered": request.plugin_registered, "error": request.error})
        return reg_pb.RegistrationStatusResponse()


async def register(plugin_dir: str, resource: str, endpoint: str, version: str) -> dict[str, object]:
    async with grpc.aio.insecure_channel(f"unix://{os.path.join(plugin_dir, 'kubelet.sock')}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        try:
            await stub.Register(
                pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource), timeout=30
            )
        except grpc.aio.AioRpcError as err:
            return {"ok": False, "error": err.details(), "code": err.code().name}
    return {"ok": True}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin-dir", required=True)
    parser.add_argument("--socket", required=True, help="socket file name inside --plugin-dir")
    parser.add_argument("--devices", default="[]")
    parser.add_argument("--pre-start", action="store_true")
    parser.add_argument("--preferred", action="store_true")
    parser.add_argument("--hang-options", action="store_true")
    parser.add_argument("--refuse-options", action="store_true", help="fail GetDevicePluginOptions (Unimplemented)")
    parser.add_argument("--refuse-stream", action="store_true", help="fail every ListAndWatch at once")
    parser.add_argument("--alloc-response", default=None, help="fixed AllocateResponse (proto JSON)")
    parser.add_argument("--preferred-response", default=None, help="fixed PreferredAllocationResponse (proto JSON)")
    parser.add_argument("--watcher-info", default=None, help="JSON PluginInfo: also serve pluginregistration")
    args = parser.parse_args()

    plugin = Plugin(args)
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    watcher = WatcherRegistration(json.loads(args.watcher_info)) if args.watcher_info else None
    if watcher is not None:
        reg_grpc.add_RegistrationServicer_to_server(watcher, server)
    socket_path = os.path.join(args.plugin_dir, args.socket)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    print(json.dumps({"ok": True, "socket": socket_path}), flush=True)

    reader = asyncio.StreamReader(limit=64 << 20)  # a command can carry large serialized answers
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        cmd = command["cmd"]
        if cmd == "register":
            reply = await register(
                args.plugin_dir,
                command["resource"],
                command.get("endpoint", args.socket),
                command.get("version", "v1beta1"),
            )
        elif cmd == "devices":
            plugin.push(to_proto(command["devices"]))
            reply = {"ok": True}
        elif cmd == "end-streams":
            # The agent opens ListAndWatch just after Register returns: give it a moment to arrive.
            for _ in range(500):
                if plugin.queues:
                    break
                await asyncio.sleep(0.01)
            plugin.push(None)
            reply = {"ok": True}
        elif cmd == "notifications":
            reply = {
                "ok": True,
                "notifications": watcher.notifications if watcher else [],
                "info_calls": watcher.info_calls if watcher else 0,
            }
        elif cmd == "calls":
            reply = {"ok": True, "calls": dict(plugin.calls), "order": plugin.order}
        elif cmd == "responses":
            allocate, preferred = command.get("allocate"), command.get("preferred")
            plugin.allocate_bytes = None if allocate is None else bytes.fromhex(allocate)
            plugin.preferred_bytes = None if preferred is None else bytes.fromhex(preferred)
            reply = {"ok": True}
        elif cmd == "exit":
            break
        else:
            reply = {"ok": False, "error": f"unknown command {cmd}"}
        print(json.dumps(reply), flush=True)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
