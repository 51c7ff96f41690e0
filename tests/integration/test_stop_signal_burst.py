"""A stop is often more than one signal: Ctrl-C held down, a supervisor repeating SIGTERM. The agent and an SDK plugin
act on the first and make a clean exit that the rest must not interrupt. Before, a late one landed after asyncio had
put the default dispositions back as its loop closed: exit 130 with "Exception ignored ... KeyboardInterrupt" on
stderr, or death by the signal (-2, -15), after a stop that had otherwise gone well (5 of 8 plugin runs)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.plugins import PluginProcess
from tests.support.procs import AgentProcess, hold_down, wait_for

RESOURCE = "example.com/burst"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_burst_of_stop_signals_ends_the_agent_and_a_plugin_cleanly(short_tmp: Path, sig: signal.Signals) -> None:
    agent = AgentProcess(short_tmp).start()
    plugin = PluginProcess(
        short_tmp, "sim", "--plugin-dir", str(agent.plugin_dir), "--resource", RESOURCE, "--count", "4"
    )
    try:
        wait_for(lambda: agent.counts(RESOURCE) == (4, 4), timeout=20, what="the sim's devices in the agent")
        plugin_socket = next(p for p in agent.plugin_dir.glob("*.sock") if p.name != "kubelet.sock")

        sent = hold_down(plugin.proc, sig, interval=0.001)
        assert plugin.proc.returncode == 0, f"plugin: exit {plugin.proc.returncode} after {sent}\n{plugin.stderr}"
        assert "Traceback" not in plugin.stderr and "Exception ignored" not in plugin.stderr, plugin.stderr
        assert not plugin_socket.exists()

        assert agent.proc is not None
        sent = hold_down(agent.proc, sig, interval=0.001)
        log = agent.log()
        assert agent.proc.returncode == 0, f"agent: exit {agent.proc.returncode} after {sent}\n{log[-3000:]}"
        assert "agent stopped" in log, log[-3000:]
        assert "Traceback" not in log and "Exception ignored" not in log, log[-3000:]
        assert not (agent.plugin_dir / "kubelet.sock").exists()
    finally:
        plugin.kill()
        agent.kill()
