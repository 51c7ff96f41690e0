"""Plugin-watcher registration (spec §3): GetInfo, validation, NotifyRegistrationStatus, socket removal."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/probe"
TWO = [["Dev1", "Healthy"], ["Dev2", "Healthy"]]


@pytest.fixture
def registry_dir(short_tmp: Path) -> Path:
    return short_tmp / "reg"


@pytest.fixture
def watching_agent(agent_factory: Callable[..., AgentProcess], registry_dir: Path) -> AgentProcess:
    return agent_factory("--plugins-registry-dir", str(registry_dir), "--plugin-dial-timeout", "2s")


def probe_plugin(
    factory: Callable[..., TestPlugin], directory: Path, socket_name: str, devices: list, **info: object
) -> TestPlugin:
    info.setdefault("name", R)
    return factory(directory, socket_name, devices, "--watcher-info", json.dumps(info))


def notifications(plugin: TestPlugin) -> list[dict[str, object]]:
    return list(plugin.send(cmd="notifications")["notifications"])


def test_probe_mode_reregistration(
    watching_agent: AgentProcess, registry_dir: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """§6.1 item 5 (TestDevicePluginReRegistrationProbeMode): 2 → 2 → 1 via GetInfo."""
    agent = watching_agent
    p1 = probe_plugin(plugin_factory, registry_dir, "p1.sock", TWO)
    wait_for(lambda: agent.counts(R) == (2, 2), what="p1 registered via the watcher")
    assert wait_for(lambda: notifications(p1)) == [{"registered": True, "error": ""}]
    probe_plugin(plugin_factory, registry_dir, "p2.sock", TWO)
    wait_for(lambda: agent.resource(R)["plugin"]["endpoint"].endswith("p2.sock"), what="p2 primary")
    assert agent.counts(R) == (2, 2)
    probe_plugin(plugin_factory, registry_dir, "p3.sock", [["Dev3", "Healthy"]])
    wait_for(lambda: agent.counts(R) == (1, 1), what="p3 takes over")


def test_socket_removal_deregisters(
    watching_agent: AgentProcess, registry_dir: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    agent = watching_agent
    plugin = probe_plugin(plugin_factory, registry_dir, "p.sock", TWO)
    wait_for(lambda: agent.counts(R) == (2, 2))
    (registry_dir / "p.sock").unlink()
    wait_for(lambda: not agent.resource(R)["plugin"]["connected"], what="deregistered on socket removal")
    assert agent.counts(R) == (2, 0)
    plugin.stop()


def test_subdirectories_and_dotfiles(
    watching_agent: AgentProcess, registry_dir: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    agent = watching_agent
    (registry_dir / "vendor").mkdir(parents=True, exist_ok=True)
    hidden = probe_plugin(plugin_factory, registry_dir, ".hidden.sock", TWO, name="example.com/hidden")
    probe_plugin(plugin_factory, registry_dir / "vendor", "p.sock", TWO)
    wait_for(lambda: agent.counts(R) == (2, 2), what="socket in a subdirectory registered")
    assert agent.resource("example.com/hidden") is None
    assert notifications(hidden) == []


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (
            {"type": "CSIPlugin"},
            "RegisterPlugin error -- no handler registered for plugin type: CSIPlugin at socket {socket}",
        ),
        (
            {"versions": ["v1alpha2", "v1"]},
            "RegisterPlugin error -- plugin validation failed with err: "
            "manager version, v1beta1, is not among plugin supported versions [v1alpha2 v1]",
        ),
        (
            {"name": "gpu"},
            "RegisterPlugin error -- plugin validation failed with err: "
            'invalid name of device plugin socket: the ResourceName "gpu" is invalid',
        ),
        (
            {"endpoint": "elsewhere.sock"},
            "RegisterPlugin error -- plugin registration failed with err: failed to dial device plugin",
        ),
    ],
)
def test_rejections_are_notified(
    watching_agent: AgentProcess,
    registry_dir: Path,
    plugin_factory: Callable[..., TestPlugin],
    info: dict[str, object],
    expected: str,
) -> None:
    plugin = probe_plugin(plugin_factory, registry_dir, "bad.sock", TWO, **info)
    # elsewhere.sock exists but nobody listens: the dial fails.
    if "endpoint" in info:
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(registry_dir / "elsewhere.sock"))
        s.close()
    got = wait_for(lambda: notifications(plugin), timeout=20, what="NotifyRegistrationStatus")
    assert got[0]["registered"] is False
    assert str(got[0]["error"]).startswith(expected.format(socket=registry_dir / "bad.sock"))
    assert watching_agent.resources() == {}


def test_repeated_events_connect_once(
    watching_agent: AgentProcess, registry_dir: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """§6.5 TestDuplicateRegistration: unrelated directory events do not reconnect a registered plugin."""
    plugin = probe_plugin(plugin_factory, registry_dir, "p.sock", TWO)
    wait_for(lambda: watching_agent.counts(R) == (2, 2))
    for i in range(5):
        (registry_dir / f"noise-{i}.txt").write_text("x")
    wait_for(lambda: plugin.send(cmd="calls")["calls"].get("ListAndWatch") == 1)
    time.sleep(0.5)  # give any (wrong) re-registration time to happen before counting
    calls = plugin.send(cmd="calls")["calls"]
    assert calls["GetDevicePluginOptions"] == 1 and calls["ListAndWatch"] == 1
    assert notifications(plugin) == [{"registered": True, "error": ""}]


def test_a_plugin_whose_first_getinfo_failed_is_tried_again(
    watching_agent: AgentProcess, registry_dir: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """The kubelet's plugin manager reconciles every second and retries a registration that failed before its
    handler (dial, GetInfo, validation) with backoff from 0.5 s. A plugin whose first GetInfo outlasted the 1 s
    deadline was never asked again here, until something else changed in the directory (found in review)."""
    plugin = probe_plugin(plugin_factory, registry_dir, "slow.sock", TWO, first_info_delay=1.5)
    wait_for(lambda: watching_agent.counts(R) == (2, 2), timeout=10, what="registered on a later attempt")
    state = plugin.send(cmd="notifications")
    assert state["info_calls"] >= 2
    assert state["notifications"] == [{"registered": True, "error": ""}]  # the failed attempt told the plugin nothing


def test_a_plugin_its_handler_refused_is_not_probed_again_until_its_socket_changes(
    watching_agent: AgentProcess, registry_dir: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """Upstream adds such a plugin to its actual state before the handler refuses it: no retries, one notification."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(registry_dir / "elsewhere.sock"))  # the endpoint exists, nobody listens: the handler's dial fails
    s.close()
    plugin = probe_plugin(plugin_factory, registry_dir, "bad.sock", TWO, endpoint="elsewhere.sock")
    wait_for(lambda: notifications(plugin), timeout=20, what="NotifyRegistrationStatus")
    time.sleep(3)  # three reconcile passes
    assert len(notifications(plugin)) == 1
    assert plugin.send(cmd="notifications")["info_calls"] == 1
