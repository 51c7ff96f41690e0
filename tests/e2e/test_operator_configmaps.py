"""What ConfigMaps no config refers to cost the operator, against the real control plane: 2000 of them exist when it
starts (it watches ConfigMaps cluster-wide to hash those configs reference), and it still reconciles a config
referring to another within a few CPU seconds, with that ConfigMap's hash, and rolls it when that ConfigMap
changes.

With a kopf index over ConfigMaps, kopf kept a readiness toggle per ConfigMap at startup and woke every waiting one
at each change: the first reconcile came after ~14 s of CPU for 2000 ConfigMaps (31 s for 3000). The operator runs
as a process with the manifests' ServiceAccount RBAC, as in test_operator.py; this module's own, cluster-wide."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplane.operator.names import CONFIG_HASH_ANNOTATION
from deviceplane.operator.render import configmap_hash
from tests.support.procs import cpu_seconds, rss_mib

from .cluster import Cluster, serve_cluster
from .operator_proc import OPERATOR_GROUPS, OPERATOR_USER, Operator
from .procs import Procs, wait_for
from .test_operator import installed

__all__ = ["installed"]  # a fixture, re-used on this module's cluster

UNRELATED = 2000
CPU_BUDGET = 6.0  # seconds of the operator's CPU, Python's start included (~1 s), until the config is reconciled


@pytest.fixture(scope="module")
def cluster(k8s_bin: Path, procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own (~10 s to start): its 2000 ConfigMaps, left to the namespace controller
    at its end, must not load the shared control plane for the modules after it."""
    yield from serve_cluster(k8s_bin, tmp_path_factory.mktemp("cluster-configmaps"), procs)


def create_unrelated_configmaps(cluster: Cluster, namespace: str, count: int) -> None:
    for start in range(0, count, 500):
        items = [
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"unrelated-{i}", "namespace": namespace},
             "data": {"blob": "x" * 1024}}
            for i in range(start, min(start + 500, count))
        ]  # fmt: skip
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump({"apiVersion": "v1", "kind": "List", "items": items}, f)
            f.flush()
            cluster.kubectl("apply", "--server-side", "-f", f.name)


def template_hash(cluster: Cluster, namespace: str) -> str | None:
    try:
        ds = cluster.get_json("daemonset", "cm-plugin", "-n", namespace)
    except Exception:
        return None
    annotations: dict[str, Any] = ds["spec"]["template"]["metadata"].get("annotations") or {}
    return annotations.get(CONFIG_HASH_ANNOTATION)


@pytest.fixture
def operator_after_configmaps(
    installed: Cluster, procs: Procs, namespace: str, tmp_path: Path
) -> Iterator[tuple[Operator, str]]:
    """The unrelated ConfigMaps, the referenced one and its config, then the operator started."""
    cluster = installed
    create_unrelated_configmaps(cluster, namespace, UNRELATED)
    cluster.kubectl("create", "configmap", "plugin-config", "-n", namespace, "--from-literal=devices=4")
    tag = os.urandom(3).hex()
    cluster.apply({
        "apiVersion": "deviceplane.io/v1alpha1", "kind": "DevicePluginConfig",
        "metadata": {"name": "cm", "namespace": namespace},
        "spec": {"resourceName": f"example.com/cm-{tag}", "image": "localhost/deviceplane:0.1.0",
                 "nodeSelector": {f"e2e-none-{tag}": "1"}, "configMapRef": {"name": "plugin-config"}},
    })  # fmt: skip
    assert cluster.pki is not None
    kubeconfig = cluster.pki.kubeconfig(cluster.server, OPERATOR_USER, OPERATOR_GROUPS, path=tmp_path / "op.kubeconfig")
    op = Operator(cluster, procs, kubeconfig)
    op.start()
    try:
        yield op, namespace
    finally:
        op.stop()
        cluster.kubectl("delete", "dpc", "cm", "-n", namespace, "--ignore-not-found", "--wait=true")


def test_unrelated_configmaps_cost_the_operator_little_and_the_referenced_one_is_hashed(
    operator_after_configmaps: tuple[Operator, str],
) -> None:
    op, namespace = operator_after_configmaps
    cluster = op.cluster
    assert op.proc is not None
    pid = op.proc.pid
    expected = configmap_hash({"devices": "4"}, None)
    wait_for("the config's DaemonSet with its ConfigMap's hash", lambda: template_hash(cluster, namespace) == expected,
             procs=[op.proc], timeout=120)  # fmt: skip
    spent = cpu_seconds(pid)
    print(f"operator CPU until reconciled: {spent:.2f} s; RSS {rss_mib(pid):.0f} MiB")
    assert spent < CPU_BUDGET, f"{spent:.1f} s of CPU to reconcile one config beside {UNRELATED} ConfigMaps"
    status = cluster.get_json("dpc", "cm", "-n", namespace).get("status") or {}
    degraded = next(c for c in status.get("conditions", []) if c["type"] == "Degraded")
    assert degraded["reason"] == "AsExpected", degraded

    cluster.kubectl("patch", "configmap", "plugin-config", "-n", namespace, "--type=merge",
                    "-p", '{"data":{"devices":"8"}}')  # fmt: skip
    changed = configmap_hash({"devices": "8"}, None)
    wait_for("the ConfigMap's change to reach the pod template", lambda: template_hash(cluster, namespace) == changed,
             procs=[op.proc], timeout=30)  # fmt: skip
