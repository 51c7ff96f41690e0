"""Helpers for the cluster-mode agent tests: installing the agent's manifests, pod-bound tokens, direct API calls."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cluster import REPO, Cluster, KubectlError
from .procs import wait_for

NAMESPACE = "deviceplane-system"
SERVICE_ACCOUNT = "deviceplane-agent"
DAEMONSET = "deviceplane-agent"
PROXY_DAEMONSET = "deviceplane-agent-proxy"  # runs on the nodes labelled PROXY_LABEL=proxy
PROXY_LABEL = "deviceplane.io/agent-mode"
# The node agents the `node_agent` fixture starts: NodeDevices debounce and plugin grace period.
AGENT_DEBOUNCE_SECONDS = 1.0
AGENT_GRACE_SECONDS = 4.0
CRDS = REPO / "crds"
MANIFESTS = REPO / "manifests"


def install(cluster: Cluster) -> None:
    """The CRDs, then `kubectl apply -f manifests/` (namespace, RBAC, policy, DaemonSet)."""
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/nodedevices.deviceplane.io")
    try:
        cluster.kubectl("create", "namespace", NAMESPACE)
    except KubectlError as err:
        if "AlreadyExists" not in err.stderr:
            raise
    cluster.kubectl("apply", "-f", str(MANIFESTS))


def api(
    cluster: Cluster, method: str, path: str, body: Any = None, token: str | None = None, content_type: str = ""
) -> tuple[int, Any]:
    """A request as admin (client certificate) or with a bearer token: (HTTP status, decoded JSON body)."""
    assert cluster.pki is not None
    headers = {"Content-Type": content_type or "application/json"}
    if token is not None:
        context = ssl.create_default_context(cafile=str(cluster.pki.ca_crt))
        headers["Authorization"] = f"Bearer {token}"
    else:
        context = cluster.admin_ssl  # type: ignore[assignment]
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(cluster.server + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def get(cluster: Cluster, path: str) -> dict[str, Any] | None:
    status, body = api(cluster, "GET", path)
    if status == 404:
        return None
    assert status == 200, (status, body)
    return dict(body)


def node_status(cluster: Cluster, node: str) -> dict[str, dict[str, str]]:
    obj = get(cluster, f"/api/v1/nodes/{node}")
    assert obj is not None, f"node {node} not found"
    return {k: dict(obj["status"].get(k) or {}) for k in ("capacity", "allocatable")}


def node_devices(cluster: Cluster, node: str) -> dict[str, Any] | None:
    return get(cluster, f"/apis/deviceplane.io/v1alpha1/nodedevices/{node}")


def daemonset_pod(cluster: Cluster, node: str, daemonset: str = DAEMONSET) -> str:
    """The name of the agent DaemonSet's (or `daemonset`'s) pod on `node`, once it is bound there."""
    found: list[str] = []

    def bound() -> bool:
        pods = cluster.get_json(
            "pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={daemonset}", "--field-selector",
            f"spec.nodeName={node}",
        )["items"]  # fmt: skip
        found[:] = [p["metadata"]["name"] for p in pods]
        return bool(found)

    wait_for(f"the {daemonset} DaemonSet's pod on {node}", bound, timeout=60)
    return found[0]


def bound_token(cluster: Cluster, pod: str) -> str:
    """A TokenRequest for the agent's ServiceAccount bound to `pod` (the API server adds the pod's node)."""
    out = cluster.kubectl(
        "create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE, "--bound-object-kind", "Pod", "--bound-object-name", pod,
        "--duration", "2h",
    )  # fmt: skip
    return out.strip()


def token_kubeconfig(cluster: Cluster, token: str, path: Path) -> Path:
    """A kubeconfig that authenticates with `token` only (no client certificate)."""
    assert cluster.pki is not None
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.pki.ca_crt)}}
        ],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "agent", "context": {"cluster": "c", "user": "agent"}}],
        "current-context": "agent",
    }
    path.write_text(json.dumps(config))
    return path


@dataclass
class Stopwatch:
    """How long a condition took to come true, for the figures a test prints (never asserted on)."""

    started: float = 0.0

    def start(self) -> None:
        self.started = time.monotonic()

    def until(self, what: str, check: Callable[[], bool], timeout: float = 30.0, **kw: Any) -> float:
        wait_for(what, check, timeout=timeout, interval=0.05, **kw)
        took = time.monotonic() - self.started
        print(f"[figure] {what}: {took:.3f} s")
        return took
