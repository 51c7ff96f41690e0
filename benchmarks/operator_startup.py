"""The operator starting in a cluster of many nodes, each running a plugin pod: its CPU and RSS until it has
reconciled.

Starts the real control plane (tests/e2e/cluster.py, binaries from `make k8s-bins`), --nodes kwok nodes and one
DevicePluginConfig selecting all of them; a first operator creates its DaemonSet and is stopped once every pod runs
(kwok makes them Running). Then, per round, a fresh `python -m deviceplane operator` (the manifests' ServiceAccount
identity) starts beside those nodes and pods: CPU (user + system) and RSS are read when its first reconciliation is
counted (`deviceplane_operator_reconcile_total`), and again 10 s later (what the startup goes on costing).

    python benchmarks/operator_startup.py [--nodes 1000,3000] [--rounds 2] [--source DIR ...]

`--source DIR` runs the operator of another checkout (e.g. `git archive <commit> | tar -x -C DIR`); given more than
once, the checkouts' operators start in turn in each round, for an A/B in the same cluster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import KWOK_NODE_LABEL, Cluster, bin_dir  # noqa: E402
from tests.e2e.procs import Proc, Procs, wait_for  # noqa: E402
from tests.support.procs import cpu_seconds, free_port, rss_mib  # noqa: E402

OPERATOR_USER = "system:serviceaccount:deviceplane-system:deviceplane-operator"
OPERATOR_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:deviceplane-system")
NAMESPACE = "bench"


def create_nodes(cluster: Cluster, count: int) -> None:
    """kwok nodes, then the not-ready taint lifted (the node-lifecycle controller is not run)."""
    cluster.create_nodes([f"bench-{i:05d}" for i in range(count)])
    wait_for(f"{count} nodes Ready", lambda: ready_nodes(cluster) >= count, procs=cluster.started, timeout=900,
             interval=2)  # fmt: skip
    cluster.kubectl("taint", "nodes", "-l", f"{KWOK_NODE_LABEL}=true", "node.kubernetes.io/not-ready:NoSchedule-")


def ready_nodes(cluster: Cluster) -> int:
    nodes = cluster.get_json("nodes", "-l", f"{KWOK_NODE_LABEL}=true")["items"]
    return sum(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
               for n in nodes)  # fmt: skip


def start_operator(cluster: Cluster, procs: Procs, kubeconfig: Path, source: Path) -> tuple[Proc, str]:
    health, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "deviceplane", "operator", "--kubeconfig", str(kubeconfig),
            "--liveness", f"http://127.0.0.1:{health}/healthz", "--metrics-addr", f"127.0.0.1:{metrics}"]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH", "")) if p)}
    return procs.start("deviceplane-operator", argv, cwd=source, env=env), f"http://127.0.0.1:{metrics}/metrics"


def reconciles(metrics_url: str) -> float:
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    lines = text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("deviceplane_operator_reconcile_total"))


def daemonset_ready(cluster: Cluster, count: int) -> bool:
    try:
        status = cluster.get_json("daemonset", "all-plugin", "-n", NAMESPACE).get("status") or {}
    except Exception:
        return False
    return int(status.get("numberReady", 0)) >= count


def measure(cluster: Cluster, procs: Procs, kubeconfig: Path, source: Path) -> tuple[float, float, float, float, float]:
    started = time.monotonic()
    proc, url = start_operator(cluster, procs, kubeconfig, source)
    wait_for("the operator's first reconciliation", lambda: reconciles(url) >= 1, procs=[proc], timeout=600,
             interval=0.2)  # fmt: skip
    wall, cpu, rss = time.monotonic() - started, cpu_seconds(proc.pid), rss_mib(proc.pid)
    time.sleep(10)
    cpu_later, rss_later = cpu_seconds(proc.pid), rss_mib(proc.pid)
    procs.stop(proc)
    return wall, cpu, rss, cpu_later, rss_later


def run(count: int, rounds: int, sources: list[Path]) -> None:
    """A cluster of `count` nodes, each with its plugin pod Running, and `rounds` operator starts timed in it."""
    work = Path(tempfile.mkdtemp(prefix="dp-bench-opstart-"))
    procs = Procs(work / "logs")
    cluster = Cluster(bin_dir(), work / "cluster", procs)
    try:
        cluster.start()
        create_nodes(cluster, count)
        cluster.kubectl("apply", "-f", str(ROOT / "manifests"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/devicepluginconfigs.deviceplane.io")
        cluster.kubectl("create", "namespace", NAMESPACE)
        assert cluster.pki is not None
        kubeconfig = cluster.pki.kubeconfig(cluster.server, OPERATOR_USER, OPERATOR_GROUPS,
                                            path=work / "op.kubeconfig")  # fmt: skip
        cluster.apply({
            "apiVersion": "deviceplane.io/v1alpha1", "kind": "DevicePluginConfig",
            "metadata": {"name": "all", "namespace": NAMESPACE},
            "spec": {"resourceName": "example.com/all", "image": "localhost/deviceplane:0.1.0",
                     "args": ["plugin", "sim"], "nodeSelector": {KWOK_NODE_LABEL: "true"}},
        })  # fmt: skip
        first, _ = start_operator(cluster, procs, kubeconfig, ROOT)
        wait_for(f"{count} plugin pods Ready", lambda: daemonset_ready(cluster, count), procs=[first],
                 timeout=1800, interval=2)  # fmt: skip
        time.sleep(5)  # the last status write lands
        procs.stop(first)
        for _ in range(rounds):
            for source in sources:  # in turn, so drifting machine load spreads over all
                wall, cpu, rss, cpu_later, rss_later = measure(cluster, procs, kubeconfig, source)
                print(f"{source}: {count} nodes + {count} plugin pods: first reconcile after {wall:.1f} s, "
                      f"CPU {cpu:.1f} s, RSS {rss:.0f} MiB; 10 s later CPU {cpu_later:.1f} s, RSS {rss_later:.0f} MiB",
                      flush=True)  # fmt: skip
    finally:
        cluster.stop()
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,3000", help="comma-separated node counts [%(default)s]")
    parser.add_argument("--rounds", type=int, default=2, help="operator starts per node count [%(default)s]")
    parser.add_argument("--source", type=Path, action="append", help="checkout whose operator runs (repeatable: "
                        "alternated in each round) [this one]")  # fmt: skip
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the control plane is stopped on the way out
    sources = [s.resolve() for s in args.source or [ROOT]]
    counts = [int(x) for x in args.nodes.split(",")]
    print(f"operators from {', '.join(map(str, sources))}; load average at start {os.getloadavg()[0]:.1f}")
    for count in counts:
        run(count, args.rounds, sources)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
