"""e2e fixtures: a real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), kwok nodes,
kubectl, the real Go device plugins, the kubelet device-manager harness and the deviceplane agent.

Binaries come from `make k8s-bins` (tests/k8s/build.sh). Without them the e2e tests skip, naming that command,
unless DEVICEPLANE_E2E=required (CI), where they fail. Every process runs in its own process group, is killed at
teardown (also when a test fails), and the session ends by asserting none is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .cluster import CONTROL_PLANE_BINARIES, REPO, Cluster, bin_dir, http_json, missing_binaries, versions
from .procs import Proc, Procs, free_port, wait_for

REQUIRED = os.environ.get("DEVICEPLANE_E2E", "") == "required"
KUBELET_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # hard-coded in sample-device-plugin


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: needs the real Kubernetes binaries built by `make k8s-bins`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


def unavailable(reason: str) -> None:
    """Skip, or fail when DEVICEPLANE_E2E=required."""
    if REQUIRED:
        pytest.fail(f"{reason} (DEVICEPLANE_E2E=required)", pytrace=False)
    pytest.skip(reason)


# ---- binaries and processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def k8s_bin() -> Path:
    try:
        directory = bin_dir()
    except (OSError, subprocess.SubprocessError) as exc:
        unavailable(f"cannot locate the Kubernetes test binaries ({exc}): run `make k8s-bins`")
        raise
    missing = missing_binaries(directory, CONTROL_PLANE_BINARIES)
    if missing:
        unavailable(f"Kubernetes test binaries missing in {directory} ({', '.join(missing)}): run `make k8s-bins`")
    return directory


def need_binary(k8s_bin: Path, name: str) -> Path:
    path = k8s_bin / name
    if not os.access(path, os.X_OK):
        note = versions(k8s_bin).get(name, "")
        if note.startswith("unavailable"):
            # build.sh deliberately did not build it (recorded in VERSIONS): not a missing build step.
            pytest.skip(f"{name} {note}")
        unavailable(f"{name} missing in {k8s_bin}: run `make k8s-bins`")
    return path


@pytest.fixture(scope="session")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    """Every process the e2e fixtures start. At session end: all stopped, and none may be left."""
    registry = Procs(tmp_path_factory.mktemp("logs"))
    yield registry
    registry.stop_all()
    left = registry.leftovers()
    if left:
        for pid, _pgid, _cmd in left:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        pytest.fail(f"processes left behind by the e2e session: {left}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _session_process_check(procs: Procs) -> Iterator[None]:
    # Autouse so the leftover check (in `procs`' teardown) runs after every other session fixture is gone.
    yield


# ---- the cluster ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cluster(k8s_bin: Path, procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(k8s_bin, tmp_path_factory.mktemp("cluster"), procs)
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    yield c
    c.stop()


@pytest.fixture(scope="session")
def kubectl(cluster: Cluster) -> Callable[..., str]:
    """kubectl("get", "nodes", input=None, check=True) -> stdout; raises KubectlError (with stderr) on failure."""
    return cluster.kubectl


@pytest.fixture
def kwok_nodes(cluster: Cluster) -> Iterator[Callable[..., list[str]]]:
    """Factory: kwok_nodes(3, prefix="ds", labels={...}, capacity={"example.com/x": 4}) -> Ready node names."""
    created: list[str] = []

    def make(
        count: int = 1,
        *,
        prefix: str = "kwok-node",
        labels: Mapping[str, str] | None = None,
        capacity: Mapping[str, str | int] | None = None,
        annotations: Mapping[str, str] | None = None,
        wait_ready: bool = True,
    ) -> list[str]:
        names = []
        for _ in range(count):
            name = f"{prefix}-{len(created)}-{os.urandom(3).hex()}"
            cluster.create_node(name, labels=labels, capacity=capacity, annotations=annotations)
            created.append(name)
            names.append(name)
        if wait_ready:
            cluster.wait_nodes_ready(names)
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
    """Factory: start squat/generic-device-plugin registering at <plugin_dir>/kubelet.sock."""
    started: list[Proc] = []

    def start(plugin_dir: Path, *, devices: Sequence[str] = (), domain: str = "squat.ai") -> Proc:
        exe = need_binary(k8s_bin, "generic-device-plugin")
        devices = devices or ['{"name":"null","groups":[{"count":4,"paths":[{"path":"/dev/null"}]}]}']
        argv = [
            str(exe),
            "--plugin-directory",
            str(plugin_dir),
            "--domain",
            domain,
            "--listen",
            f"127.0.0.1:{free_port()}",
        ]
        for d in devices:
            argv += ["--device", d]
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

    def start(plugin_dir: Path, *, env: Mapping[str, str] | None = None) -> Proc:
        exe = need_binary(k8s_bin, "sample-device-plugin")
        why = can_bind_mount()
        if why:
            pytest.skip(f"sample-device-plugin {why}")
        KUBELET_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)  # the mount point (empty on this machine)
        script = f'mount --bind "$0" {KUBELET_PLUGIN_DIR} && exec "$1"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(plugin_dir), str(exe)]
        full_env = {"PLUGIN_SOCK_DIR": str(KUBELET_PLUGIN_DIR), **(env or {})}
        p = procs.start("sample-device-plugin", argv, env=full_env)
        started.append(p)
        return p

    yield start
    for p in started:
        procs.stop(p)


# ---- the kubelet device-manager harness -------------------------------------------------------------------------


@dataclass
class Harness:
    proc: Proc
    url: str
    socket_dir: Path

    def capacity(self) -> dict[str, Any]:
        return dict(http_json(self.url + "/capacity"))

    def admit(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        return dict(http_json(self.url + "/admit", method="POST", body=pod))

    def remove(self, uid: str) -> dict[str, Any]:
        return dict(http_json(self.url + "/remove", method="POST", body={"uid": uid}))

    def pods(self) -> list[dict[str, Any]]:
        return list(http_json(self.url + "/pods"))


@pytest.fixture
def kubelet_harness(k8s_bin: Path, procs: Procs) -> Iterator[Callable[..., Harness]]:
    """Factory: start the real kubelet device manager on <socket_dir>/kubelet.sock; returns a Harness client."""
    started: list[Proc] = []

    def start(socket_dir: Path, *, numa_nodes: int = 1, policy: str = "none", scope: str = "container") -> Harness:
        exe = need_binary(k8s_bin, "kubelet-harness")
        port = free_port()
        p = procs.start(
            "kubelet-harness",
            [
                str(exe),
                f"--socket-dir={socket_dir}",
                f"--http=127.0.0.1:{port}",
                f"--numa-nodes={numa_nodes}",
                f"--topology-policy={policy}",
                f"--topology-scope={scope}",
            ],
        )
        started.append(p)
        h = Harness(p, f"http://127.0.0.1:{port}", socket_dir)
        wait_for("kubelet-harness /healthz", lambda: _get_ok(h.url + "/healthz"), procs=[p], timeout=30)
        wait_for("kubelet-harness registration socket", (socket_dir / "kubelet.sock").exists, procs=[p], timeout=30)
        return h

    yield start
    for p in started:
        procs.stop(p)


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# ---- deviceplane (the code under test) --------------------------------------------------------------------------


def deviceplane_cli_available(*args: str) -> str | None:
    """None if `python -m deviceplane <args> --help` works; else why not (the feature has not landed yet)."""
    try:
        res = subprocess.run(
            [sys.executable, "-m", "deviceplane", *args, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if res.returncode != 0:
        return (res.stderr or res.stdout).strip().splitlines()[-1:][0] if (res.stderr or res.stdout).strip() else "?"
    return None


@dataclass
class Agent:
    proc: Proc
    url: str
    plugin_dir: Path
    pod_resources_socket: Path
    pod_manifest_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def devices(self) -> dict[str, Any]:
        return dict(http_json(self.url + "/api/v1/devices"))

    def pods(self) -> list[dict[str, Any]]:
        data = http_json(self.url + "/api/v1/pods")
        return list(data["pods"] if isinstance(data, dict) and "pods" in data else data)

    def resource(self, name: str) -> dict[str, Any] | None:
        for r in self.devices().get("resources", []):
            if r.get("name") == name:
                return dict(r)
        return None


@pytest.fixture
def deviceplane_agent(procs: Procs, short_tmp: Callable[[str], Path]) -> Iterator[Callable[..., Agent]]:
    """Factory: start `python -m deviceplane agent --standalone ...` on a fresh plugin dir; returns an Agent."""
    started: list[Proc] = []

    def start(
        plugin_dir: Path | None = None, *, pod_manifest_dir: Path | None = None, extra_args: Sequence[str] = ()
    ) -> Agent:
        why = deviceplane_cli_available("agent")
        if why:
            pytest.skip(f"`python -m deviceplane agent` is not available yet: {why}")
        plugin_dir = plugin_dir or short_tmp("dp-plugins")
        pr_dir = short_tmp("dp-podres")
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "deviceplane",
            "agent",
            "--standalone",
            "--plugin-dir",
            str(plugin_dir),
            "--pod-resources-socket",
            str(pr_dir / "kubelet.sock"),
            "--http-addr",
            f"127.0.0.1:{port}",
        ]
        if pod_manifest_dir is not None:
            argv += ["--pod-manifest-dir", str(pod_manifest_dir)]
        argv += list(extra_args)
        p = procs.start("deviceplane-agent", argv, cwd=REPO)
        started.append(p)
        agent = Agent(p, f"http://127.0.0.1:{port}", plugin_dir, pr_dir / "kubelet.sock", pod_manifest_dir)
        wait_for("deviceplane agent /api/v1/devices", lambda: bool(agent.devices() is not None), procs=[p], timeout=60)
        wait_for("deviceplane agent kubelet.sock", (plugin_dir / "kubelet.sock").exists, procs=[p], timeout=30)
        return agent

    yield start
    for p in started:
        procs.stop(p)


@pytest.fixture
def sim_plugin(procs: Procs) -> Iterator[Callable[..., Proc]]:
    """Factory: start our SDK's `sim` plugin (`python -m deviceplane plugin sim ...`) against <plugin_dir>."""
    started: list[Proc] = []

    def start(plugin_dir: Path, *, resource: str = "example.com/sim", count: int = 4, numa: int = 2) -> Proc:
        why = deviceplane_cli_available("plugin", "sim")
        if why:
            pytest.skip(f"`python -m deviceplane plugin sim` is not available yet: {why}")
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
