"""The agent's Kubernetes API access: client setup (kubeconfig or in-cluster) and the few blocking calls it makes.

The official `kubernetes` client is used (DESIGN): the agent makes a handful of small requests (a status patch per
change, one watch), so a blocking client called off the event loop (`off_loop`) costs nothing measurable and keeps
the official client's auth plugins (exec, in-cluster token refresh for rotating bound tokens). Objects are read and
written as plain dicts (`_preload_content=False`): no model (de)serialisation, and the pod parser sees exactly what
the API server sent, as it sees static pod files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from deviceplane.agent.kube.errors import KubeError, ResourceExpired
from deviceplane.kube_client_config import client_configuration
from deviceplane.kube_pool import NETWORK_ERRORS, PoolDrop

GROUP = "deviceplane.io"
VERSION = "v1alpha1"
NODE_DEVICES_PLURAL = "nodedevices"
FIELD_MANAGER = "deviceplane-agent"
# (connect, read) seconds: a hung API server costs a request at most this long, and the agent's shutdown too.
REQUEST_TIMEOUT = (5.0, 15.0)
# A watch's longest silence (urllib3 applies it to each socket read): the API server sends a bookmark about once a
# minute (the first up to 120 s after the watch starts in an idle cluster), so 130 s (two intervals and slack)
# without a byte means the connection is dead (a lost NAT entry, a peer gone without a FIN). Independent of the
# watch's server-side timeout, which bounds a healthy watch, not a dead one.
WATCH_READ_TIMEOUT = 130.0
MERGE_PATCH = "application/merge-patch+json"
WRITE_OPTIONS: dict[str, Any] = {
    "field_manager": FIELD_MANAGER,
    "_request_timeout": REQUEST_TIMEOUT,
    "_preload_content": False,
}
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

T = TypeVar("T")

# The client's config loaders and line iterator carry no annotations: typed here once.
_new_client_from_config: Callable[..., k8s.ApiClient] = k8s_config.new_client_from_config
_load_incluster_config: Callable[..., None] = k8s_config.load_incluster_config
_iter_resp_lines: Callable[[Any], Iterator[str]] = iter_resp_lines


def api_client(kubeconfig: Path | None) -> k8s.ApiClient:
    """A client from `kubeconfig`, or the in-cluster ServiceAccount (token re-read as the kubelet rotates it)."""
    configuration = client_configuration()  # urllib3 retries nothing: backoff.py is the one retry
    try:
        if kubeconfig is not None:
            return _new_client_from_config(
                config_file=str(kubeconfig), persist_config=False, client_configuration=configuration
            )
        _load_incluster_config(client_configuration=configuration)
        return k8s.ApiClient(configuration)
    except (k8s_config.ConfigException, OSError, ValueError) as err:
        where = str(kubeconfig) if kubeconfig is not None else "in-cluster config"
        raise KubeError(f"cannot load {where}: {err}") from err


def _describe(err: ApiException) -> str:
    try:
        message = json.loads(err.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{err.status} {err.reason}: {message or (err.body or '')[:500]}"


# With _preload_content=False a request returns once the headers are in: the body is read here, inside `_call`, so
# a connection cut while it arrives is a KubeError too (it escaped as urllib3's ProtocolError).
def _json(response: Any) -> Any:
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


def _drain(response: Any) -> None:
    # Read to the end before the connection goes back to the pool. Left unread, the next request took a new
    # connection (urllib3 sees the bytes waiting) or failed with ResponseNotReady (bytes already buffered), which
    # its retries, now off, had hidden.
    _ = response.data
    response.release_conn()


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]


class KubeApi:
    """The blocking requests the agent makes. Call them through `off_loop`."""

    def __init__(self, client: k8s.ApiClient) -> None:
        self.client = client
        # Any: every call is made with _preload_content=False and answers a raw urllib3 response, not the model
        # its type hints name.
        self.core: Any = k8s.CoreV1Api(client)
        self.custom: Any = k8s.CustomObjectsApi(client)
        self.host = str(client.configuration.host)
        self._pool_drop = PoolDrop(client.rest_client.pool_manager)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one request, its body read included; any failure becomes a KubeError saying what was attempted. A
        failure of the network drops the connection pool (deviceplane/kube_pool.py)."""
        try:
            with self._pool_drop:
                return fn()
        except ApiException as err:
            raise KubeError(f"{what}: {_describe(err)}", err.status or 0) from err
        except Exception as err:  # urllib3/ssl/socket errors, a body that does not parse
            raise KubeError(f"{what}: {type(err).__name__}: {err}") from err

    def _read(self, what: str, fn: Callable[[], Any]) -> dict[str, Any] | None:
        """A GET: the object, or None when it does not exist."""
        try:
            return dict(self._call(what, lambda: _json(fn())))
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def _write(self, what: str, fn: Callable[[], Any]) -> None:
        self._call(what, lambda: _drain(fn()))

    def version(self) -> str:
        body = self._call(
            f"GET {self.host}/version",
            lambda: _json(
                k8s.VersionApi(self.client).get_code(_request_timeout=REQUEST_TIMEOUT, _preload_content=False)
            ),
        )
        return str(body.get("gitVersion", "?"))

    # -- nodes ------------------------------------------------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any] | None:
        return self._read(
            f"get node {name}",
            lambda: self.core.read_node(name, _request_timeout=REQUEST_TIMEOUT, _preload_content=False),
        )

    def patch_node_status(self, name: str, patch: dict[str, Any]) -> None:
        """A strategic merge patch of the Node's status: map keys not in `patch` are left alone."""
        self._write(
            f"patch node {name} status",
            lambda: self.core.patch_node_status(name, patch, _content_type=STRATEGIC_MERGE_PATCH, **WRITE_OPTIONS),
        )

    # -- NodeDevices ------------------------------------------------------------------------------------------------

    def get_node_devices(self, name: str) -> dict[str, Any] | None:
        return self._read(
            f"get nodedevices {name}",
            lambda: self.custom.get_cluster_custom_object(
                GROUP, VERSION, NODE_DEVICES_PLURAL, name, _request_timeout=REQUEST_TIMEOUT, _preload_content=False
            ),
        )

    def create_node_devices(self, body: dict[str, Any]) -> None:
        self._write(
            f"create nodedevices {body['metadata']['name']}",
            lambda: self.custom.create_cluster_custom_object(
                GROUP, VERSION, NODE_DEVICES_PLURAL, body, **WRITE_OPTIONS
            ),
        )

    def patch_node_devices_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the status; the object as stored (its metadata tells whether it still has its owner)."""
        return dict(
            self._call(
                f"patch nodedevices {name} status",
                lambda: _json(self.custom.patch_cluster_custom_object_status(
                    GROUP, VERSION, NODE_DEVICES_PLURAL, name, {"status": status}, _content_type=MERGE_PATCH,
                    **WRITE_OPTIONS,
                )),
            )
        )  # fmt: skip

    def patch_node_devices(self, name: str, patch: dict[str, Any]) -> None:
        """A merge patch of the object (its metadata: the ownerReference restored)."""
        self._write(
            f"patch nodedevices {name}",
            lambda: self.custom.patch_cluster_custom_object(
                GROUP, VERSION, NODE_DEVICES_PLURAL, name, patch, _content_type=MERGE_PATCH, **WRITE_OPTIONS
            ),
        )

    # -- pods and events --------------------------------------------------------------------------------------------

    def list_pods(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """Every pod bound to `node`, and the list's resourceVersion (to watch from)."""
        body = self._call(
            f"list pods on {node}",
            lambda: _json(
                self.core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node}",
                    _request_timeout=(REQUEST_TIMEOUT[0], 60.0),
                    _preload_content=False,
                )
            ),
        )
        return list(body.get("items") or []), str(body["metadata"]["resourceVersion"])

    def watch_pods(
        self, node: str, resource_version: str, timeout_seconds: int, read_timeout: float = WATCH_READ_TIMEOUT
    ) -> Iterator[WatchEvent]:
        """Changes to pods on `node` after `resource_version`, until the server ends the watch (timeout_seconds).

        Raises ResourceExpired when the version is too old (410), KubeError on other errors: the request's, and the
        stream's (the connection cut, or silent for `read_timeout` seconds)."""
        what = f"watch pods on {node}"
        response = self._call(
            what,
            lambda: self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}",
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=resource_version,
                timeout_seconds=timeout_seconds,
                _request_timeout=(REQUEST_TIMEOUT[0], read_timeout),
                _preload_content=False,
            ),
        )
        try:
            with self._pool_drop:  # around the stream's read too: its read timeout is raised there, not by `_call`
                yield from watch_events(what, response)
        finally:
            # A stream left before its end is closed by urllib3 as its generator is (it never goes back reusable).
            response.release_conn()

    def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        """Raises KubeError with status 409 when an event of that name exists."""
        self._write(
            f"create event {namespace}/{body['metadata']['name']}",
            lambda: self.core.create_namespaced_event(
                namespace, body, _request_timeout=REQUEST_TIMEOUT, _preload_content=False
            ),
        )

    def get_event(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._read(
            f"get event {namespace}/{name}",
            lambda: self.core.read_namespaced_event(
                name, namespace, _request_timeout=REQUEST_TIMEOUT, _preload_content=False
            ),
        )

    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A merge patch of the event (its count, lastTimestamp and message)."""
        self._write(
            f"patch event {namespace}/{name}",
            lambda: self.core.patch_namespaced_event(
                name, namespace, patch, _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT,
                _preload_content=False,
            ),
        )  # fmt: skip


def decode_event(line: str, what: str) -> dict[str, Any]:
    """One watch event line: {"type": str, "object": dict}; anything else is a KubeError (the watch restarts)."""
    try:
        event = json.loads(line)
    except ValueError as err:
        raise KubeError(f"{what}: undecodable event: {err}") from None
    if not (isinstance(event, dict) and isinstance(event.get("type"), str) and isinstance(event.get("object"), dict)):
        raise KubeError(f"{what}: malformed event: {line[:200]}")
    return event


def watch_events(what: str, response: Any) -> Iterator[WatchEvent]:
    """The events of a watch's streamed response; an ERROR event is raised (ResourceExpired for a 410)."""
    for line in stream_lines(what, response):
        event = decode_event(line, what)
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            code = int(obj.get("code") or 0)
            message = f"{what}: {code} {obj.get('reason')}: {obj.get('message')}"
            raise ResourceExpired(message, 410) if code == 410 else KubeError(message, code)
        yield WatchEvent(str(kind), obj)


def stream_lines(what: str, response: Any) -> Iterator[str]:
    """The non-empty lines of a streamed response. An error reading it (the connection cut, a read timeout) is a
    KubeError, as the request's own are: it escapes from the iteration, where `_call` around the generator's
    creation never saw it."""
    lines = _iter_resp_lines(response)
    while True:
        try:
            line = next(lines, None)
        except NETWORK_ERRORS as err:
            raise KubeError(f"{what}: {type(err).__name__}: {err}") from err
        if line is None:
            return
        if line:
            yield line
