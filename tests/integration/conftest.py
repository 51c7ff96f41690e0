"""Fixtures for integration tests: real agent and plugin processes on real unix sockets."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.alloc_env import AllocEnv, alloc_env
from tests.support.plugins import FakeKubelet, short_tmpdir
from tests.support.procs import AgentProcess, TestPlugin


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent_factory(short_tmp: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(*extra: str, wait: bool = True, workdir: Path | None = None) -> AgentProcess:
        agent = AgentProcess(workdir or short_tmp, *extra, plugin_dir=short_tmp / "dp")
        started.append(agent)
        return agent.start(wait=wait)

    yield start
    for agent in started:
        agent.kill()


@pytest.fixture
def agent(agent_factory: Callable[..., AgentProcess]) -> AgentProcess:
    return agent_factory()


@pytest.fixture
def plugin_factory() -> Iterator[Callable[..., TestPlugin]]:
    started: list[TestPlugin] = []

    def start(plugin_dir: Path, socket_name: str, devices: list[list[Any]] | None = None, *flags: str) -> TestPlugin:
        plugin = TestPlugin(plugin_dir, socket_name, devices, *flags)
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.stop()


@pytest.fixture
def env(short_tmp: Path) -> Iterator[AllocEnv]:
    """An agent reading a static pod directory, started; the test adds sim plugins (tests/support/alloc_env.py). Test
    modules that need another setup define their own `env`."""
    with alloc_env(short_tmp) as e:
        e.start_agent()
        yield e


@pytest.fixture
async def tmp_kubelet() -> AsyncIterator[tuple[Path, FakeKubelet]]:
    """A short temp dir and the kubelet stand-in's Registration service on <dir>/dp/kubelet.sock (SDK tests)."""
    with short_tmpdir() as tmp:
        kubelet = await FakeKubelet(tmp / "dp").start()
        try:
            yield tmp, kubelet
        finally:
            await kubelet.stop()
