"""The SDK's vocabulary: devices a plugin offers and what an allocation hands to a container.

Plain frozen dataclasses rather than the protobuf messages, so plugin code reads like Python and a device list can be
compared cheaply (the SDK only streams a snapshot when it actually changed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.constants import HEALTHY, UNHEALTHY


@dataclass(frozen=True)
class Device:
    """One schedulable unit of the resource. `numa_nodes` empty means "no topology" (the kubelet ignores NUMA)."""

    id: str
    healthy: bool = True
    numa_nodes: Sequence[int] = ()  # stored as a tuple

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"device id must be a non-empty string, got {self.id!r}")
        # Accept any iterable of ints (lists read naturally in plugin code) but store a tuple: frozen means hashable.
        nodes = tuple(self.numa_nodes)
        for node in nodes:
            if not isinstance(node, int) or isinstance(node, bool) or node < 0:
                raise ValueError(f"device {self.id!r}: NUMA node ids must be non-negative ints, got {node!r}")
        object.__setattr__(self, "numa_nodes", nodes)

    def to_proto(self) -> pb.Device:
        device = pb.Device(ID=self.id, health=HEALTHY if self.healthy else UNHEALTHY)
        if self.numa_nodes:
            device.topology.nodes.extend(pb.NUMANode(ID=n) for n in self.numa_nodes)
        return device


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into the container."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class DeviceSpec:
    """A device node made available in the container; permissions are cgroup letters from "rwm"."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass
class Allocation:
    """What one container gets for its devices: the parts of a ContainerAllocateResponse."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: Iterable[Mount] = ()
    devices: Iterable[DeviceSpec] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: Iterable[str] = ()  # fully-qualified CDI names, e.g. "vendor.com/gpu=gpu0"

    def to_proto(self) -> pb.ContainerAllocateResponse:
        return pb.ContainerAllocateResponse(
            envs=dict(self.envs),
            mounts=[
                pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                for m in self.mounts
            ],
            devices=[
                pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
                for d in self.devices
            ],
            annotations=dict(self.annotations),
            cdi_devices=[pb.CDIDevice(name=name) for name in self.cdi_devices],
        )
