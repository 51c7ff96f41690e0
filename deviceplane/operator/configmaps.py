"""Content hashes of the ConfigMaps configs reference (`spec.configMapRef`), for their pod templates.

Only referenced ConfigMaps are kept. ConfigMaps are watched cluster-wide by an event handler, not a kopf index:
for an indexed resource kopf keeps a readiness toggle per object at startup and wakes every waiting object at each
change, which cost 31 s of CPU before the first reconcile with 3000 unrelated ConfigMaps (1.2 s without; measured,
docs/operator.md). A reference the watch has not shown yet (at startup, or a config newly pointing at an existing
ConfigMap) is read once, by a list by name (the RBAC grants list and watch on ConfigMaps, not get).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from deviceplane.operator.render import configmap_hash

FindConfigMap = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


def _hash(body: Mapping[str, Any] | None) -> str | None:
    return configmap_hash(body.get("data"), body.get("binaryData")) if body is not None else None


class ConfigMapHashes:
    def __init__(self, find: FindConfigMap) -> None:
        self._find = find
        self._known: dict[tuple[str, str], str | None] = {}  # None: known not to exist

    def observed(self, namespace: str, name: str, body: Mapping[str, Any] | None, referenced: bool) -> None:
        """The watch showed a ConfigMap (`body` None: deleted); `referenced`: a config refers to it."""
        if referenced:
            self._known[(namespace, name)] = _hash(body)
        else:
            self._known.pop((namespace, name), None)

    async def hash(self, namespace: str, name: str) -> str | None:
        """The ConfigMap's content hash, None when it does not exist. API errors of the read propagate."""
        key = (namespace, name)
        if key in self._known:
            return self._known[key]
        found = _hash(await self._find(namespace, name))
        # A watch event that arrived during the read is at least as new as what the read returned: it wins.
        return self._known.setdefault(key, found)

    def __len__(self) -> int:
        return len(self._known)
