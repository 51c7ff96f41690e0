"""The sim's devices: where they sit (NUMA nodes), and how large their longest ListAndWatch message is.

The longest message lists every device unhealthy. The sim refuses a count whose longest message would not fit, so
that no health change can ever make a list the kubelet cannot receive. Its size is computed without building that
list: building it (the devices and the message) took as long as building the list the sim serves, 0.37 s at 100,000
devices, at every start.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.plugin.models import Device


def numa_layout(count: int, numa: int) -> dict[str, tuple[int, ...]]:
    """Device id -> NUMA nodes, in contiguous blocks over `numa` nodes (empty tuple when numa == 0)."""
    return {f"sim-{i}": ((i * numa // count,) if numa else ()) for i in range(count)}


def all_unhealthy_message_bytes(numa_of: Mapping[str, tuple[int, ...]]) -> int:
    """The size of the ListAndWatch message listing these devices, every one unhealthy.

    The devices are a repeated field, encoded one after another, so the message is the sum of one-device messages.
    A device's encoding has the size of any other's whose id has as many bytes (sim ids are ASCII) and whose NUMA
    node ids have the same bit lengths (protobuf writes integers as varints, sized by their bit length, and leaves
    out a 0). So one device of each such shape is encoded, by the SDK's own Device.to_proto.
    """
    shapes = Counter((len(device_id), tuple(map(int.bit_length, nodes))) for device_id, nodes in numa_of.items())
    return sum(
        devices * _one_device_message_bytes(id_bytes, node_bit_lengths)
        for (id_bytes, node_bit_lengths), devices in shapes.items()
    )


def _one_device_message_bytes(id_bytes: int, node_bit_lengths: tuple[int, ...]) -> int:
    nodes = [1 << (bits - 1) if bits else 0 for bits in node_bit_lengths]  # the least node id of that bit length
    device = Device("x" * id_bytes, healthy=False, numa_nodes=nodes)
    return int(pb.ListAndWatchResponse(devices=[device.to_proto()]).ByteSize())
