"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok.

All built from Go modules by `make k8s-bins` (tests/k8s/build.sh); every server listens on 127.0.0.1 only, on
ports picked at run time. See shared/spec/k8s-test-env.md.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.procs import free_port
from tests.support.required import unavailable

from .pki import ClusterPKI
from .procs import Proc, Procs, wait_for

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tests" / "k8s" / "build.sh"
CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "kwok-stages.yaml",
)
KWOK_NODE_LABEL = "deviceplane.io/kwok"  # kwok manages nodes carrying this label (=true)


# Mutating requests by service accounts (the control plane's own components use admin certificates): tests count
# what an identity such as deviceplane's operator writes. Metadata level, so the log stays small.
AUDIT_SERVICE_ACCOUNT_WRITES = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {
            "level": "Metadata",
            "userGroups": ["system:serviceaccounts"],
            "verbs": ["create", "update", "patch", "delete", "deletecollection"],
        },
        {"level": "None"},
    ],
}


def bin_dir() -> Path:
    """Where `make k8s-bins` puts (or put) the binaries for this checkout's pins."""
    override = os.environ.get("DEVICEPLANE_K8S_BIN")
    if override:
        return Path(override)
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True, text=True, check=True, timeout=60
    )
    return Path(out.stdout.strip())


def built_binary(name: str) -> Path:
    """The built binary `name` (`make k8s-bins`); the test is unavailable without it (tests.support.required)."""
    try:
        path = bin_dir() / name
    except (OSError, subprocess.SubprocessError) as exc:
        unavailable(f"cannot locate the Kubernetes test binaries ({exc}): run `make k8s-bins`")
    if not os.access(path, os.X_OK):
        unavailable(f"{path} is missing: run `make k8s-bins`")
    return path


def missing_binaries(directory: Path, names: Sequence[str]) -> list[str]:
    return [n for n in names if not os.access(directory / n, os.R_OK if n.endswith(".yaml") else os.X_OK)]


class KubectlError(RuntimeError):
    def __init__(self, args: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.args_ = list(args)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"kubectl {' '.join(args)} exited {returncode}: {stderr.strip()}")


def _has_default_route() -> bool:
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(line.split()[1] == "00000000" for line in lines if len(line.split()) > 1)


@dataclass
class Cluster:
    bin: Path
    workdir: Path
    procs: Procs
    pki: ClusterPKI | None = None
    apiserver_port: int = 0
    kubeconfig: Path = field(default=Path())
    started: list[Proc] = field(default_factory=list)
    admin_ssl: ssl.SSLContext | None = None  # the admin client certificate, for direct API requests
    audit_policy: Mapping[str, Any] | None = None  # opt-in: an audit.k8s.io/v1 Policy; events go to audit_log
    apiserver_args: Sequence[str] = ()  # more kube-apiserver flags (e.g. admission plugins)

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def audit_events(self) -> list[dict[str, Any]]:
        """The audit events logged so far (one JSON object per line), oldest first."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        self.pki = pki = ClusterPKI.create(w / "pki")

        etcd_client, etcd_peer = free_port(), free_port()
        etcd = self.procs.start(
            "etcd",
            [
                str(self.bin / "etcd"),
                "--name=default",
                f"--data-dir={w / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self.started.append(etcd)
        wait_for("etcd /health", lambda: http_ok(f"http://127.0.0.1:{etcd_client}/health"), procs=[etcd], timeout=60)

        self.apiserver_port = free_port()
        args = [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            f"--cert-dir={w / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_crt}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.client_ca_crt}",
            f"--secure-port={self.apiserver_port}",
            "--bind-address=127.0.0.1",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--disable-admission-plugins=ServiceAccount",
            "--authorization-mode=RBAC",
            f"--service-account-issuer=https://127.0.0.1:{self.apiserver_port}/",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--endpoint-reconciler-type=none",
            "--v=1",
            *self.apiserver_args,
        ]
        if self.audit_policy is not None:
            (w / "audit-policy.json").write_text(json.dumps(self.audit_policy))
            args += [f"--audit-policy-file={w / 'audit-policy.json'}", f"--audit-log-path={self.audit_log}"]
            args += ["--audit-log-format=json", "--audit-log-mode=blocking"]
        if not _has_default_route():
            # The apiserver derives its advertise address from the default-route interface and rejects loopback.
            # Nothing connects to it here; it only fills the `kubernetes` Service's endpoints.
            args.append("--advertise-address=10.255.255.1")
        apiserver = self.procs.start("kube-apiserver", args)
        self.started.append(apiserver)
        self.kubeconfig = pki.kubeconfig(self.server, "admin", ("system:masters",), path=w / "admin.kubeconfig")
        self.admin_ssl = ssl.create_default_context(cafile=str(pki.ca_crt))
        self.admin_ssl.load_cert_chain(*(str(f) for f in pki.user_files("admin")))
        wait_for(
            "kube-apiserver /readyz", lambda: self.get_raw("/readyz") == "ok", procs=[etcd, apiserver], timeout=120
        )

        cm = self.procs.start(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--secure-port=0",
                "--leader-elect=false",
                f"--root-ca-file={pki.ca_crt}",
                f"--service-account-private-key-file={pki.sa_key}",
                "--controllers=daemonset-controller,garbage-collector-controller,namespace-controller,"
                "serviceaccount-controller,serviceaccount-token-controller",
                "--concurrent-gc-syncs=5",
                "--v=1",
            ],
        )
        self.started.append(cm)
        sched_port = free_port()
        sched = self.procs.start(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                "--v=1",
            ],
        )
        self.started.append(sched)
        kwok = self.procs.start(
            "kwok",
            [
                str(self.bin / "kwok"),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={self.bin / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-label-selector={KWOK_NODE_LABEL}=true",
                "--node-ip=127.0.0.1",
                "--node-lease-duration-seconds=40",
                "--server-address=",
                "--cidr=10.0.0.1/24",
            ],
        )
        self.started.append(kwok)
        # The default ServiceAccount shows up once the serviceaccount controller runs: proof the CM is up.
        wait_for(
            "the controller-manager to create the default ServiceAccount",
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default", "-o", "name", check=False)
                .strip()
                .endswith("default")
            ),
            procs=self.started,
            timeout=90,
        )

    def stop(self) -> None:
        for proc in reversed(self.started):
            self.procs.stop(proc)
        self.started.clear()

    # ---- API access -------------------------------------------------------------------------------------------

    def get_raw(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.server + path, context=self.admin_ssl, timeout=5) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Run the built kubectl with the admin kubeconfig; return stdout, raise KubectlError on failure."""
        cmd = [str(self.bin / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=60)
        if check and res.returncode != 0:
            raise KubectlError(args, res.returncode, res.stdout, res.stderr)
        return res.stdout

    def apply(self, obj: Mapping[str, Any]) -> str:
        # As JSON: YAML from PyYAML leaves strings such as "123e45" unquoted, which the apiserver reads as numbers.
        return self.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    # ---- kwok nodes -------------------------------------------------------------------------------------------

    def create_node(self, name: str, *, labels: Mapping[str, str] | None = None) -> None:
        """Create a Node kwok keeps Ready, with the given labels."""
        self.create_nodes([name], labels=labels)

    def create_nodes(self, names: Sequence[str], *, labels: Mapping[str, str] | None = None) -> None:
        """Create Nodes kwok keeps Ready, with the given labels: up to 500 in one request."""
        for start in range(0, len(names), 500):
            nodes = [_kwok_node(name, labels) for name in names[start : start + 500]]
            # The apiserver keeps the status sent with a Node's create (unlike most kinds): no status patch needed.
            self.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))

    def node_ready(self, name: str) -> bool:
        node = self.get_json("node", name)
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    def wait_nodes_ready(self, names: Sequence[str], timeout: float = 60) -> None:
        wait_for(
            f"nodes {list(names)} Ready (kwok)",
            lambda: all(self.node_ready(n) for n in names),
            procs=self.started,
            timeout=timeout,
        )


