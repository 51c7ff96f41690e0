"""The SDK's vocabulary: devices a plugin offers and what an allocation hands to a container.

Plain frozen dataclasses rather than the protobuf messages, so plugin code reads like Python and a device list can be
compared cheaply (the SDK only streams a snapshot when it actually changed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
        # Any truthy value counted as healthy: Device(id, healthy="Unhealthy") was offered to the kubelet as Healthy.
        if not isinstance(self.healthy, bool):
            raise ValueError(f"device {self.id!r}: healthy must be True or False, got {self.healthy!r}")
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
        """TypeError naming the field for a value of the wrong type: protobuf's own errors do not say which."""
        mounts = _items("mounts", self.mounts, Mount)
        devices = _items("devices", self.devices, DeviceSpec)
        for i, m in enumerate(mounts):
            _check(f"mounts[{i}]", m, container_path=str, host_path=str, read_only=bool)
        for i, d in enumerate(devices):
            _check(f"devices[{i}]", d, container_path=str, host_path=str, permissions=str)
        return pb.ContainerAllocateResponse(
            envs=_strings("envs", self.envs),
            mounts=[
                pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only) for m in mounts
            ],
            devices=[
                pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
                for d in devices
            ],
            annotations=_strings("annotations", self.annotations),
            cdi_devices=[pb.CDIDevice(name=name) for name in _items("cdi_devices", self.cdi_devices, str)],
        )


def _strings(field: str, mapping: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{field} is {type(mapping).__name__}, expected a mapping of str to str")
    for key, value in mapping.items():
        if not isinstance(key, str) or not isinstance(value, str):
            bad = key if not isinstance(key, str) else value
            raise TypeError(f"{field}[{key!r}]: {type(bad).__name__} {bad!r}, expected str")
    return dict(mapping)


def _items(field: str, items: Iterable[Any], kind: type) -> list[Any]:
    # A lone str is iterable too: cdi_devices="vendor.com/gpu=0" would become one CDI device per character.
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"{field} is {type(items).__name__}, expected a list of {kind.__name__}")
    listed = list(items)
    for i, item in enumerate(listed):
        if not isinstance(item, kind):
            raise TypeError(f"{field}[{i}] is {type(item).__name__}, expected {kind.__name__}")
    return listed


def _check(where: str, item: object, **fields: type) -> None:
    for name, kind in fields.items():
        value = getattr(item, name)
        if not isinstance(value, kind):
            raise TypeError(f"{where}.{name} is {type(value).__name__} {value!r}, expected {kind.__name__}")
