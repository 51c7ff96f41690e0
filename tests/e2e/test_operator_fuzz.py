"""DevicePluginConfigs drawn by hypothesis, through the real API server (the CRD's schema and CEL rules) to the real
operator: every object the API server takes is acted on and reported, none crashes the operator or disturbs
another config.

For each example: `kubectl apply` of a random spec (fields the CRD has, with values from plausible to hostile:
quantities, label keys, paths, volume names the operator uses itself, securityContext numbers, unicode). If the API
server refuses it, nothing is stored. If it takes it, the operator must write a status for its generation within a
bound, with the three conditions, and a DaemonSet the API server takes: the CRD refuses at `kubectl apply` what the
pod a DaemonSet makes may not have (docs/operator.md lists it; each rule was found here: before, such a config was
taken and its status said, later, `DaemonSetRejected`; a request above its limit was the last, refused since by a
CEL rule comparing quantities), so no taken config may have its DaemonSet refused. A config paused before it had a
DaemonSet gets none; one whose ConfigMap is missing says so. The operator stays alive, logs no traceback, counts no
internal failure, and sends no write for the canary config made at the start, which stays Ready. Every spec selects
a label no node has, so examples cost no pods. Bounded in `make test` (60 examples, ~15 s); `DEVICEPLANE_FUZZ=long`
runs 3,000.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.support.fuzz import fuzz_settings

from .cluster import Cluster, KubectlError
from .operator_proc import Operator
from .procs import wait_for
from .test_operator import condition, delete_configs, dpc, installed, operator, tag

__all__ = ["installed", "operator"]  # fixtures, re-used from test_operator.py

STATUS_WITHIN = 30.0  # seconds for the operator to report a new generation (a loaded 2-core machine)
INTERNAL = 'deviceplane_operator_reconcile_failures_total{cause="internal"}'
NAMES = itertools.count()

# ---- values -----------------------------------------------------------------------------------------------------

unicode_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # JSON cannot carry lone surrogates
ascii_text = st.text(string.ascii_letters + string.digits + "-_./:% =", max_size=12)
some_text = ascii_text | unicode_text


def mostly(plausible: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Three draws in four from `plausible`: specs with one odd field reach the operator more often than specs with
    several, which the API server refuses whole."""
    return st.one_of(plausible, plausible, plausible, odd)


label_part = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,8}[a-z0-9])?", fullmatch=True)
label_key = mostly(label_part | st.builds(lambda p, n: f"{p}/{n}", label_part, label_part), some_text)
label_value = mostly(st.from_regex(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,6}[A-Za-z0-9])?)?", fullmatch=True), some_text)
quantity = mostly(
    st.sampled_from(["1", "0", "100m", "1.5", "1e3", "1Gi", "64Mi", "0.0001m", "9E18", ".5", "+1", "1e-3", "5k"])
    | st.integers(0, 10**6),
    st.sampled_from(["-1", "abc", "1.0.0", " 1", "1e999", "99999999999999999999999"])
    | st.integers(-3, 10**19)
    | some_text,
)
path = st.sampled_from(["/", "/dev", "/tmp", "/a/../b", "/var/lib/kubelet/device-plugins", "/etc/deviceplane"]) | (
    st.builds(lambda s: "/" + s, ascii_text)
)
volume_name = mostly(
    st.sampled_from(["dev", "a", "tmp", "sys"]) | label_part.filter(lambda n: "." not in n),
    st.sampled_from(["device-plugins", "plugin-config"]) | ascii_text,
)
resource_name = st.sampled_from(["example.com/gpu", "x.io/a", "requests.x/y", "kubernetes.io/gpu", "gpu"]) | (
    st.builds(lambda p, n: f"fz{p}.example.com/{n}", label_part, st.from_regex(r"[A-Za-z0-9]{1,70}", fullmatch=True))
)
plain_text = mostly(st.text(string.ascii_letters + string.digits + "-_./:", max_size=12), some_text)


