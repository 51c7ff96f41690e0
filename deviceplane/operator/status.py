"""A config's status from its DaemonSet, its pods and its conflicts (pure).

Readiness is observedGeneration-aware: counts from a DaemonSet status the controller computed for an older spec do
not make a config Ready. Messages name the cause: which pods fail and why, which config shares which nodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deviceplane.api.dpc import MAX_CONFLICT_NODES, ConditionView, ConflictView, DevicePluginConfigStatus
from deviceplane.operator.conflicts import Conflict, IdleCause
from deviceplane.operator.names import CONFIG_LABEL

MAX_NAMED_PODS = 3
# Degraded (and, with a DaemonSet whose currency could not be checked, Ready) reason: the API server refused a request
# the reconcile needed (e.g. 403 from RBAC on the ConfigMap read) and the reconcile stopped there.
REQUEST_REFUSED = "RequestRefused"
# Waiting reasons that mean the pod will not get better by itself (the kubelet's own strings).
FAILING_WAIT_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


@dataclass(frozen=True)
class PodProblem:
    name: str
    node: str
    reason: str
    message: str = ""

    def describe(self) -> str:
        where = f" on {self.node}" if self.node else ""
        detail = f" ({_clip(self.message)})" if self.message else ""
        return f"{self.name}{where}: {self.reason}{detail}"


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from."""

    generation: int
    paused: bool
    daemonset: Mapping[str, Any] | None  # the live DaemonSet, None if it does not exist (yet)
    pod_problems: Sequence[PodProblem] = ()
    conflicts: Sequence[Conflict] = ()
    problem: tuple[str, str] | None = None  # (reason, message): something only the operator knows, e.g. a write error
    outdated: str | None = None  # why the live DaemonSet does not run the current rendering (e.g. refused update)
    yielded_nodes: int = 0  # nodes this config matches but leaves to older configs of its resource
    # Set when the DaemonSet controller has failed to create some pods for a while: the latest FailedCreate event's
    # message, or "" when none could be read.
    pods_not_created: str | None = None
    # Paused: nodes it yields to older configs that its DaemonSet, left as it was, does not exclude.
    paused_on_yielded: tuple[str, ...] = ()
    # The reconcile stopped before it could render this generation (a request refused): whether the live DaemonSet
    # runs it is not known, so Ready is Unknown rather than a guess either way. The text says why.
    unchecked: str | None = None


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """Why a plugin pod is failing, or None when it is fine or still starting normally. Tolerates any shape."""
    meta, spec, status = _map(pod.get("metadata")), _map(pod.get("spec")), _map(pod.get("status"))
    name, node = _text(meta.get("name")) or "?", _text(spec.get("nodeName"))
    if status.get("phase") == "Failed":
        return PodProblem(name, node, _text(status.get("reason")) or "Failed", _text(status.get("message")))
    for cond in map(_map, _list(status.get("conditions"))):
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return PodProblem(name, node, _text(cond.get("reason")) or "Unschedulable", _text(cond.get("message")))
    for cs in map(_map, _list(status.get("initContainerStatuses")) + _list(status.get("containerStatuses"))):
        state = _map(cs.get("state"))
        waiting = _map(state.get("waiting"))
        if waiting.get("reason") in FAILING_WAIT_REASONS:
            return PodProblem(name, node, _text(waiting["reason"]), _text(waiting.get("message")))
        terminated = _map(state.get("terminated"))
        code = terminated.get("exitCode", 0)
        if terminated and code != 0:
            reason = _text(terminated.get("reason")) or f"exit code {code}"
            return PodProblem(name, node, reason, _text(terminated.get("message")))
    return None


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def compute_status(observed: Observed, previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """The status to write (JSON); lastTransitionTime kept from `previous` for conditions whose status holds."""
    ds = observed.daemonset
    ds_status = (ds or {}).get("status") or {}
    status = DevicePluginConfigStatus(
        observedGeneration=observed.generation,
        daemonSet=(ds or {}).get("metadata", {}).get("name"),
        desiredNumberScheduled=int(ds_status.get("desiredNumberScheduled", 0)),
        numberReady=int(ds_status.get("numberReady", 0)),
        updatedNumberScheduled=int(ds_status.get("updatedNumberScheduled", 0)),
        numberAvailable=int(ds_status.get("numberAvailable", 0)),
        conflicts=[_conflict_view(c) for c in observed.conflicts],
        conditions=_conditions(observed, ds_status),
    )
    out = status.model_dump(mode="json", exclude_none=True)
    out["conditions"] = _keep_transition_times(out["conditions"], (previous or {}).get("conditions") or [], now)
    return out


def _conflict_view(c: Conflict) -> ConflictView:
    return ConflictView(
        config=str(c.other), owner=c.owner, nodes=list(c.nodes[:MAX_CONFLICT_NODES]), nodeCount=len(c.nodes)
    )


def _conditions(observed: Observed, ds_status: Mapping[str, Any]) -> list[ConditionView]:
    ready, progressing = _rollout(observed, ds_status)
    if observed.outdated is not None and observed.daemonset is not None and not observed.paused:
        # Its pods may all be available, but they run a spec this config no longer asks for.
        ready = ("False", "DaemonSetOutdated", observed.outdated)
    elif observed.unchecked is not None and observed.daemonset is not None and not observed.paused:
        ready = ("Unknown", REQUEST_REFUSED, observed.unchecked)
    triples: dict[Literal["Ready", "Progressing", "Degraded", "Conflict"], Triple] = {
        "Ready": ready,
        "Progressing": progressing,
        "Degraded": _degraded(observed),
        "Conflict": _conflict_condition(observed.conflicts, observed.paused_on_yielded),
    }
    return [
        ConditionView(type=kind, status=status, reason=reason, message=message, observedGeneration=observed.generation)
        for kind, (status, reason, message) in triples.items()
    ]


Triple = tuple[Any, str, str]


def _rollout(observed: Observed, s: Mapping[str, Any]) -> tuple[Triple, Triple]:
    ds = observed.daemonset
    if ds is None:
        if observed.paused:
            return ("False", "Paused", "paused before its DaemonSet was created"), ("False", "Paused", "paused")
        if observed.problem is not None and observed.problem[0] in _NOT_CREATED_REASONS:
            # Refused, or the name is taken: nothing is being created (it read Progressing True/Creating).
            msg = "the DaemonSet could not be created (see the Degraded condition)"
            return ("False", "DaemonSetMissing", msg), ("False", "DaemonSetNotCreated", msg)
        return ("False", "DaemonSetMissing", "the DaemonSet does not exist yet"), (
            "True",
            "Creating",
            "creating the DaemonSet",
        )
    name = ds.get("metadata", {}).get("name", "?")
    ds_gen = int(ds.get("metadata", {}).get("generation", 0))
    seen_gen = int(s.get("observedGeneration", 0))
    paused = ("False", "Paused", "paused: the DaemonSet is left as it is") if observed.paused else None
    if seen_gen < ds_gen:
        msg = f"the DaemonSet controller has not observed generation {ds_gen} of {name} yet"
        return ("False", "Pending", msg), paused or ("True", "Pending", msg)
    desired = int(s.get("desiredNumberScheduled", 0))
    updated = int(s.get("updatedNumberScheduled", 0))
    available = int(s.get("numberAvailable", 0))
    scheduled = int(s.get("currentNumberScheduled", 0))
    unavailable = int(s.get("numberUnavailable", 0))
    if desired == 0:
        msg = _no_nodes_message(observed.yielded_nodes)
        return ("True", "NoNodes", msg), paused or ("False", "Complete", msg)
    if updated == desired and available == desired and unavailable == 0:
        msg = f"{available}/{desired} plugin pods available and up to date"
        return ("True", "Available", msg), paused or ("False", "Complete", msg)
    strategy = _map(_map(ds.get("spec")).get("updateStrategy")).get("type")
    if strategy == "OnDelete" and updated < desired and scheduled == desired and unavailable == 0:
        # Nothing more will happen by itself: OnDelete replaces a pod only when it is deleted.
        old, config = desired - updated, _text(_map(ds.get("metadata")).get("labels", {}).get(CONFIG_LABEL))
        msg = (
            f"{_count(old, 'pod')} of {desired} still run{'s' if old == 1 else ''} the previous pod template: with "
            f"updateStrategy OnDelete a pod is replaced when it is deleted (kubectl delete pod -l "
            f"{CONFIG_LABEL}={config or '<config>'})"
        )
        return ("False", "WaitingForPodDeletion", msg), paused or ("False", "WaitingForPodDeletion", msg)
    parts = [f"{available}/{desired} available", f"{updated}/{desired} up to date"]
    if scheduled < desired:
        parts.append(f"{_count(desired - scheduled, 'pod')} not created (see the DaemonSet's events)")
    msg = ", ".join(parts)
    return ("False", "RollingOut", msg), paused or ("True", "RollingOut", msg)


def _no_nodes_message(yielded: int) -> str:
    if yielded == 0:
        return "no node matches the nodeSelector and tolerations"
    matching = "the nodeSelector and tolerations"
    nodes = f"the node matching {matching} is" if yielded == 1 else f"all {yielded} nodes matching {matching} are"
    return f"no node to run on: {nodes} yielded to older configs of the same resource (see the Conflict condition)"


def _degraded(observed: Observed) -> Triple:
    if observed.problem is not None:
        return ("True", observed.problem[0], observed.problem[1])
    if observed.pods_not_created is not None and observed.daemonset is not None:
        s = _map(observed.daemonset.get("status"))
        missing = int(s.get("desiredNumberScheduled", 0)) - int(s.get("currentNumberScheduled", 0))
        name = _text(_map(observed.daemonset.get("metadata")).get("name")) or "?"
        cause = _clip(observed.pods_not_created) or (
            f"see the DaemonSet's FailedCreate events (kubectl describe daemonset {name})"
        )
        return ("True", "PodsNotCreated", f"{_count(max(missing, 0), 'plugin pod')} could not be created: {cause}")
    problems = list(observed.pod_problems)
    if problems:
        named = "; ".join(p.describe() for p in sorted(problems, key=lambda p: p.name)[:MAX_NAMED_PODS])
        more = f" (and {len(problems) - MAX_NAMED_PODS} more)" if len(problems) > MAX_NAMED_PODS else ""
        return ("True", "PodsFailing", f"{_count(len(problems), 'plugin pod')} failing: {named}{more}")
    return ("False", "AsExpected", "")


# Why the older config runs nowhere, and what ends it, by Conflict.idle_cause.
_RUNS_NOWHERE: dict[IdleCause, tuple[str, str]] = {
    "refused": ("its DaemonSet could not be created", "runs"),
    "paused": ("it is paused and has no DaemonSet", "is unpaused"),
}


def _role(c: Conflict) -> str:
    """Who keeps the shared nodes, and why when age did not decide it."""
    if not c.idle:
        return "this config is older and keeps them" if c.owner else "it is older and keeps them"
    why, until = _RUNS_NOWHERE[c.idle_cause or "refused"]
    if c.idle == "other":
        return f"it is older, but {why}, so it runs nowhere: this config keeps them until it {until}"
    return f"this config is older, but {why}, so it runs nowhere: it keeps them until this config {until}"


def _nodes_shown(nodes: Sequence[str]) -> str:
    return ", ".join(nodes[:MAX_CONFLICT_NODES]) + (" ..." if len(nodes) > MAX_CONFLICT_NODES else "")


def _conflict_condition(conflicts: Sequence[Conflict], paused_on_yielded: Sequence[str] = ()) -> Triple:
    if not conflicts:
        return ("False", "NoConflict", "")
    parts = []
    for c in conflicts:
        role = _role(c)
        parts.append(
            f"{c.other} serves the same resource on {_count(len(c.nodes), 'node')} ({role}): {_nodes_shown(c.nodes)}"
        )
    if paused_on_yielded:
        parts.append(
            f"this config is paused and its DaemonSet does not exclude {_count(len(paused_on_yielded), 'node')} it "
            f"yields, so both plugins may serve them until it is unpaused: {_nodes_shown(paused_on_yielded)}"
        )
    reason = "YieldsNodes" if any(not c.owner for c in conflicts) else "KeepsNodes"
    return ("True", reason, "; ".join(parts))


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# Degraded reasons that mean the config's DaemonSet was not written and will not be until something changes (for
# RequestRefused: until the request the reconcile stopped at is taken, e.g. once RBAC allows it).
_NOT_CREATED_REASONS = frozenset({"DaemonSetRejected", "DaemonSetNotOurs", REQUEST_REFUSED})


def pods_missing(ds: Mapping[str, Any] | None) -> bool:
    """Has the DaemonSet controller, at the DaemonSet's current generation, scheduled fewer pods than it wants?
    (Brief while it creates them; lasting when it cannot, e.g. a missing PriorityClass or an exhausted quota.)"""
    if ds is None:
        return False
    meta, s = _map(ds.get("metadata")), _map(ds.get("status"))
    current_generation = int(s.get("observedGeneration", 0)) >= int(meta.get("generation", 0))
    return current_generation and int(s.get("currentNumberScheduled", 0)) < int(s.get("desiredNumberScheduled", 0))


def degraded_reason(config: Mapping[str, Any]) -> str | None:
    """The Degraded reason in a config's stored status, if it is for the config's current generation."""
    meta, status = _map(config.get("metadata")), _map(config.get("status"))
    if status.get("observedGeneration") != meta.get("generation"):
        return None
    degraded = next((_map(c) for c in _list(status.get("conditions")) if _map(c).get("type") == "Degraded"), {})
    if degraded.get("status") != "True":
        return None
    return _text(degraded.get("reason")) or None


def idle_cause(config: Mapping[str, Any]) -> IdleCause:
    """Why a config runs nowhere, read from its spec and the status the operator wrote ("": it runs, or will try to).

    "paused": paused while its status names no DaemonSet, so it creates none (a config paused with its DaemonSet
    keeps running it). "refused": at the config's current generation it has no DaemonSet because one could not be
    created (refused, or a DaemonSet of its name is not ours). Either keeps no node from a config that runs. Read
    from the stored object, so it holds across operator restarts; a new generation (unpausing is one) is tried
    again, and runs until refused."""
    if _map(config.get("status")).get("daemonSet"):
        return ""
    if _map(config.get("spec")).get("paused") is True:
        return "paused"
    return "refused" if degraded_reason(config) in _NOT_CREATED_REASONS else ""


def _keep_transition_times(
    new: Iterable[dict[str, Any]], old: Iterable[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in old}
    out = []
    for cond in new:
        prev = before.get(cond["type"])
        same = prev is not None and prev.get("status") == cond["status"] and prev.get("lastTransitionTime")
        out.append({**cond, "lastTransitionTime": prev["lastTransitionTime"] if same and prev else now})
    return out


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
