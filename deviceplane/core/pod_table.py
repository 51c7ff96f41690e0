"""The pods the agent knows: one record per pod UID, indexed by where it came from and by namespace/name, plus the
objects sources could not turn into pods and which sources have synced. Pure bookkeeping; the admission runner
(agent/admission/runner.py) decides, the views and PodResources read through the query methods.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from deviceplane.core.pods import Pod


class PodState(StrEnum):
    """Where a pod's admission stands; the value is what /api/v1/pods shows as `state`."""

    ADMITTING = "admitting"
    ADMITTED = "admitted"
    FAILED = "failed"
    TERMINATED = "terminated"


SourceKey = tuple[str, str]  # (source name, the source's key for the object: a file name, a namespace/name)


@dataclass(slots=True)
class PodRecord:
    pod: Pod
    source: str
    key: str
    state: PodState = PodState.ADMITTING
    reason: str = ""
    restored: bool = False

    def admitted(self, restored: bool) -> None:
        self.state = PodState.ADMITTED
        self.restored = restored

    def waiting(self, reason: str) -> None:
        """Still admitting, held up by `reason` ("" once it goes on)."""
        self.reason = reason

    def failed(self, reason: str) -> None:
        self.state = PodState.FAILED
        self.reason = reason

    def terminated(self, reason: str) -> None:
        self.state = PodState.TERMINATED
        self.reason = reason

    def phase_changed(self, phase: str) -> None:
        """A pod's spec is immutable (as the API server enforces): only its phase moves on."""
        self.pod = dataclasses.replace(self.pod, phase=phase)

    @property
    def live(self) -> bool:
        """Still wants its devices: admitting or admitted, and the pod has not ended."""
        return self.state in (PodState.ADMITTING, PodState.ADMITTED) and not self.pod.terminal

    @property
    def active(self) -> bool:
        """What PodResources lists: admitted and not ended."""
        return self.state == PodState.ADMITTED and not self.pod.terminal


@dataclass(frozen=True, slots=True)
class SourceError:
    source: str
    key: str
    error: str


class PodTable:
    def __init__(self) -> None:
        self._records: dict[str, PodRecord] = {}  # by pod UID
        self._by_key: dict[SourceKey, str] = {}  # -> UID
        self._by_name: dict[str, str] = {}  # namespace/name -> UID
        self._errors: dict[SourceKey, SourceError] = {}
        self._sources: set[str] = set()
        self._synced: set[str] = set()

    # -- sources ----------------------------------------------------------------------------------------------------

    def register_source(self, name: str) -> None:
        self._sources.add(name)

    def mark_synced(self, source: str) -> None:
        self._synced.add(source)

    @property
    def all_synced(self) -> bool:
        """Every registered source has reported everything it had at start (spec §4.8)."""
        return self._sources <= self._synced

    # -- queries ----------------------------------------------------------------------------------------------------

    def get(self, uid: str) -> PodRecord | None:
        return self._records.get(uid)

    def uid_at(self, source: str, key: str) -> str | None:
        return self._by_key.get((source, key))

    def find(self, namespace: str, name: str) -> PodRecord | None:
        uid = self._by_name.get(f"{namespace}/{name}")
        return self._records.get(uid) if uid is not None else None

    def records(self) -> list[PodRecord]:
        """Every record, by namespace and name."""
        return sorted(self._records.values(), key=lambda r: (r.pod.namespace, r.pod.name))

    def active(self) -> list[PodRecord]:
        return [record for record in self.records() if record.active]

    def live_uids(self) -> set[str]:
        return {uid for uid, record in self._records.items() if record.live}

    def errors(self) -> list[SourceError]:
        return sorted(self._errors.values(), key=lambda e: (e.source, e.key))

    def conflict(self, source: str, key: str, pod: Pod) -> str | None:
        """Why `pod` cannot be recorded at (source, key): its UID or its name belongs to another object."""
        record = self._records.get(pod.uid)
        if record is not None and (record.source, record.key) != (source, key):
            return f"pod UID {pod.uid} is already used by {record.source}:{record.key}"
        other_uid = self._by_name.get(pod.key)
        if other_uid is not None and other_uid != pod.uid:
            other = self._records[other_uid]
            return f"pod {pod.key} is already defined by {other.source}:{other.key}"
        return None

    # -- changes ----------------------------------------------------------------------------------------------------

    def bind(self, source: str, key: str, uid: str) -> None:
        self._by_key[(source, key)] = uid

    def add(self, pod: Pod, source: str, key: str) -> PodRecord:
        record = PodRecord(pod, source, key)
        self._records[pod.uid] = record
        self._by_key[(source, key)] = pod.uid
        self._by_name[pod.key] = pod.uid
        return record

    def remove_at(self, source: str, key: str) -> PodRecord | None:
        """Forget the pod reported at (source, key); returns its record, if there was one."""
        uid = self._by_key.pop((source, key), None)
        if uid is None:
            return None
        record = self._records.pop(uid, None)
        if record is not None and self._by_name.get(record.pod.key) == uid:
            del self._by_name[record.pod.key]
        return record

    def set_error(self, source: str, key: str, error: str) -> None:
        self._errors[(source, key)] = SourceError(source, key, error)

    def clear_error(self, source: str, key: str) -> None:
        self._errors.pop((source, key), None)