class NotReady(Exception):
    """A probe answered, and said why it is not ready."""


def probe_ok(url: str) -> bool:
    """True if GET url answers 200; raises NotReady with the answer's text on an HTTP error (so a wait that times out
    says why), False when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except urllib.error.HTTPError as err:
        raise NotReady(f"{err.code}: {err.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError):
        return False


def http_ok(url: str) -> bool:
    """True if GET url answers 200 (local plain-HTTP servers); False on any error."""
    try:
        return probe_ok(url)
    except NotReady:
        return False


def http_json(url: str, *, method: str = "GET", body: Any = None, timeout: float = 10) -> Any:
    """GET/POST JSON over plain HTTP (local test servers); raises urllib.error.HTTPError on >= 400."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode() or "null")


# On in OpenShift and in hardened clusters: changing an existing object's ownerReferences needs `delete` on it.
ENFORCE_OWNER_REFERENCES = "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"


def serve_cluster(
    k8s_bin: Path, directory: Path, procs: Procs, apiserver_args: Sequence[str] = ()
) -> Iterator[Cluster]:
    """For a fixture (`yield from`): a control plane, its service accounts' writes audited, stopped afterwards (also
    when its start fails half-way)."""
    started = Cluster(
        k8s_bin, directory, procs, audit_policy=AUDIT_SERVICE_ACCOUNT_WRITES, apiserver_args=apiserver_args
    )
    try:
        started.start()
    except BaseException:
        started.stop()
        raise
    yield started
    started.stop()


def _kwok_node(name: str, labels: Mapping[str, str] | None) -> dict[str, Any]:
    cap = {"cpu": "32", "memory": "256Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                KWOK_NODE_LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **(labels or {}),
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {"capacity": cap, "allocatable": cap},
    }


def denying_policy(
    name: str, rule: Mapping[str, Any], denies: str, message: str, reason: str, match: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy refusing the requests of `rule` (a resourceRule) for which the CEL `denies` holds,
    with `message` and `reason`, and its Deny binding (limited by `match`, its matchResources): a real refusal by the
    API server, for the paths that handle one. Apply both; delete both by `name`."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [dict(rule)]},
            "validations": [{"expression": f"!({denies})", "message": message, "reason": reason}],
        },
    }
    binding_spec: dict[str, Any] = {"policyName": name, "validationActions": ["Deny"]}
    if match is not None:
        binding_spec["matchResources"] = dict(match)
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": binding_spec,
    }
    return [policy, binding]
