"""The agent's read endpoints are reads: building /api/v1/devices changes nothing, even when a resource is past its
grace period (expiry is the timer's job). In-process, the objects as the composition root builds them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from deviceplane.agent.app import Agent, AgentConfig
from deviceplane.core.checkpoint import CheckpointData
from deviceplane.core.constants import CHECKPOINT_NAME

RES = "example.com/r"


def agent_in(tmp_path: Path, grace_period: float) -> Agent:
    config = AgentConfig(tmp_path / "dp", tmp_path / "pr.sock", "node", grace_period, "127.0.0.1:0")
    return Agent(config)


async def test_devices_view_does_not_expire_resources(tmp_path: Path) -> None:
    agent = agent_in(tmp_path, grace_period=0.0)
    agent.manager.restore(CheckpointData(PodDeviceEntries=None, RegisteredDevices={RES: []}))
    await asyncio.sleep(0.01)  # the restored resource is now past its (zero) grace period
    first = json.loads(agent.views.devices())
    second = json.loads(agent.views.devices())
    assert [r["name"] for r in first["resources"]] == [RES]
    assert second["resources"] == first["resources"]
    assert agent.registry.resource(RES) is not None
    assert not (tmp_path / "dp" / CHECKPOINT_NAME).exists()  # no checkpoint write was asked for
    # The timer's step deletes it.
    assert agent.manager.expire() == (RES,)
    assert json.loads(agent.views.devices())["resources"] == []
    await agent.manager.stop()
