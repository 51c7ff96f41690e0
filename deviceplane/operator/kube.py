"""The few API requests the operator makes, through the official client (blocking calls kept off the event loop).

Responses are returned as plain JSON dicts (camelCase, as the API serves them), like the watch bodies kopf gives us.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from deviceplane.api import dpc
from deviceplane.kube_client_config import client_configuration
from deviceplane.kube_pool import PoolDrop
from deviceplane.operator.names import ConfigKey

__all__ = ["ApiException", "KubeApi", "load_client", "request_of"]

REQUEST_TIMEOUT = 30.0  # seconds, to connect and again to read an answer
# A failed request's exception carries what it was for as a note (PEP 678): the reconciler names the call in the
# status it writes, and a traceback shows it too. A note, not a wrapper exception: callers keep matching on
# ApiException and its status (404, 409).
_WHILE = "while "


def request_of(exc: BaseException) -> str:
    """What the operator was doing when `exc` was raised by a KubeApi request, e.g. "listing ConfigMaps in ns named
    x" ("a request" for an exception that did not come from one)."""
    notes = getattr(exc, "__notes__", None) or ()
    return next((n.removeprefix(_WHILE) for n in notes if n.startswith(_WHILE)), "a request")


def load_client(kubeconfig: str | None) -> client.ApiClient:
    """A client from the kubeconfig file, else the in-cluster service account, else $KUBECONFIG/~/.kube/config;
    urllib3's own retries off (the reconciler's backoff is the retry: deviceplane.kube_client_config)."""
    configuration = client_configuration()
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig, client_configuration=configuration)
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        return config.new_client_from_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def _uids(answer: Mapping[str, Any]) -> set[str]:
    return {str(item["metadata"]["uid"]) for item in answer.get("items") or []}


class KubeApi:
    def __init__(self, api_client: client.ApiClient, request_timeout: float = REQUEST_TIMEOUT) -> None:
        self._request_timeout = request_timeout
        self._pool_drop = PoolDrop(api_client.rest_client.pool_manager)
        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    async def create_daemonset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        return await self._json(f"creating DaemonSet {ns}/{name}", self._apps.create_namespaced_daemon_set, ns, body)

    async def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]:
        """Read one DaemonSet directly: for one the label-filtered watch does not show (its labels edited by hand)."""
        return await self._json(
            f"reading DaemonSet {namespace}/{name}", self._apps.read_namespaced_daemon_set, name, namespace
        )

    async def replace_daemonset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        return await self._json(
            f"replacing DaemonSet {ns}/{name}", self._apps.replace_namespaced_daemon_set, name, ns, body
        )

    async def find_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One ConfigMap, None if it does not exist: a list by name (the RBAC grants list, not get, on ConfigMaps)."""
        answer = await self._json(
            f"listing ConfigMaps in {namespace} named {name}",
            lambda ns, **kw: self._core.list_namespaced_config_map(ns, field_selector=f"metadata.name={name}", **kw),
            namespace,
        )
        items = answer.get("items") or []
        return dict(items[0]) if items else None

    async def list_node_uids(self) -> set[str]:
        answer = await self._json("listing Nodes", lambda **kw: self._core.list_node(**kw))
        return _uids(answer)

    async def list_pod_uids(self, label_selector: str, namespaces: tuple[str, ...] = ()) -> set[str]:
        """The uids of the pods with these labels, in `namespaces` (none: all)."""
        if not namespaces:
            answer = await self._json(
                f"listing pods labelled {label_selector}",
                lambda **kw: self._core.list_pod_for_all_namespaces(label_selector=label_selector, **kw),
            )
            return _uids(answer)
        uids: set[str] = set()
        for namespace in namespaces:
            uids |= _uids(
                await self._json(
                    f"listing pods in {namespace} labelled {label_selector}",
                    lambda ns, **kw: self._core.list_namespaced_pod(ns, label_selector=label_selector, **kw),
                    namespace,
                )
            )
        return uids

    async def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]:
        """core/v1 Events in a namespace matching a field selector (e.g. one object's FailedCreate events)."""
        answer = await self._json(
            f"listing Events in {namespace} ({field_selector})",
            lambda ns, **kw: self._core.list_namespaced_event(ns, field_selector=field_selector, **kw),
            namespace,
        )
        return list(answer.get("items") or [])

    async def patch_status(self, key: ConfigKey, status_patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch of the status subresource (null deletes a field)."""
        return await self._json(
            f"patching the status of DevicePluginConfig {key.namespace}/{key.name}",
            self._custom.patch_namespaced_custom_object_status,
            dpc.GROUP,
            dpc.VERSION,
            key.namespace,
            dpc.PLURAL,
            key.name,
            {"status": status_patch},
        )

    async def _json(self, doing: str, call: Any, *args: Any) -> dict[str, Any]:
        """Send one request (`doing`: what it is for, noted on its exception; see request_of)."""

        def run() -> dict[str, Any]:
            with self._pool_drop:  # the request and its body's read
                response = call(*args, _preload_content=False, _request_timeout=self._request_timeout)
                body = response.data
            return dict(json.loads(body or b"{}"))

        try:
            return await asyncio.to_thread(run)
        except Exception as exc:
            exc.add_note(f"{_WHILE}{doing}")
            raise
