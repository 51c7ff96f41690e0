"""A real agent (and a real plugin) per fuzz module: examples share them, as a long-running agent shares its life
with every input it gets; each example checks the agent is still live and consistent afterwards."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fuzz import LONG
from tests.support.procs import AgentProcess, TestPlugin, wait_for

RESOURCE = "example.com/fz"
DEVICES = [["d0", "Healthy", [0]], ["d1", "Healthy", [0]], ["d2", "Healthy", [1]], ["d3", "Healthy", [1]]]


@pytest.fixture(scope="module")
def fuzz_root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-fz-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fuzz_agent(fuzz_root: Path) -> Iterator[AgentProcess]:
    """Agent with a pod directory, a topology policy and fast dial failures (dead sockets are fuzz input)."""
    agent = AgentProcess(
        fuzz_root,
        "--pod-manifest-dir", str(fuzz_root / "pods"),
        "--startup-plugin-wait", "0s",
        "--topology-policy", "best-effort", "--numa-nodes", "2",
        "--plugin-dial-timeout", "0.2s",
        plugin_dir=fuzz_root / "dp",
    ).start()  # fmt: skip
    yield agent
    agent.kill()


@pytest.fixture(scope="module")
def fuzz_plugin(fuzz_agent: AgentProcess) -> Iterator[TestPlugin]:
    plugin = TestPlugin(fuzz_agent.plugin_dir, "fz.sock", DEVICES)
    assert plugin.register(RESOURCE)["ok"]
    wait_for(lambda: fuzz_agent.counts(RESOURCE) == (4, 4), what="the fuzz plugin's devices")
    yield plugin
    plugin.stop()


def assert_live(agent: AgentProcess) -> None:
    """Alive, serving, and every supervised task up."""
    assert agent.proc is not None and agent.proc.poll() is None, "the agent exited"
    assert agent.get_text("/healthz") == "ok"
    assert agent.get_text("/readyz") == "ok"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A long fuzz run (DEVICEPLANE_FUZZ=long) takes as long as it takes: no per-test timeout for it."""
    if LONG:
        for item in items:
            if "tests/fuzz/" in str(item.path):
                item.add_marker(pytest.mark.timeout(0))
