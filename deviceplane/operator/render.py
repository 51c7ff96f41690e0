"""DevicePluginConfig → its plugin DaemonSet (pure). The hash of the result goes into an annotation, so the
reconciler updates the DaemonSet only when our rendering changes, never because the API server filled in defaults."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deviceplane.api import corev1, dpc
from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator import names
from deviceplane.operator.names import ConfigKey

REGISTRATION_VOLUME = dpc.REGISTRATION_VOLUME
CONFIG_VOLUME = dpc.CONFIG_VOLUME
CONTAINER_NAME = corev1.PLUGIN_CONTAINER_NAME
SECURE_DEFAULT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
HOST_DIRS = {"kubelet": dpc.KUBELET_PLUGIN_DIR, "agent": dpc.AGENT_PLUGIN_DIR}


@dataclass(frozen=True)
class Owner:
    """The DevicePluginConfig the DaemonSet belongs to (ownerReference: deleting it garbage-collects the DS)."""

    key: ConfigKey
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{dpc.GROUP}/{dpc.VERSION}",
            "kind": dpc.KIND,
            "name": self.key.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def stable_hash(value: Any, length: int = 16) -> str:
    """Hash of a JSON value, independent of key order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def configmap_hash(data: Mapping[str, Any] | None, binary_data: Mapping[str, Any] | None) -> str:
    return stable_hash({"data": dict(data or {}), "binaryData": dict(binary_data or {})})


def selector_labels(key: ConfigKey) -> dict[str, str]:
    return {names.MANAGED_BY_LABEL: names.MANAGED_BY, names.CONFIG_LABEL: key.name}


def render_daemonset(
    owner: Owner,
    spec: DevicePluginConfigSpec,
    *,
    config_hash: str | None = None,
    excluded_nodes: Iterable[str] = (),
) -> dict[str, Any]:
    """The DaemonSet for a config. `excluded_nodes` (yielded to an older config) are kept out by node affinity."""
    labels = {names.NAME_LABEL: names.PLUGIN_APP, **selector_labels(owner.key)}
    template_annotations = {names.CONFIG_HASH_ANNOTATION: config_hash} if spec.configMapRef is not None else {}
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": owner.key.daemonset,
            "namespace": owner.key.namespace,
            "labels": labels,
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.key)},
            "updateStrategy": _update_strategy(spec),
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    **({"annotations": template_annotations} if template_annotations else {}),
                },
                "spec": _pod_spec(spec, sorted(set(excluded_nodes))),
            },
        },
    }
    body["metadata"]["annotations"] = {names.RENDER_HASH_ANNOTATION: stable_hash(body)}
    return body


def _update_strategy(spec: DevicePluginConfigSpec) -> dict[str, Any]:
    strategy = spec.updateStrategy
    if strategy.type == "OnDelete":
        return {"type": "OnDelete"}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": strategy.maxUnavailable}}


def _pod_spec(spec: DevicePluginConfigSpec, excluded_nodes: list[str]) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {
            "name": REGISTRATION_VOLUME,
            "hostPath": {"path": HOST_DIRS[spec.target], "type": "DirectoryOrCreate"},
        }
    ]
    mounts: list[dict[str, Any]] = [{"name": REGISTRATION_VOLUME, "mountPath": dpc.KUBELET_PLUGIN_DIR}]
    for extra in spec.volumes:
        host_path: dict[str, Any] = {"path": extra.hostPath}
        if extra.type:
            host_path["type"] = extra.type
        volumes.append({"name": extra.name, "hostPath": host_path})
        mount: dict[str, Any] = {"name": extra.name, "mountPath": extra.mountPath}
        if extra.readOnly:
            mount["readOnly"] = True  # the API server drops `false`: rendering it would look like drift
        mounts.append(mount)
    if spec.configMapRef is not None:
        volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": spec.configMapRef.name}})
        mounts.append({"name": CONFIG_VOLUME, "mountPath": spec.configMapRef.mountPath, "readOnly": True})

    env: list[dict[str, Any]] = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    # A resourceFieldRef divisor dumps as a string, as the client requires (api.corev1.Quantity).
    env += [e.model_dump(exclude_none=True) for e in spec.env if e.name != "NODE_NAME"]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": spec.securityContext.model_dump(exclude_none=True)
        if spec.securityContext is not None
        else copy.deepcopy(SECURE_DEFAULT),
    }
    if spec.imagePullPolicy:
        container["imagePullPolicy"] = spec.imagePullPolicy
    if spec.command:
        container["command"] = list(spec.command)
    if spec.args:
        container["args"] = list(spec.args)
    if spec.resources is not None:
        resources = spec.resources.model_dump(exclude_none=True)  # quantities dump as strings (api.corev1.Quantity)
        if resources:
            container["resources"] = resources

    pod: dict[str, Any] = {
        "priorityClassName": spec.priorityClassName,
        "automountServiceAccountToken": False,  # plugins talk to the kubelet's socket, not to the API server
        "containers": [container],
        "volumes": volumes,
    }
    if spec.nodeSelector:
        pod["nodeSelector"] = dict(spec.nodeSelector)
    if spec.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    if spec.imagePullSecrets:
        pod["imagePullSecrets"] = [s.model_dump() for s in spec.imagePullSecrets]
    if excluded_nodes:
        term = _excluding_term(excluded_nodes)
        pod["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
        }
    return pod


def _excluding_term(nodes: list[str]) -> dict[str, Any]:
    """The one node selector term keeping `nodes` out.

    matchFields on metadata.name names nodes exactly (the hostname label need not equal the name), but the API
    server takes only one value per metadata.name requirement, so each node gets its own NotIn requirement; the
    requirements of a term are ANDed.
    """
    return {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in nodes]}
