"""The control plane is real: the apiserver validates CRD schemas; controllers run DaemonSets and garbage-collect."""

from __future__ import annotations

import json
import os

import pytest

from .cluster import Cluster, KubectlError
from .procs import wait_for

GROUP = "e2e.deviceplane.io"


def widget_crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["size"],
                                    "properties": {
                                        "size": {"type": "integer", "minimum": 1, "maximum": 10},
                                        "color": {"type": "string", "enum": ["red", "blue"]},
                                    },
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def test_crd_established_and_schema_enforced(cluster: Cluster, namespace: str) -> None:
    cluster.apply(widget_crd())
    try:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{GROUP}", "--timeout=60s")
        crd = cluster.get_json("crd", f"widgets.{GROUP}")
        assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])

        good = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "ok", "namespace": namespace}}
        cluster.apply({**good, "spec": {"size": 3, "color": "red"}})
        got = cluster.get_json("widget", "ok", "-n", namespace)
        assert got["spec"] == {"size": 3, "color": "red"}

        bad = {**good, "metadata": {"name": "too-big", "namespace": namespace}, "spec": {"size": 100}}
        with pytest.raises(KubectlError) as err:
            cluster.apply(bad)
        assert "spec.size" in err.value.stderr, err.value.stderr
        assert "less than or equal to 10" in err.value.stderr, err.value.stderr

        wrong_enum = {
            **good,
            "metadata": {"name": "green", "namespace": namespace},
            "spec": {"size": 1, "color": "green"},
        }
        with pytest.raises(KubectlError) as err:
            cluster.apply(wrong_enum)
        assert "spec.color" in err.value.stderr, err.value.stderr

        missing = {**good, "metadata": {"name": "nosize", "namespace": namespace}, "spec": {"color": "blue"}}
        with pytest.raises(KubectlError) as err:
            cluster.apply(missing)
        assert "spec.size" in err.value.stderr and "Required" in err.value.stderr, err.value.stderr

        names = cluster.kubectl("get", "widgets", "-n", namespace, "-o", "jsonpath={.items[*].metadata.name}").split()
        assert names == ["ok"], "a rejected object was stored"
    finally:
        cluster.kubectl("delete", "crd", f"widgets.{GROUP}", "--ignore-not-found", "--wait=false", check=False)


def test_daemonset_runs_on_three_kwok_nodes_and_is_garbage_collected(
    cluster: Cluster, kwok_nodes, namespace: str
) -> None:
    tag = os.urandom(3).hex()
    nodes = kwok_nodes(3, prefix="ds", labels={"e2e-ds": tag})
    owner = json.loads(
        cluster.kubectl("create", "configmap", "ds-owner", "-n", namespace, "--from-literal=a=b", "-o", "json")
    )
    ds = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": "e2e-ds",
            "namespace": namespace,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "ds-owner", "uid": owner["metadata"]["uid"]}
            ],
        },
        "spec": {
            "selector": {"matchLabels": {"app": "e2e-ds"}},
            "template": {
                "metadata": {"labels": {"app": "e2e-ds"}},
                "spec": {
                    "nodeSelector": {"e2e-ds": tag},
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "c", "image": "registry.invalid/none:1"}],
                },
            },
        },
    }
    cluster.apply(ds)

    def running_nodes() -> set[str]:
        pods = cluster.get_json("pods", "-n", namespace, "-l", "app=e2e-ds")["items"]
        return {p["spec"].get("nodeName", "") for p in pods if p["status"].get("phase") == "Running"}

    wait_for("3 DaemonSet pods Running on the 3 kwok nodes", lambda: running_nodes() == set(nodes), timeout=120)
    pods = cluster.get_json("pods", "-n", namespace, "-l", "app=e2e-ds")["items"]
    assert len(pods) == 3
    status = cluster.get_json("daemonset", "e2e-ds", "-n", namespace)["status"]
    assert status["desiredNumberScheduled"] == 3

    cluster.kubectl("delete", "configmap", "ds-owner", "-n", namespace)

    def ds_gone() -> bool:
        out = cluster.kubectl("get", "daemonset", "-n", namespace, "-o", "name")
        return "e2e-ds" not in out

    wait_for("the garbage collector to delete the DaemonSet owned by the deleted ConfigMap", ds_gone, timeout=120)
    wait_for(
        "the DaemonSet's pods to be garbage-collected",
        lambda: cluster.get_json("pods", "-n", namespace, "-l", "app=e2e-ds")["items"] == [],
        timeout=120,
    )
