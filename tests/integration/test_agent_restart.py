"""Agent restarts: SIGKILL with plugins registered, the kubelet checkpoint, corrupt files, a lost socket."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from deviceplane.core.checkpoint import checksum, decode
from deviceplane.core.constants import CHECKPOINT_NAME
from tests.support.procs import AgentProcess, TestPlugin, wait_for

SPEC_EXAMPLE = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"pod-uid-1","ContainerName":"ctr","ResourceName":"example.com/resource",'
    b'"DeviceIDs":{"-1":["Dev-2"],"0":["Dev-1"]},"AllocResp":"CgUKAUESAA=="}],'
    b'"RegisteredDevices":{"a.com/b":["x"],"example.com/resource":["Dev-1","Dev-2"]}},"Checksum":1336083214}'
)


def test_sigkill_restart_restores_resources_until_plugins_return(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    agent = agent_factory()
    gpu = plugin_factory(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Healthy"], ["g2", "Unhealthy"]])
    nic = plugin_factory(agent.plugin_dir, "nic.sock", [["n0", "Healthy"]])
    gpu.register("example.com/gpu")
    nic.register("example.com/nic")
    wait_for(lambda: agent.counts("example.com/gpu") == (3, 2) and agent.counts("example.com/nic") == (1, 1))

    checkpoint = agent.plugin_dir / CHECKPOINT_NAME
    data = wait_for(
        lambda: (
            (d := decode(checkpoint.read_bytes())).RegisteredDevices
            == {"example.com/gpu": ["g0", "g1"], "example.com/nic": ["n0"]}
            and d
        ),
        what="checkpoint with both resources' healthy devices",
    )
    # The file verifies with the kubelet's checksum (decode recomputes it from the go-spew text).
    assert data.PodDeviceEntries is None
    assert b'"PodDeviceEntries":null' in checkpoint.read_bytes()
    assert f'"Checksum":{checksum(data)}}}'.encode() in checkpoint.read_bytes()

    agent.kill()
    restarted = agent_factory()
    # Both resources come back stopped: 0/0, plugin not connected, until their plugins register again.
    assert restarted.counts("example.com/gpu") == (0, 0)
    assert restarted.counts("example.com/nic") == (0, 0)
    assert restarted.resource("example.com/gpu")["plugin"]["connected"] is False
    # The plugins' sockets were removed as stale at start (the kubelet does the same): a plugin that notices
    # re-creates its server and registers again. Ours are steered by hand.
    assert not (restarted.plugin_dir / "gpu.sock").exists()
    gpu.stop()
    nic.stop()
    gpu = plugin_factory(restarted.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Healthy"], ["g2", "Unhealthy"]])
    started = time.monotonic()
    gpu.register("example.com/gpu")
    wait_for(lambda: restarted.counts("example.com/gpu") == (3, 2), timeout=1.0, what="gpu correct within 1 s")
    assert time.monotonic() - started < 1.0
    assert restarted.counts("example.com/nic") == (0, 0)


def test_grace_period_deletes_restored_resources(short_tmp: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    (plugin_dir / CHECKPOINT_NAME).write_bytes(SPEC_EXAMPLE)
    agent = agent_factory("--grace-period", "1s")
    assert agent.counts("example.com/resource") == (0, 0)
    wait_for(lambda: agent.resources() == {}, timeout=5, what="restored resources deleted after the grace period")
    # Deletion rewrites the checkpoint without the resources.
    data = wait_for(lambda: (d := decode((plugin_dir / CHECKPOINT_NAME).read_bytes())).RegisteredDevices == {} and d)
    assert data.RegisteredDevices == {}


def test_kubelet_written_checkpoint_loads(short_tmp: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    (plugin_dir / CHECKPOINT_NAME).write_bytes(SPEC_EXAMPLE)
    agent = agent_factory()
    assert set(agent.resources()) == {"a.com/b", "example.com/resource"}
    assert agent.counts("a.com/b") == (0, 0)
    assert not list(plugin_dir.glob(f"{CHECKPOINT_NAME}.corrupt-*"))


def test_corrupt_checkpoint_set_aside(short_tmp: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    corrupt = SPEC_EXAMPLE.replace(b"1336083214", b"1336083215")
    (plugin_dir / CHECKPOINT_NAME).write_bytes(corrupt)
    agent = agent_factory()
    assert agent.resources() == {}
    aside = list(plugin_dir.glob(f"{CHECKPOINT_NAME}.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == corrupt
    assert "checkpoint" in agent.log().lower() and "corrupt" in agent.log().lower()


def test_registration_socket_recreated_when_deleted(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """The kubelet only fails its health check after repeated serve failures (§6.5 TestServeWithRetry); the agent
    notices its socket is gone and serves again, so plugins that watch for kubelet.sock re-register."""
    socket_path = agent.plugin_dir / "kubelet.sock"
    socket_path.unlink()
    wait_for(socket_path.exists, timeout=5, what="registration socket served again")
    assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    assert agent.get_text("/healthz") == "ok"
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["a", "Healthy"]])
    assert plugin.register("example.com/res")["ok"]
    wait_for(lambda: agent.counts("example.com/res") == (1, 1))