field_path = st.sampled_from(
    ["spec.nodeName", "metadata.name", "metadata.namespace", "status.podIP", "metadata.labels['app']",
     "metadata.annotations['a']", "metadata.nonsense", "spec.nodeName ", ""]
)  # fmt: skip
resource_field = st.sampled_from(["limits.cpu", "requests.memory", "limits.ephemeral-storage", "limits.nothing", "cpu"])
key_text = mostly(st.from_regex(r"[-._a-zA-Z0-9]{1,12}", fullmatch=True), some_text)
env_source = st.one_of(
    st.builds(lambda f, v: {"fieldRef": {"fieldPath": f, **v}}, field_path,
              st.sampled_from([{}, {"apiVersion": "v1"}, {"apiVersion": "v2"}])),
    st.builds(lambda r, d, c: {"resourceFieldRef": {"resource": r, **d, **c}}, resource_field,
              st.sampled_from([{}, {"divisor": "1m"}, {"divisor": "1"}, {"divisor": "1Mi"}, {"divisor": "3"}]),
              st.sampled_from([{}, {"containerName": "plugin"}, {"containerName": "other"}])),
    st.builds(lambda n, k: {"configMapKeyRef": {"key": k, **n}}, st.sampled_from([{}, {"name": "cm"}]), key_text),
    st.builds(lambda n, k: {"secretKeyRef": {"key": k, **n}}, st.sampled_from([{}, {"name": "s"}]), key_text),
)  # fmt: skip
env_var = st.fixed_dictionaries(
    {"name": mostly(st.sampled_from(["NODE_NAME", "A", "a b", "1X", "x.y-z"]), some_text.filter(bool))},
    optional={"value": plain_text, "valueFrom": env_source},
)
toleration = st.fixed_dictionaries(
    {},
    optional={
        "key": label_key,
        "operator": st.sampled_from(["Exists", "Equal"]),
        "value": label_value,
        "effect": st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": st.integers(-(2**40), 2**40),
    },
)
volume = st.fixed_dictionaries(
    {"name": volume_name, "hostPath": path, "mountPath": path},
    optional={"readOnly": st.booleans(), "type": st.sampled_from(["", "Directory", "CharDevice", "Socket", "Nope"])},
)
profile = st.fixed_dictionaries(
    {"type": st.sampled_from(["RuntimeDefault", "Unconfined", "Localhost"])},
    optional={"localhostProfile": st.sampled_from(["", "p.json", "x"])},
)
security_context = st.fixed_dictionaries(
    {},
    optional={
        "runAsGroup": st.integers(-1, 2**31),
        "procMount": st.sampled_from(["Default", "Unmasked"]),
        "seccompProfile": profile,
        "appArmorProfile": profile,
        "seLinuxOptions": st.fixed_dictionaries({}, optional={"level": plain_text, "type": plain_text}),
        "privileged": st.booleans(),
        "runAsUser": st.integers(-(2**40), 2**40),
        "runAsNonRoot": st.booleans(),
        "readOnlyRootFilesystem": st.booleans(),
        "allowPrivilegeEscalation": st.booleans(),
        "capabilities": st.fixed_dictionaries(
            {},
            optional={
                "add": st.lists(
                    mostly(st.sampled_from(["SYS_ADMIN", "CAP_SYS_ADMIN", "NET_ADMIN"]), some_text), max_size=2
                ),
                "drop": st.lists(mostly(st.sampled_from(["ALL", "KILL"]), some_text), max_size=2),
            },
        ),
    },
)
spec_fields = st.fixed_dictionaries(
    {},
    optional={
        "resourceName": resource_name,
        "image": mostly(st.sampled_from(["localhost/deviceplane:0.1.0", "nginx", "a/b@sha256:00"]), some_text),
        "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"]),
        "imagePullSecrets": st.lists(st.fixed_dictionaries({"name": plain_text}), max_size=2),
        "command": st.lists(plain_text, max_size=3),
        "args": st.lists(plain_text, max_size=3),
        "env": st.lists(env_var, max_size=3),
        "resources": st.fixed_dictionaries(
            {},
            optional={
                "limits": st.dictionaries(
                    st.sampled_from(["cpu", "memory", "example.com/gpu"]) | label_key, quantity, max_size=2
                ),
                "requests": st.dictionaries(st.sampled_from(["cpu", "memory"]) | label_key, quantity, max_size=2),
            },
        ),
        "nodeSelector": st.dictionaries(label_key, label_value, max_size=2),
        "tolerations": st.lists(toleration, max_size=2),
        "priorityClassName": mostly(st.sampled_from(["system-node-critical", "does-not-exist"]), some_text),
        "updateStrategy": st.fixed_dictionaries(
            {},
            optional={
                "type": st.sampled_from(["RollingUpdate", "OnDelete"]),
                "maxUnavailable": st.integers(-2, 10**12) | st.sampled_from(["50%", "0%", "100%", "101%", "1", "x"]),
            },
        ),
        "target": st.sampled_from(["kubelet", "agent"]),
        "volumes": st.lists(volume, max_size=3),
        "configMapRef": st.fixed_dictionaries({"name": mostly(label_part, some_text)}, optional={"mountPath": path}),
        "securityContext": security_context,
        "paused": st.booleans(),
    },
)

