"""Which nodes each config may run on, and who keeps a node two configs of one resource both want (pure).

A node is eligible for a config when its labels satisfy the nodeSelector and its NoSchedule/NoExecute taints are
tolerated (by the config's tolerations or by those the DaemonSet controller adds to every daemon pod). Of two
configs serving the same resourceName, the older (creationTimestamp, then namespace/name) keeps a shared node; the
newer one excludes it. A config that runs nowhere - its DaemonSet could not be created (refused, or a DaemonSet of
its name is not ours), or it was paused before its DaemonSet was created - keeps no node while a config that runs
wants it: otherwise nobody would serve the node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from deviceplane.api.dpc import Toleration
from deviceplane.operator.names import ConfigKey

# Why a config runs nowhere ("": it runs): "refused" - its DaemonSet could not be created (refused, or a DaemonSet of
# its name is not ours); "paused" - it was paused before its DaemonSet was created, so it creates none.
IdleCause = Literal["", "refused", "paused"]

# The DaemonSet controller adds these to every daemon pod (pkg/controller/daemon/util AddOrUpdateDaemonPodTolerations).
_DAEMON_TOLERATIONS = (
    Toleration(key="node.kubernetes.io/not-ready", operator="Exists", effect="NoExecute"),
    Toleration(key="node.kubernetes.io/unreachable", operator="Exists", effect="NoExecute"),
    Toleration(key="node.kubernetes.io/disk-pressure", operator="Exists", effect="NoSchedule"),
    Toleration(key="node.kubernetes.io/memory-pressure", operator="Exists", effect="NoSchedule"),
    Toleration(key="node.kubernetes.io/pid-pressure", operator="Exists", effect="NoSchedule"),
    Toleration(key="node.kubernetes.io/unschedulable", operator="Exists", effect="NoSchedule"),
)


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str
    value: str = ""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """What conflict resolution needs of a config."""

    key: ConfigKey
    resource_name: str
    created: str  # RFC 3339 from the API server: sorts chronologically as text
    node_selector: Mapping[str, str]
    tolerations: Sequence[Toleration]
    idle_cause: IdleCause = ""  # set: it has no DaemonSet and will not create one, so it serves no node

    @property
    def runs(self) -> bool:
        return not self.idle_cause

    @property
    def age_order(self) -> tuple[str, str, str]:
        return (self.created, self.key.namespace, self.key.name)


@dataclass(frozen=True)
class Conflict:
    """`other` serves the same resource on `nodes` too; `owner` says whether this config keeps them. `idle` says
    which side keeps them only because the older one runs nowhere ("this" or "other"; "": age decided), and
    `idle_cause` why that one runs nowhere."""

    other: ConfigKey
    owner: bool
    nodes: tuple[str, ...]
    idle: Literal["", "this", "other"] = ""
    idle_cause: IdleCause = ""


@dataclass(frozen=True)
class Resolution:
    excluded: frozenset[str]  # nodes this config yields to older ones
    conflicts: tuple[Conflict, ...]


def tolerates(toleration: Toleration, taint: Taint) -> bool:
    """core/v1 Toleration.ToleratesTaint."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    if toleration.operator == "Exists":
        return True
    if not toleration.key and toleration.operator in (None, "Equal"):
        return False  # an empty key matches all only with Exists
    return (toleration.value or "") == taint.value


def eligible(node: NodeInfo, node_selector: Mapping[str, str], tolerations: Iterable[Toleration]) -> bool:
    if any(node.labels.get(k) != v for k, v in node_selector.items()):
        return False
    all_tolerations = (*tolerations, *_DAEMON_TOLERATIONS)
    return all(
        any(tolerates(t, taint) for t in all_tolerations)
        for taint in node.taints
        if taint.effect in ("NoSchedule", "NoExecute")
    )


def eligible_nodes(candidate: Candidate, nodes: Iterable[NodeInfo]) -> frozenset[str]:
    return frozenset(n.name for n in nodes if eligible(n, candidate.node_selector, candidate.tolerations))


def resolve(candidates: Iterable[Candidate], nodes: Iterable[NodeInfo]) -> dict[ConfigKey, Resolution]:
    """For every config: the nodes it must exclude and the conflicts it reports (both sides report)."""
    node_list = list(nodes)
    by_resource: dict[str, list[Candidate]] = defaultdict(list)
    for c in candidates:
        by_resource[c.resource_name].append(c)
    out: dict[ConfigKey, Resolution] = {}
    for group in by_resource.values():
        group.sort(key=lambda c: c.age_order)
        eligible_by = {c.key: eligible_nodes(c, node_list) for c in group} if len(group) > 1 else {}
        for i, config in enumerate(group):
            excluded: set[str] = set()
            conflicts: list[Conflict] = []
            for j, other in enumerate(group):
                if i == j:
                    continue
                shared = eligible_by[config.key] & eligible_by[other.key]
                if not shared:
                    continue
                older = j < i
                # The one that runs keeps the nodes; between two that run, or two that do not, the older.
                keeps = config.runs if config.runs != other.runs else not older
                if not keeps:
                    excluded |= shared
                idle: Literal["", "this", "other"] = ""
                cause: IdleCause = ""
                if keeps == older:  # age alone would have decided the other way
                    idle, cause = ("other", other.idle_cause) if keeps else ("this", config.idle_cause)
                conflicts.append(
                    Conflict(other=other.key, owner=keeps, nodes=tuple(sorted(shared)), idle=idle, idle_cause=cause)
                )
            out[config.key] = Resolution(frozenset(excluded), tuple(conflicts))
    return out
