"""kopf wiring (thin): kopf indexes (configs, DaemonSets) and event-handler caches (nodes, plugin pods, referenced
ConfigMaps) for what reconciliation reads, and event handlers that say which configs to reconcile. Event handlers and
indexes are silent in kopf: no annotations, no status writes, no finalizers, so the operator's only writes are the
reconciler's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from deviceplane.api import dpc
from deviceplane.debug_faults import install_block_signal
from deviceplane.loop_watchdog import LoopWatchdog
from deviceplane.operator import names
from deviceplane.operator.configmaps import ConfigMapHashes
from deviceplane.operator.conflicts import IdleCause, NodeInfo, Taint
from deviceplane.operator.listing import ListingGate, PodProblems
from deviceplane.operator.names import ConfigKey
from deviceplane.operator.reconciler import Reconciler, key_of
from deviceplane.operator.status import PodProblem, idle_cause, pod_problem

MANAGED = {names.MANAGED_BY_LABEL: names.MANAGED_BY}  # the label selector of what we create


def _slim(body: Mapping[str, Any]) -> dict[str, Any]:
    """What reconciliation needs of an object (managedFields dropped: they are most of its size)."""
    meta = dict(body.get("metadata") or {})
    meta.pop("managedFields", None)
    return {"metadata": meta, "spec": dict(body.get("spec") or {}), "status": dict(body.get("status") or {})}


def _first(store: Any) -> Any:
    for value in store or ():
        return value
    return None


@dataclass
class IndexView:
    """ClusterView over kopf's indexes (bound at startup; kopf fills them before any event handler runs) and the
    nodes and pods our event handlers keep (complete once `listed` is open: operator/listing.py)."""

    configmaps: ConfigMapHashes
    node_gate: ListingGate
    pod_gate: ListingGate
    indices: Mapping[str, Any] = field(default_factory=dict)
    node_infos: dict[str, NodeInfo] = field(default_factory=dict)
    pods: PodProblems = field(default_factory=PodProblems)

    async def listed(self) -> None:
        """Once every node and plugin pod the API server had when this began has been shown by the watches."""
        await asyncio.gather(self.node_gate.wait(), self.pod_gate.wait())

    def _index(self, name: str) -> Any:
        return self.indices[name]

    def config(self, key: ConfigKey) -> Mapping[str, Any] | None:
        return _first(self._index("dpc_index").get(key))

    def configs(self) -> Iterable[Mapping[str, Any]]:
        for store in list(self._index("dpc_index").values()):
            yield from store

    def nodes(self) -> Iterable[NodeInfo]:
        return list(self.node_infos.values())

    def daemonset(self, key: ConfigKey) -> Mapping[str, Any] | None:
        return _first(self._index("daemonset_index").get(key))

    def pod_problems(self, key: ConfigKey) -> Iterable[PodProblem]:
        return self.pods.of(key)

    async def configmap_hash(self, namespace: str, name: str) -> str | None:
        return await self.configmaps.hash(namespace, name)

    def configmap_referrers(self, namespace: str, name: str) -> list[ConfigKey]:
        """The configs whose configMapRef names this ConfigMap."""
        return list(self._index("configmap_refs").get((namespace, name)) or ())


@dataclass(frozen=True)
class _Placement:
    """What of a config decides who keeps which node, besides its selector: its resourceName, and whether (and why)
    it runs nowhere (from its spec and status)."""

    resource: str
    idle_cause: IdleCause


def node_info(body: Mapping[str, Any]) -> NodeInfo:
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    taints = tuple(
        Taint(key=t.get("key", ""), effect=t.get("effect", ""), value=t.get("value") or "")
        for t in spec.get("taints") or []
    )
    return NodeInfo(name=meta["name"], labels=dict(meta.get("labels") or {}), taints=taints)


def _owner_key(body: Mapping[str, Any]) -> ConfigKey | None:
    meta = body.get("metadata") or {}
    config = (meta.get("labels") or {}).get(names.CONFIG_LABEL)
    return ConfigKey(meta["namespace"], config) if config and meta.get("namespace") else None


def _daemonset_key(body: Mapping[str, Any]) -> ConfigKey | None:
    """The config a DaemonSet of ours belongs to, by its name <config>-plugin: unlike its labels, a name cannot be
    edited, so a hand-changed deviceplane.io/config label is drift of that config's DaemonSet, repaired like any."""
    meta = body.get("metadata") or {}
    name, namespace = str(meta.get("name") or ""), meta.get("namespace")
    if not namespace or not name.endswith(names.DAEMONSET_SUFFIX) or name == names.DAEMONSET_SUFFIX:
        return None
    return ConfigKey(namespace, name.removesuffix(names.DAEMONSET_SUFFIX))


