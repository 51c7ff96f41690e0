"""Release waits for the pod sources (spec §4.8): nothing restored from the checkpoint is freed before every source
has said it is synced, and then exactly the pods no source knows are freed. In-process, real files."""

from __future__ import annotations

from pathlib import Path

from deviceplane.agent.admission.runner import AdmissionRunner
from deviceplane.agent.app import Agent, AgentConfig
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


def agent_with(tmp_path: Path, data: CheckpointData, sources: tuple[str, ...]) -> Agent:
    """The agent's objects as the composition root builds them, nothing served; `sources` registered."""
    config = AgentConfig(tmp_path, tmp_path / "pr.sock", "node", 300, "127.0.0.1:0", startup_plugin_wait=0)
    agent = Agent(config)
    for source in sources:
        agent.pods.register_source(source)
    agent.manager.restore(data)
    agent.admission.restore(data)
    agent.admission.start()
    return agent


async def admitted(controller: AdmissionRunner, uid: str) -> str:
    record = await controller.settled(uid)
    assert record is not None
    return f"{record.state}{' restored' if record.restored else ''}"


async def test_nothing_is_freed_before_all_sources_are_synced(tmp_path: Path) -> None:
    agent = agent_with(tmp_path, checkpoint_with("kept", "gone", "done"), ("file", "api"))
    controller = agent.admission
    try:
        controller.pod_set("file", "kept.yaml", pod("kept"))
        controller.pod_set("file", "done.yaml", pod("done", phase="Succeeded"))
        controller.synced("file")
        assert controller.collect_garbage() == []
        assert agent.pod_devices.pods() == {"kept", "gone", "done"}  # "api" may still report gone/done
        assert await admitted(controller, "kept") == "admitted restored"
        controller.synced("api")
        assert agent.pod_devices.pods() == {"kept"}
        assert await admitted(controller, "done") == "terminated"
    finally:
        await controller.stop_admitting()
        await controller.close()


async def test_removed_pod_is_freed_at_once_when_synced(tmp_path: Path) -> None:
    agent = agent_with(tmp_path, checkpoint_with("a"), ("file",))
    controller = agent.admission
    try:
        controller.pod_set("file", "a.yaml", pod("a"))
        controller.synced("file")
        assert await admitted(controller, "a") == "admitted restored"
        controller.pod_gone("file", "a.yaml")
        assert agent.pod_devices.pods() == set()
        assert agent.views.pods() == []
    finally:
        await controller.stop_admitting()
        await controller.close()
