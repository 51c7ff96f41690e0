"""Our plugins against the real agent: both processes real, registration over the agent's kubelet.sock.

The checks passed to wait_until make blocking HTTP calls: fine here, nothing in the test's own loop serves them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.plugins import PluginProcess, short_tmpdir, wait_until
from tests.support.procs import ROOT, AgentProcess, child_env

SIM = "example.com/sim"


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.plugin_dir = tmp / "dp"
        self.agents: list[AgentProcess] = []
        self.plugins: list[PluginProcess] = []
        self.others: list[subprocess.Popen[bytes]] = []

    async def agent(self, *extra: str) -> AgentProcess:
        agent = AgentProcess(self.tmp, *extra, plugin_dir=self.plugin_dir).start(wait=False)
        self.agents.append(agent)
        try:
            await wait_until(agent.healthy, within=30, what="agent up")
        except AssertionError as err:
            raise AssertionError(f"{err}\n--- agent log ---\n{agent.log()[-3000:]}") from None
        return agent

    def plugin(self, kind: str, *args: str) -> PluginProcess:
        proc = PluginProcess(self.tmp, kind, "--plugin-dir", str(self.plugin_dir), *args)
        self.plugins.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.plugins:
            proc.kill()
        for other in self.others:
            other.kill()
            other.wait()
        for agent in self.agents:
            agent.stop(signal.SIGKILL)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    with short_tmpdir() as tmp:
        env = Env(tmp)
        try:
            yield env
        finally:
            env.close()


def sim_devices(count: int, per_node: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {f"sim-{i}": ("Healthy", (i // per_node,)) for i in range(count)}


async def test_sim_health_flips_reach_the_agent_within_1s(env):
    agent = await env.agent()
    sim = env.plugin("sim", "--count", "8", "--numa", "2", "--control", "127.0.0.1:0")
    assert await wait_until(lambda: agent.devices(SIM), within=15, what="sim in agent") == sim_devices(8, 4)
    resource = agent.resource(SIM)
    assert (resource["capacity"], resource["allocatable"], resource["healthy"]) == (8, 8, 8)
    assert resource["plugin"]["preStartRequired"] and resource["plugin"]["getPreferredAllocationAvailable"]
    for device_id, state in [("sim-3", "unhealthy"), ("sim-6", "unhealthy"), ("sim-3", "healthy")]:
        started = time.monotonic()
        sim.control("POST", f"/devices/{device_id}/{state}")
        expected = state.capitalize()
        await wait_until(lambda d=device_id, e=expected: agent.devices(SIM)[d][0] == e, within=1, what="flip")
        assert time.monotonic() - started < 1
    resource = agent.resource(SIM)
    assert (resource["healthy"], resource["unhealthy"], resource["allocatable"]) == (7, 1, 7)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_sim_reregisters_within_2s_after_agent_restart(env, sig):
    agent = await env.agent()
    sim = env.plugin("sim", "--count", "4", "--numa", "2", "--control", "127.0.0.1:0")
    await wait_until(lambda: agent.devices(SIM), within=15, what="sim in agent")
    sim.control("POST", "/devices/sim-1/unhealthy")
    await wait_until(lambda: agent.devices(SIM)["sim-1"][0] == "Unhealthy", within=1, what="flip")
    for _ in range(2):
        agent.stop(sig)
        agent = await env.agent()
        started = time.monotonic()
        devices = await wait_until(lambda a=agent: a.devices(SIM), within=2, what="re-registration")
        assert time.monotonic() - started < 2
        assert devices["sim-1"][0] == "Unhealthy" and devices["sim-0"][0] == "Healthy"
    assert sim.proc.poll() is None
    assert sim.control("GET", "/devices")["registrations"] == 3


async def test_sim_reregisters_when_kubelet_sock_recreated(env):
    """The registration socket is deleted and re-created under a running agent-less directory."""
    agent = await env.agent()
    env.plugin("sim", "--count", "2")
    await wait_until(lambda: agent.devices(SIM), within=15, what="sim in agent")
    agent.stop(signal.SIGKILL)
    (env.plugin_dir / "kubelet.sock").unlink()
    agent = await env.agent()
    started = time.monotonic()
    await wait_until(lambda: agent.devices(SIM), within=2, what="re-registration")
    assert time.monotonic() - started < 2


async def test_sim_through_the_agents_plugin_watcher(env):
    registry = env.tmp / "plugins_registry"
    agent = await env.agent("--plugins-registry-dir", str(registry))
    sim = PluginProcess(env.tmp, "sim", "--registry-dir", str(registry), "--count", "3", "--numa", "0",
                        "--control", "127.0.0.1:0")  # fmt: skip
    env.plugins.append(sim)
    devices = await wait_until(lambda: agent.devices(SIM), within=15, what="sim via plugin watcher")
    assert devices == {f"sim-{i}": ("Healthy", ()) for i in range(3)}
    await wait_until(lambda: sim.control("GET", "/devices")["registrations"] >= 1, what="NotifyRegistrationStatus")
    sim.control("POST", "/devices/sim-2/unhealthy")
    await wait_until(lambda: agent.devices(SIM)["sim-2"][0] == "Unhealthy", within=1, what="flip")


async def test_files_plugin_live_in_agent(env):
    cola = env.tmp / "cola"
    cola.mkdir()
    (cola / "can-1").touch()
    agent = await env.agent()
    env.plugin("files", "--dir", str(cola))
    await wait_until(lambda: agent.devices("example.com/cola") == {"can-1": ("Healthy", ())}, within=15, what="files")
    (cola / "can-2").touch()
    await wait_until(lambda: set(agent.devices("example.com/cola")) == {"can-1", "can-2"}, within=1, what="create")
    (cola / "can-1").unlink()
    await wait_until(lambda: set(agent.devices("example.com/cola")) == {"can-2"}, within=1, what="remove")


async def test_readme_example_against_the_agent(env):
    agent = await env.agent()
    state = env.tmp / "state"
    state.mkdir()
    example = subprocess.Popen(  # noqa: ASYNC220 - starting a process does not block
        [sys.executable, str(ROOT / "examples" / "slot_plugin.py")],
        env=child_env() | {"DEVICEPLANE_PLUGIN_DIR": str(env.plugin_dir), "SLOT_STATE_DIR": str(state)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env.others.append(example)
    devices = await wait_until(lambda: agent.devices("example.com/slot"), within=15, what="example registered")
    assert devices == {f"slot-{i}": ("Healthy", (i // 2,)) for i in range(4)}
    (state / "slot-1.broken").touch()
    await wait_until(lambda: agent.devices("example.com/slot")["slot-1"][0] == "Unhealthy", within=3, what="health")
    example.send_signal(signal.SIGTERM)
    assert example.wait(10) == 0
    assert not any(p.name.startswith("example.com_slot") for p in env.plugin_dir.iterdir())
    await wait_until(lambda: not agent.resource("example.com/slot")["plugin"]["connected"], what="disconnected")
