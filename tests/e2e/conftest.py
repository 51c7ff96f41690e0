"""e2e fixtures: a real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), kwok nodes,
kubectl, the real Go device plugins, the kubelet device-manager harness and the deviceplane agent.

Binaries come from `make k8s-bins` (tests/k8s/build.sh). Without them the e2e tests skip, naming that command,
unless DEVICEPLANE_E2E=required (CI), where they fail. Every process runs in its own process group, is killed at
teardown (also when a test fails), and the package's last teardown asserts none is left (the control plane is
package-scoped: it is gone before the integration and unit tests run).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import TestPlugin, free_port
from tests.support.required import unavailable

from .agent_cluster import (
    AGENT_DEBOUNCE_SECONDS,
    AGENT_GRACE_SECONDS,
    DAEMONSET,
    NAMESPACE,
    PROXY_DAEMONSET,
    PROXY_LABEL,
    bound_token,
    daemonset_pod,
    install,
    token_kubeconfig,
)
from .cluster import (
    CONTROL_PLANE_BINARIES,
    REPO,
    Cluster,
    bin_dir,
    http_json,
    missing_binaries,
    probe_ok,
    serve_cluster,
)
from .harness import Harness, start_harness
from .procs import Proc, Procs, wait_for

KUBELET_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # hard-coded in sample-device-plugin


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


# ---- binaries and processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def k8s_bin() -> Path:
    try:
        directory = bin_dir()
    except (OSError, subprocess.SubprocessError) as exc:
        unavailable(f"cannot locate the Kubernetes test binaries ({exc}): run `make k8s-bins`")
    missing = missing_binaries(directory, CONTROL_PLANE_BINARIES)
    if missing:
        unavailable(f"Kubernetes test binaries missing in {directory} ({', '.join(missing)}): run `make k8s-bins`")
    return directory


def need_binary(k8s_bin: Path, name: str) -> Path:
    path = k8s_bin / name
    if not os.access(path, os.X_OK):
        unavailable(f"{name} missing in {k8s_bin}: run `make k8s-bins`")
    return path


@pytest.fixture(scope="package")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    """Every process the e2e fixtures start. At the end of the e2e package: all stopped, and none may be left."""
    registry = Procs(tmp_path_factory.mktemp("logs"))
    yield registry
    registry.stop_all()
    left = registry.leftovers()
    if left:
        for pid, _pgid, _cmd in left:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        pytest.fail(f"processes left behind by the e2e tests: {left}", pytrace=False)


@pytest.fixture(scope="package", autouse=True)
def _session_process_check(procs: Procs) -> Iterator[None]:
    # Autouse so the leftover check (in `procs`' teardown) runs after every other package fixture is gone.
    yield


# ---- the cluster ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="package")
def cluster(k8s_bin: Path, procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from serve_cluster(k8s_bin, tmp_path_factory.mktemp("cluster"), procs)


@pytest.fixture
def kwok_nodes(cluster: Cluster) -> Iterator[Callable[..., list[str]]]:
    """Factory: kwok_nodes(3, prefix="ds", labels={...}, taints=[...]) -> names of nodes kwok has made Ready.

    `taints` (core/v1 Taint dicts) are set once the node is Ready, replacing the apiserver's initial
    node.kubernetes.io/not-ready:NoSchedule taint, which only the node-lifecycle controller (not run here) removes.
    """
    created: list[str] = []

    def make(
        count: int = 1,
        *,
        prefix: str = "kwok-node",
        labels: Mapping[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> list[str]:
        names = []
        for _ in range(count):
            name = f"{prefix}-{len(created)}-{os.urandom(3).hex()}"
            cluster.create_node(name, labels=labels)
            created.append(name)
            names.append(name)
        cluster.wait_nodes_ready(names)
        if taints is not None:
            for name in names:
                patch = json.dumps({"spec": {"taints": taints or None}})
                cluster.kubectl("patch", "node", name, "--type=merge", "-p", patch)
        return names

    yield make
    if created:
        cluster.kubectl("delete", "node", "--wait=false", "--ignore-not-found", *created, check=False)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-{os.urandom(4).hex()}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


# ---- directories -------------------------------------------------------------------------------------------------


@pytest.fixture
def short_tmp() -> Iterator[Callable[[str], Path]]:
    """Short directories under /tmp (unix socket paths must stay under 108 bytes)."""
    made: list[Path] = []

    def make(prefix: str = "dp") -> Path:
        d = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp"))
        made.append(d)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


# ---- Go device plugins ---------------------------------------------------------------------------------------


@pytest.fixture
def generic_device_plugin(k8s_bin: Path, procs: Procs) -> Iterator[Callable[..., Proc]]:
    """Factory: start squat/generic-device-plugin (squat.ai/null: 4 x /dev/null) registering at
    <plugin_dir>/kubelet.sock. Built by `make k8s-bins` from its vendored source (tests/k8s/README.md)."""
    started: list[Proc] = []

    def start(plugin_dir: Path) -> Proc:
        exe = need_binary(k8s_bin, "generic-device-plugin")
        argv = [
            str(exe),
            "--plugin-directory",
            str(plugin_dir),
            "--domain",
            "squat.ai",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--device",
            '{"name":"null","groups":[{"count":4,"paths":[{"path":"/dev/null"}]}]}',
        ]
        p = procs.start("generic-device-plugin", argv)
        started.append(p)
        return p

    yield start
    for p in started:
        procs.stop(p)


def can_bind_mount() -> str | None:
    """None if we can run a process in a private mount namespace with a bind mount; else the reason."""
    if os.geteuid() != 0:
        return "needs root (a private mount namespace with a bind mount over /var/lib/kubelet/device-plugins)"
    if not shutil.which("unshare") or not shutil.which("mount"):
        return "needs util-linux unshare and mount"
    return None


@pytest.fixture
def sample_device_plugin(k8s_bin: Path, procs: Procs) -> Iterator[Callable[..., Proc]]:
    """Factory: start the upstream sample-device-plugin (example.com/resource: Dev-1, Dev-2) against <plugin_dir>.

    It dials the hard-coded /var/lib/kubelet/device-plugins/kubelet.sock, so it runs in a private mount
    namespace where plugin_dir is bind-mounted over that path (and its own socket lands in plugin_dir).
    """
    started: list[Proc] = []

    def start(plugin_dir: Path) -> Proc:
        exe = need_binary(k8s_bin, "sample-device-plugin")
        why = can_bind_mount()
        if why:
            unavailable(f"sample-device-plugin {why}")
        KUBELET_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)  # the mount point (empty on this machine)
        script = f'mount --bind "$0" {KUBELET_PLUGIN_DIR} && exec "$1"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(plugin_dir), str(exe)]
        p = procs.start("sample-device-plugin", argv, env={"PLUGIN_SOCK_DIR": str(KUBELET_PLUGIN_DIR)})
        started.append(p)
        return p

    yield start
    for p in started:
        procs.stop(p)


# ---- the kubelet device-manager harness -------------------------------------------------------------------------


@pytest.fixture
def kubelet_harness(k8s_bin: Path, procs: Procs) -> Iterator[Callable[..., Harness]]:
    """Factory: start the real kubelet device manager on <socket_dir>/kubelet.sock; returns a Harness client."""
    started: list[Proc] = []

    def start(
        socket_dir: Path, *, numa_nodes: int = 1, policy: str = "none", pod_resources_socket: Path | None = None
    ) -> Harness:
        exe = need_binary(k8s_bin, "kubelet-harness")
        h = start_harness(
            procs, exe, socket_dir, numa_nodes=numa_nodes, policy=policy, pod_resources_socket=pod_resources_socket
        )
        started.append(h.proc)
        return h

    yield start
    for p in started:
        procs.stop(p)


# ---- deviceplane (the code under test) --------------------------------------------------------------------------


@dataclass
class Agent:
    proc: Proc
    url: str
    plugin_dir: Path
    pod_resources_socket: Path | None = None

    def devices(self) -> dict[str, Any]:
        return dict(http_json(self.url + "/api/v1/devices"))

    def pods(self) -> list[dict[str, Any]]:
        return list(http_json(self.url + "/api/v1/pods"))

    def resource(self, name: str) -> dict[str, Any] | None:
        for r in self.devices().get("resources", []):
            if r.get("name") == name:
                return dict(r)
        return None


@pytest.fixture
def deviceplane_agent(procs: Procs, short_tmp: Callable[[str], Path]) -> Iterator[Callable[..., Agent]]:
    """Factory: start `python -m deviceplane agent --standalone ...` on a fresh plugin dir; returns an Agent.
    With `kubeconfig`, the agent publishes to that cluster as `node_name` instead of running standalone."""
    started: list[Proc] = []

    def start(
        *,
        pod_manifest_dir: Path | None = None,
        plugin_dir: Path | None = None,
        kubeconfig: Path | None = None,
        node_name: str | None = None,
        extra: Sequence[str] = (),
        ready: bool = True,
    ) -> Agent:
        # plugin_dir: reuse one (an agent restarted after SIGKILL); extra: more flags (e.g. --mode proxy ...);
        # ready=False: return once it serves HTTP (/healthz), for an agent that cannot get ready (its /readyz says why)
        plugin_dir = plugin_dir or short_tmp("dp-plugins")
        pr_dir = short_tmp("dp-podres")
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "deviceplane",
            "agent",
            *(["--kubeconfig", str(kubeconfig)] if kubeconfig is not None else ["--standalone"]),
            *(["--node-name", node_name] if node_name is not None else []),
            *extra,
            "--plugin-dir",
            str(plugin_dir),
            "--pod-resources-socket",
            str(pr_dir / "kubelet.sock"),
            "--http-addr",
            f"127.0.0.1:{port}",
        ]
        if pod_manifest_dir is not None:
            argv += ["--pod-manifest-dir", str(pod_manifest_dir)]
        p = procs.start("deviceplane-agent", argv, cwd=REPO)
        started.append(p)
        agent = Agent(p, f"http://127.0.0.1:{port}", plugin_dir, pr_dir / "kubelet.sock")
        # Ready means serving: the HTTP API and the registration socket <plugin_dir>/kubelet.sock.
        probe = "/readyz" if ready else "/healthz"
        wait_for(f"deviceplane agent {probe}", lambda: probe_ok(agent.url + probe), procs=[p], timeout=60)
        return agent

    yield start
    for p in started:
        procs.stop(p)


@pytest.fixture
def sim_plugin(procs: Procs) -> Iterator[Callable[..., Proc]]:
    """Factory: start our SDK's `sim` plugin (`python -m deviceplane plugin sim ...`) against <plugin_dir>."""
    started: list[Proc] = []

    def start(plugin_dir: Path, *, resource: str = "example.com/sim", count: int = 4, numa: int = 2) -> Proc:
        argv = [
            sys.executable,
            "-m",
            "deviceplane",
            "plugin",
            "sim",
            "--resource",
            resource,
            "--count",
            str(count),
            "--numa",
            str(numa),
            "--plugin-dir",
            str(plugin_dir),
        ]
        p = procs.start("deviceplane-plugin-sim", argv, cwd=REPO)
        started.append(p)
        return p

    yield start
    for p in started:
        procs.stop(p)


