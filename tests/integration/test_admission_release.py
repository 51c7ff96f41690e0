"""Release waits for the pod sources (spec §4.8): nothing restored from the checkpoint is freed before every source
has said it is synced, and then exactly the pods no source knows are freed. In-process, real files."""

from __future__ import annotations

from pathlib import Path

from deviceplane.agent.admission.admission import AdmissionController
from deviceplane.agent.plugins.manager import DeviceManager
from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.checkpoint import CheckpointData
from deviceplane.core.pod_devices import make_allocation
from deviceplane.core.pods import Container, Pod

RES = "example.com/r"


def checkpoint_with(*pods: str) -> CheckpointData:
    entries = [
        make_allocation(uid, "c", RES, {0: (f"dev-{uid}",)}, pb.ContainerAllocateResponse()).entry for uid in pods
    ]
    return CheckpointData(PodDeviceEntries=entries, RegisteredDevices={RES: []})


def pod(uid: str, phase: str = "Running") -> Pod:
    return Pod(uid, "default", uid, phase, (), (Container("c", ((RES, 1),)),))


async def controller_with(tmp_path: Path, data: CheckpointData) -> AdmissionController:
    manager = DeviceManager(CheckpointStore(tmp_path), grace_period=300)
    manager.registry.restore(data.RegisteredDevices or {}, now=0)
    controller = AdmissionController(manager, tmp_path, startup_wait=0)
    controller.restore(data)
    controller.start()
    return controller


async def test_nothing_is_freed_before_all_sources_are_synced(tmp_path: Path) -> None:
    controller = await controller_with(tmp_path, checkpoint_with("kept", "gone", "done"))
    controller.register_source("file")
    controller.register_source("api")
    try:
        controller.pod_set("file", "kept.yaml", pod("kept"))
        controller.pod_set("file", "done.yaml", pod("done", phase="Succeeded"))
        controller.synced("file")
        assert controller.collect_garbage() == []
        assert controller.pod_devices.pods() == {"kept", "gone", "done"}  # "api" may still report gone/done
        await controller.records["kept"].admitted.wait()
        assert controller.records["kept"].state == "admitted" and controller.records["kept"].restored
        controller.synced("api")
        assert controller.pod_devices.pods() == {"kept"}
        assert controller.records["done"].state == "terminated"
    finally:
        await controller.stop()


async def test_removed_pod_is_freed_at_once_when_synced(tmp_path: Path) -> None:
    controller = await controller_with(tmp_path, checkpoint_with("a"))
    controller.register_source("file")
    try:
        controller.pod_set("file", "a.yaml", pod("a"))
        controller.synced("file")
        await controller.records["a"].admitted.wait()
        controller.pod_gone("file", "a.yaml")
        assert controller.pod_devices.pods() == set()
        assert controller.pods_json() == []
    finally:
        await controller.stop()