# ---- the test -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def canary(operator: Operator, namespace_module: str) -> dict[str, Any]:
    """A valid config, Ready (on no node) before the examples start: its DaemonSet as it was then."""
    cluster = operator.cluster
    body = dpc("canary", namespace_module, "example.com/canary", nodeSelector={"e2e-fuzz-canary": tag()})
    cluster.apply(body)

    def ready() -> bool:
        return condition(cluster, namespace_module, "canary", "Ready").get("status") == "True"

    wait_for("the canary Ready", ready, procs=[operator.proc], timeout=STATUS_WITHIN)
    return cluster.get_json("daemonset", "canary-plugin", "-n", namespace_module)


def canary_writes(operator: Operator, namespace: str) -> int:
    """Mutating requests the operator sent for the canary's config or DaemonSet (the audit log)."""
    return sum(
        1
        for e in operator.writes()
        if e["objectRef"].get("namespace") == namespace and e["objectRef"].get("name") in ("canary", "canary-plugin")
    )


@pytest.fixture(scope="module")
def namespace_module(installed: Cluster) -> Iterator[str]:
    name = f"e2e-fz-{tag()}"
    installed.kubectl("create", "namespace", name)
    yield name
    installed.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def stored(cluster: Cluster, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


@fuzz_settings(bounded=60, long=3_000)
@given(spec_fields)
def test_any_config_the_api_server_takes_is_reported_and_disturbs_nothing(
    operator: Operator, namespace_module: str, canary: dict[str, Any], spec: dict[str, Any]
) -> None:
    cluster, namespace = operator.cluster, namespace_module
    assert operator.proc is not None
    name = f"fz-{next(NAMES)}"
    body = dpc(name, namespace, "example.com/fz")
    body["spec"].update(spec)
    body["spec"]["nodeSelector"] = {**body["spec"].get("nodeSelector", {}), "e2e-fuzz-none": tag()}
    internal_before = operator.metric(INTERNAL)
    log_before = operator.proc.log.stat().st_size
    canary_writes_before = canary_writes(operator, namespace)
    try:
        cluster.apply(body)
    except KubectlError as err:
        event("refused by the API server")
        assert err.stderr.strip(), "refused without a message"
        assert stored(cluster, "dpc", namespace, name) is None, "a refused config was stored"
        return
    try:
        config = stored(cluster, "dpc", namespace, name)
        assert config is not None
        generation = config["metadata"]["generation"]

        seen: list[dict[str, Any]] = []

        def status_for_generation() -> bool:
            status = (stored(cluster, "dpc", namespace, name) or {}).get("status") or {}
            seen[:] = [status]
            return status.get("observedGeneration") == generation

        wait_for(f"a status for generation {generation} of {json.dumps(body['spec'])}",
                 status_for_generation, procs=[operator.proc], timeout=STATUS_WITHIN)  # fmt: skip
        (status,) = seen
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        assert {"Ready", "Progressing", "Degraded"} <= set(conditions), status
        assert all(c["reason"] for c in conditions.values()), status
        daemonset = stored(cluster, "daemonset", namespace, f"{name}-plugin")
        degraded = conditions["Degraded"]
        event(f"taken: DaemonSet {'made' if daemonset else 'not made'}, Degraded {degraded['reason']}")
        if degraded["reason"] == "DaemonSetRejected":
            pytest.fail(f"the API server took the config and refused its DaemonSet: {degraded['message']}")
        if spec.get("paused"):
            assert daemonset is None, "a config paused before it had a DaemonSet got one"
        elif daemonset is None:
            assert degraded["status"] == "True" and degraded["message"], (
                f"no DaemonSet and no reason why: {json.dumps(status)} for {json.dumps(body['spec'])}"
            )
        # the operator lives, said nothing unexpected, and left the canary alone
        operator.proc.check_alive()
        assert operator.metric(INTERNAL) == internal_before, operator.proc.log_tail()
        with operator.proc.log.open("rb") as log:
            log.seek(log_before)
            assert b"Traceback" not in log.read(), operator.proc.log_tail(80)
        now = stored(cluster, "daemonset", namespace, "canary-plugin")
        assert now is not None and now["metadata"]["generation"] == canary["metadata"]["generation"]
        assert canary_writes(operator, namespace) == canary_writes_before, "the operator wrote to the canary"
        assert condition(cluster, namespace, "canary", "Ready").get("status") == "True"
    finally:
        delete_configs(cluster, namespace, name)  # its DaemonSet is left to the garbage collector
