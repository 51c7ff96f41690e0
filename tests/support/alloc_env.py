"""An agent with a static pod directory and sim plugins, all real processes on real sockets."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.plugins import PluginProcess
from tests.support.pods import PodResourcesClient
from tests.support.procs import AgentProcess, wait_for


class AllocEnv:
    def __init__(self, root: Path, *agent_args: str) -> None:
        self.root = root
        self.plugin_dir = root / "dp"
        self.pod_dir = root / "pods"
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        self.agent_args = agent_args
        self.agent: AgentProcess | None = None
        self.plugins: list[PluginProcess] = []
        self._clients: list[PodResourcesClient] = []

    @property
    def pod_resources_socket(self) -> Path:
        return self.root / "pod-resources" / "kubelet.sock"

    def start_agent(self, *extra: str) -> AgentProcess:
        self.agent = AgentProcess(
            self.root,
            "--pod-manifest-dir", str(self.pod_dir),
            "--startup-plugin-wait", "0s",
            *self.agent_args,
            *extra,
            plugin_dir=self.plugin_dir,
        ).start()  # fmt: skip
        return self.agent

    def restart_agent(self, kill: bool = True, *extra: str) -> AgentProcess:
        assert self.agent is not None
        if kill:
            self.agent.kill()
        else:
            self.agent.stop()
        return self.start_agent(*extra)

    def sim(self, resource: str, count: int, numa: int = 0, *flags: str, wait: bool = True) -> PluginProcess:
        plugin = PluginProcess(
            self.root / "sim-logs",
            "sim",
            "--resource", resource,
            "--count", str(count),
            "--numa", str(numa),
            "--plugin-dir", str(self.plugin_dir),
            "--control", "127.0.0.1:0",
            *flags,
        )  # fmt: skip
        self.plugins.append(plugin)
        if wait:
            self.wait_devices(resource, count)
        return plugin

    def wait_devices(self, resource: str, healthy: int) -> dict[str, Any]:
        assert self.agent is not None
        agent = self.agent

        def ready() -> dict[str, Any] | None:
            r = agent.resource(resource)
            return r if r is not None and r["plugin"]["connected"] and r["healthy"] == healthy else None

        return wait_for(ready, timeout=20, what=f"{resource} with {healthy} healthy devices")

    def pod_resources(self) -> PodResourcesClient:
        client = PodResourcesClient(self.pod_resources_socket)
        self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()
        for plugin in self.plugins:
            if plugin.proc.poll() is None:
                plugin.proc.kill()
                plugin.proc.wait()
        if self.agent is not None:
            self.agent.kill()


@contextmanager
def alloc_env(root: Path, *agent_args: str) -> Iterator[AllocEnv]:
    env = AllocEnv(root, *agent_args)
    try:
        yield env
    finally:
        env.close()