# -- the agent in a cluster (test_cluster_agent.py, test_proxy_cluster.py) ------------------------------------


@pytest.fixture(scope="module")
def agent_installed(cluster: Cluster) -> Iterator[Cluster]:
    """The agent's manifests (RBAC, policy, DaemonSets for the bound tokens), once per module."""
    install(cluster)
    yield cluster
    # The DaemonSets would put a pod on every later test's kwok nodes.
    for name in (DAEMONSET, PROXY_DAEMONSET):
        cluster.kubectl("delete", "daemonset", "-n", NAMESPACE, name, "--ignore-not-found", check=False)


@pytest.fixture
def test_plugins() -> Iterator[Callable[..., TestPlugin]]:
    started: list[TestPlugin] = []

    def start(plugin_dir: Path, socket: str, devices: list[list[Any]]) -> TestPlugin:
        plugin = TestPlugin(plugin_dir, socket, devices)
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.stop()


@pytest.fixture
def node_agent(agent_installed: Cluster, kwok_nodes, deviceplane_agent, short_tmp) -> Callable[..., Any]:
    """Factory: a kwok node and an agent for it, authenticated with a token bound to the DaemonSet's pod there.
    `proxy=True`: the node is labelled for the proxy-mode DaemonSet and the token is bound to that one's pod."""

    def start(extra: Sequence[str] = (), proxy: bool = False, **kw: Any) -> tuple[str, Any]:
        labels = {PROXY_LABEL: "proxy"} if proxy else None
        (node,) = kwok_nodes(1, prefix="agent", labels=labels)
        pod = daemonset_pod(agent_installed, node, PROXY_DAEMONSET if proxy else DAEMONSET)
        token = bound_token(agent_installed, pod)
        kubeconfig = token_kubeconfig(agent_installed, token, short_tmp("dp-kc") / "agent.kubeconfig")
        grace, debounce = f"{AGENT_GRACE_SECONDS:g}s", f"{AGENT_DEBOUNCE_SECONDS:g}s"
        flags = ["--grace-period", grace, "--nodedevices-debounce", debounce, *extra]
        return node, deviceplane_agent(kubeconfig=kubeconfig, node_name=node, extra=flags, **kw)

    return start
