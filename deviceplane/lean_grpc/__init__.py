"""A lean gRPC client for unix sockets: the agent's side of every device-plugin connection.

Why not grpc.aio's client: each of its calls crosses threads (gRPC's poller thread completes the call, then wakes the
event loop), and its per-call machinery cost ~150-200 µs of event-loop CPU per Allocate on the 2-CPU benchmark
machine, the largest single item of an admission (benchmarks/README.md). Here a call is framed and parsed on the event
loop itself: one write, one read, no other thread. The servers stay grpc's (the agent's Registration and PodResources
services, plugins built with the SDK); only the client side of plugin connections is this.

Only what a device-plugin client needs: unary and server-streaming calls, identity encoding (compression is never
offered), HTTP/2 over a unix socket without TLS.
"""

from deviceplane.lean_grpc.channel import Channel, ResponseStream
from deviceplane.lean_grpc.status import RpcError

__all__ = ["Channel", "ResponseStream", "RpcError"]
