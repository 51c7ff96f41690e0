"""Nodes and our plugin pods, kept by kopf event handlers instead of kopf indexes, and the gate that holds the first
reconciliation until they hold what the API server had.

Why not kopf indexes: for an indexed resource kopf keeps a readiness toggle per object at startup, and every
object of every watched resource waits for all toggles, woken at each one's change. With 1000 nodes and 1000 plugin
pods the operator spent 10-12 s of CPU before its first reconciliation, 3 s without (docs/operator.md, Startup with
many nodes and plugin pods). What kopf's readiness gave - no reconciliation from a half-listed cache, which would
write exclusions and pod problems the full list contradicts - is given here by ListingGate: one list of the objects'
uids by our own client, and the wait until kopf's watch has shown each of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from deviceplane.operator.names import ConfigKey
from deviceplane.operator.status import PodProblem

log = logging.getLogger("deviceplane.operator")

ListUids = Callable[[], Awaitable[set[str]]]
# Waiting longer than this for the watch, list again (an object deleted meanwhile is never shown), then after twice
# as long, up to RECHECK_MAX_SECONDS: a replica paused for a peer (kopf stops its watches) lists rarely.
RECHECK_SECONDS = 5.0
RECHECK_MAX_SECONDS = 300.0


class ListingGate:
    """Open once kopf's watch has shown every object a list of ours returned (the watch is kopf's; it may have shown
    some before the list answered). Objects deleted after our list and before kopf's are never shown: while the wait
    lasts, we list again (after RECHECK_SECONDS, then ever less often) and stop waiting for those gone."""

    def __init__(self, what: str, list_uids: ListUids, recheck_seconds: float = RECHECK_SECONDS) -> None:
        self.what = what
        self._list_uids = list_uids
        self._recheck = recheck_seconds
        self._seen: set[str] = set()  # shown before our list answered
        self._pending: set[str] | None = None  # listed, not shown yet (None: our list has not answered)
        self._shown_all = asyncio.Event()

    def shown(self, uid: str) -> None:
        """kopf's watch showed this object (any event)."""
        if self._pending is None:
            self._seen.add(uid)
        else:
            self._pending.discard(uid)
            if not self._pending:
                self._shown_all.set()

    async def wait(self) -> None:
        listed = await self._list_retrying()
        self._pending = listed - self._seen
        self._seen.clear()
        recheck = self._recheck
        while self._pending:
            self._shown_all.clear()
            try:
                await asyncio.wait_for(self._shown_all.wait(), recheck)
            except TimeoutError:
                self._pending &= await self._list_retrying()  # in place: shown() may have removed some meanwhile
                recheck = min(2 * recheck, RECHECK_MAX_SECONDS)

    async def _list_retrying(self) -> set[str]:
        while True:
            try:
                return await self._list_uids()
            except Exception as exc:  # the API server may not answer yet: the gate must not give up
                log.warning("listing %s failed: %s; again in %.0f s", self.what, exc, self._recheck)
                await asyncio.sleep(self._recheck)


@dataclass
class PodProblems:
    """Our plugin pods by config: each pod's problem (None: none), from the pod watch's events."""

    _by_config: dict[ConfigKey, dict[str, PodProblem | None]] = field(default_factory=dict)
    _config_of: dict[str, ConfigKey] = field(default_factory=dict)

    def observed(self, uid: str, key: ConfigKey | None, problem: PodProblem | None) -> None:
        """The watch showed a pod (`key` None: deleted, or no longer labelled with a config)."""
        before = self._config_of.pop(uid, None)
        if before is not None:
            pods = self._by_config[before]
            pods.pop(uid, None)
            if not pods:
                del self._by_config[before]
        if key is not None:
            self._config_of[uid] = key
            self._by_config.setdefault(key, {})[uid] = problem

    def of(self, key: ConfigKey) -> Iterable[PodProblem]:
        return [p for p in (self._by_config.get(key) or {}).values() if p is not None]

    def __len__(self) -> int:
        return len(self._config_of)