def install(
    registry: kopf.OperatorRegistry, view: IndexView, reconciler: Reconciler, watchdog: LoopWatchdog | None = None
) -> None:
    """Register the handlers on `registry`; `reconciler` (and `watchdog`) are started by the startup handler, on
    kopf's loop, and stopped by the cleanup handler."""
    dpcs = {"group": dpc.GROUP, "version": dpc.VERSION, "plural": dpc.PLURAL, "registry": registry}
    dss = {"group": "apps", "version": "v1", "plural": "daemonsets", "registry": registry}
    nodes = {"version": "v1", "plural": "nodes", "registry": registry}
    pods = {"version": "v1", "plural": "pods", "registry": registry}
    cms = {"version": "v1", "plural": "configmaps", "registry": registry}
    # Last seen placement per config and labels/taints per node: only a change there moves node ownership.
    placements: dict[ConfigKey, _Placement] = {}
    node_seen = view.node_infos

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In-cluster service account, else $KUBECONFIG (set from --kubeconfig by the app).
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def start(memo: kopf.Memo, **kwargs: Any) -> None:
        view.indices = {k: kwargs[k] for k in ("dpc_index", "daemonset_index", "configmap_refs")}
        memo["reconciler_task"] = asyncio.create_task(_run_when_listed(view, reconciler), name="reconciler")
        if watchdog is not None:
            watchdog.start()
        install_block_signal(asyncio.get_running_loop())  # tests only (DEVICEPLANE_DEBUG_FAULTS=1)

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        if watchdog is not None:
            watchdog.stop()
        task = memo.get("reconciler_task")
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @kopf.index(**dpcs, id="dpc_index")  # type: ignore[arg-type]
    def dpc_index(body: kopf.Body, **_: Any) -> dict[ConfigKey, Any]:
        return {key_of(body): _slim(body)}

    @kopf.index(**dss, labels=MANAGED, id="daemonset_index")  # type: ignore[arg-type]
    def daemonset_index(body: kopf.Body, **_: Any) -> dict[ConfigKey, Any]:
        key = _daemonset_key(body)
        return {key: _slim(body)} if key else {}

    @kopf.index(**dpcs, id="configmap_refs")  # type: ignore[arg-type]
    def configmap_refs(body: kopf.Body, **_: Any) -> dict[tuple[str, str], ConfigKey]:
        key = key_of(body)
        ref = (body.get("spec") or {}).get("configMapRef") or {}
        return {(key.namespace, ref["name"]): key} if ref.get("name") else {}

    @kopf.on.event(**dpcs)  # type: ignore[arg-type]
    def config_event(body: kopf.Body, event: Mapping[str, Any], **_: Any) -> None:
        key = key_of(body)
        reconciler.seen_config(key, body["metadata"].get("resourceVersion"))
        resource = None if event.get("type") == "DELETED" else (body.get("spec") or {}).get("resourceName")
        before = placements.pop(key, None)
        now = _Placement(resource, idle_cause(body)) if resource is not None else None
        if now is not None:
            placements[key] = now
        reconciler.enqueue(key)
        if event.get("type") in (None, "ADDED", "DELETED") or before != now or _placement_may_change(body):
            # Conflicts involve the other configs of the old and new resource.
            reconciler.topology_changed()
            affected = {p.resource for p in (before, now) if p is not None}
            reconciler.enqueue_all(k for k, p in placements.items() if p.resource in affected)

    # Nodes and pods: event handlers keeping our own caches, not kopf indexes (see operator/listing.py).
    @kopf.on.event(**nodes)  # type: ignore[arg-type]
    def node_event(body: kopf.Body, event: Mapping[str, Any], **_: Any) -> None:
        info = node_info(body)
        view.node_gate.shown(body["metadata"]["uid"])
        gone = event.get("type") == "DELETED"
        if gone:
            changed = node_seen.pop(info.name, None) is not None
        else:
            changed = node_seen.get(info.name) != info
            node_seen[info.name] = info
        if changed and event.get("type") is not None:  # the initial listing is not a change
            reconciler.topology_changed()
            reconciler.enqueue_all(placements)

    @kopf.on.event(**dss, labels=MANAGED)  # type: ignore[arg-type]
    def daemonset_event(body: kopf.Body, **_: Any) -> None:
        key = _daemonset_key(body)
        if key is not None:
            reconciler.seen_daemonset(key, body["metadata"].get("resourceVersion"))
            reconciler.enqueue(key)

    @kopf.on.event(**pods, labels=MANAGED)  # type: ignore[arg-type]
    def pod_event(body: kopf.Body, event: Mapping[str, Any], **_: Any) -> None:
        key = _owner_key(body)
        uid = body["metadata"]["uid"]
        gone = event.get("type") == "DELETED"
        view.pods.observed(uid, None if gone else key, None if gone or key is None else pod_problem(body))
        view.pod_gate.shown(uid)
        if key is not None and key in placements:
            reconciler.enqueue(key)

    # Not an index: kopf would keep a readiness toggle per ConfigMap in the cluster (see operator/configmaps.py).
    @kopf.on.event(**cms)  # type: ignore[arg-type]
    def configmap_event(body: kopf.Body, event: Mapping[str, Any], namespace: str, name: str, **_: Any) -> None:
        referrers = view.configmap_referrers(namespace, name)
        gone = event.get("type") == "DELETED"
        view.configmaps.observed(namespace, name, None if gone else body, referenced=bool(referrers))
        reconciler.enqueue_all(referrers)


async def _run_when_listed(view: IndexView, reconciler: Reconciler) -> None:
    # Configs and DaemonSets are kopf indexes, filled before any handler runs; nodes and pods are ours.
    await view.listed()
    await reconciler.run()


def _placement_may_change(body: Mapping[str, Any]) -> bool:
    # A spec change (new generation) may change nodeSelector/tolerations; status-only events do not.
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    return int(meta.get("generation", 0)) != int(status.get("observedGeneration", -1))
