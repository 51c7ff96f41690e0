"""The operator at scale: 200 DevicePluginConfigs over 50 kwok nodes on the real control plane.

Starts etcd, kube-apiserver, controller-manager, scheduler and kwok (tests/e2e/cluster.py, binaries from
`make k8s-bins`), 50 kwok nodes, `kubectl apply -f manifests/`, and `python -m deviceplane operator` as a real
process with the operator's ServiceAccount identity. Then creates the configs (each its own resource, 4 nodes
each, nodes chosen round-robin by label) and measures:

- time until every DaemonSet exists, and until every config's status is Ready (pods Running on kwok nodes);
- mutating requests per minute at rest, from the apiserver's audit log (target 0), over --rest seconds;
- the operator's resident memory.

    python benchmarks/operator.py [--configs 200] [--nodes 50] [--rest 60]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import AUDIT_SERVICE_ACCOUNT_WRITES, Cluster, bin_dir  # noqa: E402
from tests.e2e.operator_proc import OPERATOR_USER, Operator  # noqa: E402
from tests.e2e.procs import Procs, wait_for  # noqa: E402

LABEL = "bench.deviceplane.io/group"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--nodes-per-config", type=int, default=4)
    parser.add_argument("--rest", type=float, default=60.0, help="seconds of steady state to count writes over")
    args = parser.parse_args()
    groups = max(1, args.nodes // args.nodes_per_config)

    work = Path(tempfile.mkdtemp(prefix="dp-bench-operator-"))
    procs = Procs(work / "logs")
    cluster = Cluster(bin_dir(), work / "cluster", procs, audit_policy=AUDIT_SERVICE_ACCOUNT_WRITES)
    try:
        t0 = time.monotonic()
        cluster.start()
        print(f"control plane up in {time.monotonic() - t0:.1f} s")
        nodes = [f"bench-{i:03d}" for i in range(args.nodes)]
        for i, name in enumerate(nodes):
            cluster.create_node(name, labels={LABEL: str(i % groups)})
        cluster.wait_nodes_ready(nodes, timeout=180)
        for name in nodes:  # what the node-lifecycle controller (not run here) does once a node is Ready
            cluster.kubectl("taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-", check=False)
        cluster.kubectl("apply", "-f", str(ROOT / "manifests"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/devicepluginconfigs.deviceplane.io")
        cluster.kubectl("create", "namespace", "bench")
        assert cluster.pki is not None
        kubeconfig = cluster.pki.kubeconfig(cluster.server, OPERATOR_USER, ("system:serviceaccounts",))
        op = Operator(cluster, procs, kubeconfig)
        op.start()
        assert op.proc is not None

        items = [
            {
                "apiVersion": "deviceplane.io/v1alpha1",
                "kind": "DevicePluginConfig",
                "metadata": {"name": f"c{i:03d}", "namespace": "bench"},
                "spec": {
                    "resourceName": f"example.com/bench-{i:03d}",
                    "image": "localhost/deviceplane:0.1.0",
                    "args": ["plugin", "sim"],
                    "nodeSelector": {LABEL: str(i % groups)},
                },
            }
            for i in range(args.configs)
        ]
        start = time.monotonic()
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        applied = time.monotonic() - start

        def daemonsets() -> int:
            return len(cluster.get_json("daemonsets", "-n", "bench")["items"])

        wait_for(
            f"{args.configs} DaemonSets",
            lambda: daemonsets() == args.configs,
            procs=[op.proc],
            timeout=600,
            interval=0.5,
        )
        all_ds = time.monotonic() - start

        def ready() -> int:
            return sum(
                any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (d.get("status") or {}).get("conditions", [])
                )
                for d in cluster.get_json("dpc", "-n", "bench")["items"]
            )

        wait_for(
            f"{args.configs} configs Ready", lambda: ready() == args.configs, procs=[op.proc], timeout=900, interval=1.0
        )
        all_ready = time.monotonic() - start
        pods = len(cluster.get_json("pods", "-n", "bench")["items"])
        writes_total = len(op.writes())
        time.sleep(5)  # the last status writes land
        before = len(op.writes())
        time.sleep(args.rest)
        at_rest = len(op.writes()) - before
        print(f"configs: {args.configs}, kwok nodes: {args.nodes}, plugin pods: {pods}")
        print(f"kubectl apply of all configs: {applied:.1f} s")
        print(f"every DaemonSet exists after: {all_ds:.1f} s")
        print(f"every config Ready after: {all_ready:.1f} s")
        print(f"operator writes until Ready: {writes_total} ({writes_total / args.configs:.1f} per config)")
        print(f"mutating requests at rest: {at_rest} in {args.rest:.0f} s ({at_rest * 60 / args.rest:.1f}/min)")
        print(f"operator RSS: {rss_mib(op.proc.pid):.0f} MiB")
        op.stop()
    finally:
        cluster.stop()
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
