"""Pure helpers for allocation unit tests: a registry with devices, and a driver for `admit_pod` with fake RPCs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.admission_plan import AllocateCall, PodOutcome, PreferredCall, admit_pod
from deviceplane.core.allocator import Allocator
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pods import Container, Pod
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions

Dev = tuple[str, str] | tuple[str, str, tuple[int, ...]]


def registry_with(resources: dict[str, Iterable[Dev]], options: PluginOptions | None = None) -> DeviceRegistry:
    registry = DeviceRegistry(grace_period=300)
    for name, devices in resources.items():
        registry.plugin_connected(name, f"/tmp/{name.replace('/', '_')}.sock", options or PluginOptions(), now=0)
        registry.apply_snapshot(
            name,
            f"/tmp/{name.replace('/', '_')}.sock",
            [Device(d[0], d[1], d[2] if len(d) > 2 else ()) for d in devices],  # type: ignore[misc]
        )
    return registry


class CheckedAllocator(Allocator):
    """An allocator that keeps the registry and PodDevices it was given at hand, for the tests' assertions."""

    def __init__(self, registry: DeviceRegistry, pod_devices: PodDevices) -> None:
        super().__init__(registry, pod_devices)
        self.registry = registry
        self.pod_devices = pod_devices


def allocator_with(resources: dict[str, Iterable[Dev]], options: PluginOptions | None = None) -> CheckedAllocator:
    return CheckedAllocator(registry_with(resources, options), PodDevices())


def pod(uid: str, *containers: Container, init: Sequence[Container] = ()) -> Pod:
    return Pod(uid, "default", uid, "Pending", tuple(init), tuple(containers))


def ctr(name: str, limits: dict[str, int] | None = None, *, init: bool = False, restartable: bool = False) -> Container:
    return Container(name, tuple((limits or {}).items()), init, restartable)


R1 = "domain1.com/resource1"
R2 = "domain2.com/resource2"
R3 = "domain3.com/resource3"


def echo_response(call: AllocateCall) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(envs={f"{call.resource}/{call.container}": ",".join(call.devices)})


def drive(
    allocator: Allocator,
    the_pod: Pod,
    policy: str = "none",
    numa: Sequence[int] = (),
    allocate: Callable[[AllocateCall], pb.ContainerAllocateResponse] = echo_response,
    preferred: Callable[[PreferredCall], Iterable[str]] = lambda call: (),
    log: list[Any] | None = None,
) -> PodOutcome:
    """Run one admission with fake plugin answers; on any failure release the pod, as the agent does."""
    gen = admit_pod(allocator, the_pod, policy, numa)
    try:
        step = next(gen)
        while True:
            if log is not None:
                log.append(step)
            answer: object = allocate(step) if isinstance(step, AllocateCall) else set(preferred(step))
            step = gen.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        gen.close()
        allocator.release_pod(the_pod.uid)
        raise
