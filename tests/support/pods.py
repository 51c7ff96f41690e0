"""Helpers for allocation tests: static pod files, the agent's pod view, and a PodResources client."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc
from tests.support.procs import AgentProcess, wait_for


def container(name: str, limits: Mapping[str, int] | None = None, restart_policy: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": name, "image": "busybox"}
    if limits:
        spec["resources"] = {"limits": {k: str(v) for k, v in limits.items()}}
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    return spec


def pod_manifest(
    name: str,
    containers: Sequence[dict[str, Any]],
    init: Sequence[dict[str, Any]] = (),
    uid: str | None = None,
    phase: str | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        metadata["uid"] = uid
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": list(containers)},
    }
    if init:
        obj["spec"]["initContainers"] = list(init)
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def write_pod(directory: Path, file_name: str, manifest: Mapping[str, Any] | str) -> Path:
    """Atomically (temp file + rename, as editors and config tools do) so the agent never sees half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    temp = directory / f".{file_name}.tmp"
    temp.write_text(text)
    os.replace(temp, directory / file_name)
    return directory / file_name


def simple_pod(directory: Path, name: str, resource: str, count: int = 1, **kw: Any) -> Path:
    return write_pod(directory, f"{name}.json", pod_manifest(name, [container("main", {resource: count})], **kw))


def pods(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    """The agent's /api/v1/pods by pod name (invalid files by their source)."""
    return {p["name"] or p["source"]: p for p in agent.get("/api/v1/pods")}


def wait_settled(agent: AgentProcess, name: str, timeout: float = 20.0) -> dict[str, Any]:
    """Until the pod's admission has finished (admitted or failed), then its view."""

    def check() -> dict[str, Any] | None:
        pod = pods(agent).get(name)
        return pod if pod is not None and pod["state"] in ("admitted", "failed", "terminated") else None

    return wait_for(check, timeout=timeout, what=f"pod {name} admission to finish")


def devices_of(pod: Mapping[str, Any], resource: str) -> set[str]:
    return {d for c in pod["containers"] for d in c["devices"].get(resource, [])}


class PodResourcesClient:
    def __init__(self, socket_path: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.stub = pr_grpc.PodResourcesListerStub(self.channel)

    def list(self) -> pr.ListPodResourcesResponse:
        return self.stub.List(pr.ListPodResourcesRequest(), timeout=5)

    def get(self, namespace: str, name: str) -> pr.GetPodResourcesResponse:
        return self.stub.Get(pr.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=5)

    def allocatable(self) -> pr.AllocatableResourcesResponse:
        return self.stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()


def listed_devices(response: pr.ListPodResourcesResponse) -> dict[tuple[str, str, str], dict[str, set[str]]]:
    """{(namespace, pod, container): {resource: {ids}}} from a List answer."""
    out: dict[tuple[str, str, str], dict[str, set[str]]] = {}
    for pod in response.pod_resources:
        for ctr in pod.containers:
            held = out.setdefault((pod.namespace, pod.name, ctr.name), {})
            for dev in ctr.devices:
                held.setdefault(dev.resource_name, set()).update(dev.device_ids)
    return out
