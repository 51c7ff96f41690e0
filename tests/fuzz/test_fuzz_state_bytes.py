"""Fuzzing the durable state's bytes: random bit flips, zeroed stretches and truncations of the kubelet checkpoint
and the journal segments. Start (checkpoint read, journal replay, a fresh segment opened) always succeeds; what
comes back is a subset of what was recorded (nothing invented); no device is held by two pods; and a new admission
after it never picks a device a restored pod holds."""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.agent.state.durability import AllocationStore, CheckpointContent
from deviceplane.agent.state.journal import Journal, alloc_record, list_segments, release_record
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.admission_plan import AllocateCall, admit_pod
from deviceplane.core.allocator import AllocationError, Allocator
from deviceplane.core.checkpoint import CheckpointData, CheckpointEncoder
from deviceplane.core.constants import CHECKPOINT_NAME
from deviceplane.core.pod_devices import Allocation, PodDevices, make_allocation
from deviceplane.core.pods import Container, Pod
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from tests.support.fuzz import fuzz_settings

R = "example.com/fz"
DEVICES = [f"d{i}" for i in range(12)]


def allocation(pod: str, devices: tuple[str, ...]) -> Allocation:
    return make_allocation(pod, "c", R, {0: devices}, pb.ContainerAllocateResponse(envs={"D": ",".join(devices)}))


# What was recorded: p0-p3 in the checkpoint, then the journal allocates p4-p5 and releases p1.
CHECKPOINTED = {f"p{i}": (DEVICES[2 * i], DEVICES[2 * i + 1]) for i in range(4)}
JOURNALED = {"p4": ("d8", "d9"), "p5": ("d10",)}
RECORDED = CHECKPOINTED | JOURNALED


async def _golden(directory: Path) -> None:
    pds = PodDevices()
    for pod, devices in CHECKPOINTED.items():
        pds.insert(allocation(pod, devices))
    CheckpointStore(directory).write(CheckpointData(PodDeviceEntries=pds.entries(), RegisteredDevices={R: DEVICES}))
    journal = Journal(directory, segment_bytes=8 << 10)
    journal.replay(PodDevices())
    journal.open()
    for pod, devices in JOURNALED.items():
        await journal.append(alloc_record(allocation(pod, devices)))
    await journal.append(release_record("p1"))
    await journal.close()


GOLDEN = Path(tempfile.mkdtemp(prefix="dp-fuzz-golden-"))
atexit.register(shutil.rmtree, GOLDEN, True)
asyncio.run(_golden(GOLDEN))
FILES = sorted(p.name for p in GOLDEN.iterdir())
assert CHECKPOINT_NAME in FILES and len(FILES) >= 2, FILES

Damage = tuple[str, str, int, int]  # (file, how, position, length)
DAMAGE = st.tuples(
    st.sampled_from(FILES),
    st.sampled_from(["flip", "flip", "zero", "truncate", "garbage"]),
    st.integers(0, 2000),
    st.integers(1, 64),
)


def damage(path: Path, how: str, position: int, length: int, data: bytes) -> None:
    blob = bytearray(path.read_bytes())
    if not blob:
        return
    position %= len(blob) if how != "truncate" else len(blob) + 1
    if how == "flip":
        blob[position] ^= 1 << (length % 8)
    elif how == "zero":
        blob[position : position + length] = bytes(len(blob[position : position + length]))
    elif how == "truncate":
        del blob[position:]
    else:
        blob[position : position + len(data)] = data
    path.write_bytes(bytes(blob))


def restored_state(directory: Path) -> tuple[DeviceRegistry, PodDevices]:
    """The agent's start path for durable state, with its real classes (small journal segments, for speed)."""
    registry = DeviceRegistry(grace_period=300)
    pod_devices = PodDevices()
    checkpoint_file = CheckpointStore(directory)
    data = checkpoint_file.read()
    if data is not None and data.RegisteredDevices:
        registry.restore(data.RegisteredDevices, 0.0)
    content = CheckpointContent(registry, pod_devices)
    journal = Journal(directory, segment_bytes=8 << 10)
    store = AllocationStore(
        pod_devices,
        journal,
        content,
        CheckpointWriter(checkpoint_file.write_encoded, content.snapshot, CheckpointEncoder()),
    )
    store.restore(data)
    asyncio.run(journal.close())
    return registry, pod_devices


def admit_new_pod(registry: DeviceRegistry, pod_devices: PodDevices, count: int) -> set[str]:
    registry.plugin_connected(R, "/fz.sock", PluginOptions(), 0.0)
    registry.apply_snapshot(R, "/fz.sock", [Device(d, "Healthy", (0,)) for d in DEVICES])
    allocator = Allocator(registry, pod_devices)
    pod = Pod("new-pod", "default", "new", "Pending", (), (Container("c", ((R, count),)),))
    steps = admit_pod(allocator, pod)
    chosen: set[str] = set()
    try:
        step = next(steps)
        while True:
            assert isinstance(step, AllocateCall)
            chosen |= set(step.devices)
            step = steps.send(pb.ContainerAllocateResponse())
    except StopIteration:
        pass
    except AllocationError as err:
        assert "requested number of devices unavailable" in str(err), err
        return set()
    return chosen


@fuzz_settings(bounded=300, long=20_000)
@given(st.lists(DAMAGE, min_size=1, max_size=4), st.binary(min_size=1, max_size=16), st.integers(1, 12))
def test_fuzz_checkpoint_and_journal_bytes(damages: list[Damage], garbage: bytes, request: int) -> None:
    directory = Path(tempfile.mkdtemp(prefix="dp-fuzz-state-"))
    try:
        for name in FILES:
            shutil.copy(GOLDEN / name, directory / name)
        for name, how, position, length in damages:
            damage(directory / name, how, position, length, garbage)
        registry, pod_devices = restored_state(directory)
        # a fresh segment follows the replayed ones
        assert list_segments(directory)[-1][0] > max(seq for seq, _ in list_segments(GOLDEN))
        held: dict[str, str] = {}
        for pod in pod_devices.pods():
            devices = pod_devices.pod_devices(pod, R)
            assert pod in RECORDED and devices == set(RECORDED[pod]), (pod, devices)  # nothing invented
            for device in devices:
                assert device not in held, f"{device} held by {held[device]} and {pod}"
                held[device] = pod
        chosen = admit_new_pod(registry, pod_devices, request)
        assert not chosen & set(held), (chosen, held)
        assert len(chosen) in (0, request)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_undamaged_state_restores_everything_recorded() -> None:
    """The fuzz target's baseline: without damage, start gives exactly the recorded state."""
    directory = Path(tempfile.mkdtemp(prefix="dp-fuzz-state-"))
    try:
        for name in FILES:
            shutil.copy(GOLDEN / name, directory / name)
        _registry, pod_devices = restored_state(directory)
        expected = {pod: set(devices) for pod, devices in RECORDED.items() if pod != "p1"}
        assert {pod: pod_devices.pod_devices(pod, R) for pod in pod_devices.pods()} == expected
    finally:
        shutil.rmtree(directory, ignore_errors=True)
