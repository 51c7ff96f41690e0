"""The background checkpoint's cost: encoding `kubelet_internal_checkpoint` (Go JSON of every entry and the go-spew
text its checksum hashes, pure Python, which the agent runs on its event loop in slices) and writing it, for N
entries shaped like the sim plugin's (one device, a small Allocate response of 25 bytes) and two registered
resources. `--response gpu` gives every entry the response a GPU plugin returns instead (one env, five device nodes,
a mount, a CDI annotation: 428 bytes), whose byte-by-byte checksum text is most of an entry's cost.

Figures, medians over --rounds, in ms: `encode()` from scratch (a new `CheckpointEncoder`: every entry new); the
encoder again with 1% of the entries replaced (as between two paced checkpoints); that same encoding in slices of the
agent's length (`encode_in_slices`), its longest slice and how many; the longest slice with 10 resources x 10,000
registered devices when one resource's list is new; the encoding with every entry's texts kept and
`CheckpointStore.write_encoded` (temp file, fsync, rename, directory fsync).

    python benchmarks/checkpoint_encode.py [--entries 5000] [--rounds 5] [--response sim|gpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deviceplane.agent.state.checkpoint_store import CheckpointStore  # noqa: E402
from deviceplane.agent.state.checkpoint_writer import ENCODE_SLICE_SECONDS  # noqa: E402
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb  # noqa: E402
from deviceplane.core.checkpoint import CheckpointData, CheckpointEncoder, PodDevicesEntry, encode  # noqa: E402

GPU_UUID = "GPU-6d1f3e2a-8c4b-4f0e-9a7d-2b5c1e8f4a3d"
RESPONSES = {
    "sim": pb.ContainerAllocateResponse(envs={"SIM_DEVICES": "filler-0"}),
    "gpu": pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": GPU_UUID},
        devices=[pb.DeviceSpec(container_path=node, host_path=node, permissions="rw")
                 for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                              "/dev/nvidia-modeset")],
        mounts=[pb.Mount(container_path="/usr/local/nvidia", host_path="/home/kubernetes/bin/nvidia", read_only=True)],
        annotations={"cdi.k8s.io/nvidia-device-plugin_0": f"nvidia.com/gpu={GPU_UUID}"},
    ),
}  # fmt: skip


def entry(i: int, response: bytes) -> PodDevicesEntry:
    return PodDevicesEntry(f"{i:08d}-0000-4000-8000-000000000000", "main", "example.com/filler", {0: [f"filler-{i}"]},
                           response)  # fmt: skip


def ms(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def slice_spans(encoder: CheckpointEncoder, data: CheckpointData) -> list[float]:
    """ms of each slice of `encode_in_slices(data)` with the agent's slice length."""
    spans = []
    slices = encoder.encode_in_slices(data, time.perf_counter, ENCODE_SLICE_SECONDS)
    while True:
        started = time.perf_counter()
        try:
            next(slices)
        except StopIteration:
            spans.append((time.perf_counter() - started) * 1000)
            return spans
        spans.append((time.perf_counter() - started) * 1000)


def with_one_list_new(data: CheckpointData, round_: int) -> CheckpointData:
    """`data` with the list of resource r3 replaced by a new one (as after one health change)."""
    changed = [f"dev-3-{i}" for i in range(10_000) if i != round_]
    return CheckpointData(data.PodDeviceEntries, {**(data.RegisteredDevices or {}), "example.com/r3": changed})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=5000, help="pod device entries [5000]")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the median is printed [5]")
    parser.add_argument("--response", choices=sorted(RESPONSES), default="sim", help="each entry's response [sim]")
    args = parser.parse_args()
    response = RESPONSES[args.response].SerializeToString(deterministic=True)
    entries = [entry(i, response) for i in range(args.entries)]
    registered = {
        "example.com/sim": [f"sim-{i}" for i in range(1024)],
        "example.com/filler": [f"filler-{i}" for i in range(args.entries + 16)],
    }
    data = CheckpointData(entries, registered)
    changed = max(1, args.entries // 100)
    later = CheckpointData([entry(args.entries + i, response) for i in range(changed)] + entries[changed:], registered)
    first, again, write, longest, slices, wide_longest = [], [], [], [], [], []
    # 10 resources x 10,000 registered devices, 100 entries
    wide = CheckpointData(
        entries[:100], {f"example.com/r{r}": [f"dev-{r}-{i}" for i in range(10_000)] for r in range(10)}
    )
    wide_encoder = CheckpointEncoder()
    wide_encoder.encode(wide)
    with tempfile.TemporaryDirectory(prefix="dp-ckpt-") as directory:
        store = CheckpointStore(directory)
        known = CheckpointEncoder()
        known.encode(data)  # it now knows every entry
        for round_ in range(args.rounds):
            encoder = CheckpointEncoder()
            first.append(ms(lambda: encoder.encode(data)))  # noqa: B023 - called at once
            again.append(ms(lambda: encoder.encode(later)))  # noqa: B023
            write.append(ms(lambda: store.write_encoded(known.encode(data))))
            encoder.encode(data)
            spans = slice_spans(encoder, later)
            longest.append(max(spans))
            slices.append(len(spans))
            wide_longest.append(max(slice_spans(wide_encoder, with_one_list_new(wide, round_))))
    size = len(encode(data))
    print(
        f"checkpoint of {args.entries:,} entries with {args.response} responses of {len(response)} bytes "
        f"({size / 1e6:.2f} MB), median of {args.rounds} rounds, ms:"
    )
    rows = [
        ("encode() from scratch (CheckpointEncoder, every entry new)", first),
        (f"CheckpointEncoder, {changed:,} of them replaced since", again),
        ("the same in slices of 0.5 ms, as the agent: the longest slice", longest),
        ("  and the number of slices", slices),
        ("10 resources x 10,000 devices, one resource's list new: the longest slice", wide_longest),
        ("encoded, texts kept, then CheckpointStore.write_encoded (fsyncs, rename)", write),
    ]
    for label, figures in rows:
        print(f"  {label:<74} {statistics.median(figures):7.1f}")


if __name__ == "__main__":
    main()
