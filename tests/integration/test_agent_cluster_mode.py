"""Cluster mode without a reachable API server: `--require-apiserver` exits with a clear error; without it the agent
starts, serves locally and admits static pods, and says in /readyz what it is waiting for. (Publishing against a
real API server is tested in tests/e2e/test_cluster_agent.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.pods import simple_pod, wait_settled
from tests.support.procs import ROOT, AgentProcess, TestPlugin, child_env, free_port, wait_for

R = "example.com/gpu"


def unreachable_kubeconfig(directory: Path) -> tuple[Path, str]:
    server = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = directory / "kubeconfig"
    path.write_text(json.dumps(config))
    return path, server


def agent_command(workdir: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "deviceplane", "agent", "--node-name", "n1",
        "--plugin-dir", str(workdir / "dp"), "--pod-resources-socket", str(workdir / "pr.sock"),
        "--http-addr", f"127.0.0.1:{free_port()}", *flags,
    ]  # fmt: skip


def run_agent(workdir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = agent_command(workdir, *flags)
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60)


def test_require_apiserver_exits_with_a_clear_error(short_tmp: Path) -> None:
    kubeconfig, server = unreachable_kubeconfig(short_tmp)
    result = run_agent(short_tmp, "--kubeconfig", str(kubeconfig), "--require-apiserver")
    assert result.returncode == 1, result.stderr
    assert f"cannot reach the API server at {server} (--require-apiserver)" in result.stderr, result.stderr
    assert not (short_tmp / "dp" / "kubelet.sock").exists()  # nothing was served


def test_bad_flags_and_kubeconfig_are_refused(short_tmp: Path) -> None:
    result = run_agent(short_tmp, "--kubeconfig", str(short_tmp / "missing"))
    assert result.returncode == 1
    assert f"cannot load {short_tmp / 'missing'}" in result.stderr, result.stderr
    result = run_agent(short_tmp, "--kubeconfig", str(short_tmp / "missing"), "--standalone")
    assert result.returncode != 0 and "--standalone and --kubeconfig exclude each other" in result.stderr
    result = run_agent(short_tmp, "--require-apiserver")  # no kubeconfig, not in a cluster
    assert result.returncode != 0 and "--require-apiserver needs --kubeconfig" in result.stderr
    # bytes that are not UTF-8 reach Python as lone surrogates (argv, $NODE_NAME): no metric or JSON could carry them
    result = run_agent(short_tmp, "--standalone", "--node-name", os.fsdecode(b"node-\xff"))
    assert result.returncode != 0 and "the node name must be UTF-8 text, got 'node-\\udcff'" in result.stderr
    assert not (short_tmp / "dp" / "kubelet.sock").exists()


class ClusterModeAgent(AgentProcess):
    """AgentProcess without --standalone: the kubeconfig decides."""

    def start(self, wait: bool = True) -> ClusterModeAgent:
        cmd = agent_command(self.workdir, *self.extra)
        cmd[cmd.index("--plugin-dir") + 1] = str(self.plugin_dir)
        cmd[cmd.index("--http-addr") + 1] = f"127.0.0.1:{self.port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env(), start_new_session=True)
        wait_for(lambda: self.healthy(), timeout=20, what=f"agent healthy ({self.log_path})")
        return self


def test_agent_serves_locally_while_the_apiserver_is_unreachable(short_tmp: Path) -> None:
    kubeconfig, _server = unreachable_kubeconfig(short_tmp)
    manifests = short_tmp / "manifests"
    agent = ClusterModeAgent(short_tmp, "--kubeconfig", str(kubeconfig), "--pod-manifest-dir", str(manifests))
    plugin = None
    try:
        agent.start()
        plugin = TestPlugin(agent.plugin_dir, "p.sock", [["g0", "Healthy"], ["g1", "Healthy"]])
        plugin.register(R)
        wait_for(lambda: agent.counts(R) == (2, 2))
        simple_pod(manifests, "local", R, 1)
        assert wait_settled(agent, "local")["state"] == "admitted"
        try:
            agent.get_text("/readyz")
            raise AssertionError("ready without the API server")
        except urllib.error.HTTPError as err:
            assert err.code == 503
            # Every part not ready, each with its last error (Connection refused, in words that depend on urllib3).
            parts = err.read().decode().split("; ")
            assert parts[0] == "pods from the API server not listed yet", parts
            assert parts[1].startswith("node status not published yet: patch node n1 status: "), parts
            assert parts[2].startswith("NodeDevices not published yet: get nodedevices n1: "), parts
            assert len(parts) == 3 and all("Connection refused" in part for part in parts[1:]), parts
        assert agent.proc is not None and agent.proc.poll() is None
        assert "cannot publish node status; retrying" in agent.log()
    finally:
        if plugin is not None:
            plugin.stop()
        assert agent.stop() == 0, agent.log()
    assert '"agent stopped"' in agent.log()
