"""Pods from the API server: the pods bound to this node (`spec.nodeName=<node>`), as a PodSource.

List, report every pod, say `synced`, then watch from the list's resourceVersion; a watch that ends (server
timeout, the connection cut or silent past the read timeout) resumes from the last version seen (bookmarks keep it
fresh); a version the server no longer has (410 Gone) means list again and report the difference. Errors are retried
with backoff; meanwhile the pods already reported stay as they are (the agent keeps admitting static pods and
serving what it has).

Keys are `namespace/name`; the pod's UID comes from the object, so a pod deleted and re-created under the same name
is a new pod. Deletion reports `pod_gone`; a terminal phase (Succeeded/Failed) is reported as a pod update and the
admission path frees its devices.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from deviceplane.agent.admission.pod_source import PodSink
from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import WATCH_READ_TIMEOUT, KubeApi, WatchEvent
from deviceplane.agent.kube.errors import KubeError, ResourceExpired
from deviceplane.aio import off_loop
from deviceplane.core.pods import PodError, parse_pod

log = logging.getLogger("deviceplane.kube.pods")

WATCH_TIMEOUT_SECONDS = 300


def pod_key(obj: dict[str, Any]) -> str:
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict):
        return "/"
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


class ApiPodSource:
    name = "api"

    def __init__(
        self,
        api: KubeApi,
        node: str,
        backoff: Backoff | None = None,
        watch_timeout: int = WATCH_TIMEOUT_SECONDS,
        read_timeout: float = WATCH_READ_TIMEOUT,
    ) -> None:
        self.api = api
        self.node = node
        self.backoff = backoff or Backoff()
        self.watch_timeout = watch_timeout
        self.read_timeout = read_timeout
        self.synced = False
        self.lists = 0
        self._known: set[str] = set()
        self._version: str | None = None

    async def run(self, sink: PodSink) -> None:
        while True:
            try:
                if self._version is None:
                    await self._list(sink)
                await self._watch(sink)
                self.backoff.reset()
            except ResourceExpired as err:
                log.info("pod watch expired; listing again", extra={"error": str(err)})
                self._version = None
            except KubeError as err:  # the version is kept: the next watch resumes from it
                delay = self.backoff.delay()
                log.warning(
                    "pod watch failed; retrying",
                    extra={"error": str(err), "retry_in": delay, "resourceVersion": self._version},
                )
                await asyncio.sleep(delay)
            except Exception:  # a bug must not end the source for good: list again after a pause
                delay = self.backoff.delay()
                log.exception("pod source failed unexpectedly; listing again", extra={"retry_in": delay})
                self._version = None
                await asyncio.sleep(delay)

    async def _list(self, sink: PodSink) -> None:
        items, version = await off_loop(self.api.list_pods, self.node)
        listed = set()
        for obj in items:
            listed.add(pod_key(obj))
            self._report(sink, "ADDED", obj)
        for key in sorted(self._known - listed):
            self._known.discard(key)
            sink.pod_gone(self.name, key)
        self._version = version
        self.lists += 1
        if not self.synced:
            self.synced = True
            sink.synced(self.name)
        log.info("pods listed", extra={"node": self.node, "pods": len(items), "resourceVersion": version})

    async def _watch(self, sink: PodSink) -> None:
        """One watch request, its events applied on the loop in order. The request runs in a thread; when this
        coroutine is cancelled the thread's later events are dropped and it ends at its next event or timeout."""
        assert self._version is not None
        loop = asyncio.get_running_loop()
        active = threading.Event()
        active.set()

        def apply(event: WatchEvent) -> None:
            if not active.is_set():
                return
            metadata = event.object.get("metadata")
            version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
            if version:
                self._version = str(version)
            if event.type != "BOOKMARK":
                self._report(sink, event.type, event.object)

        def stream(version: str) -> None:
            for event in self.api.watch_pods(self.node, version, self.watch_timeout, self.read_timeout):
                if not active.is_set():
                    return
                try:
                    loop.call_soon_threadsafe(apply, event)
                except RuntimeError:
                    return  # the loop is gone

        try:
            await off_loop(stream, self._version)
        finally:
            active.clear()

    def _report(self, sink: PodSink, kind: str, obj: dict[str, Any]) -> None:
        key = pod_key(obj)
        if kind == "DELETED":
            if key in self._known:
                self._known.discard(key)
                sink.pod_gone(self.name, key)
            return
        self._known.add(key)
        try:
            pod = parse_pod(obj, self.node, key)
        except PodError as err:
            sink.pod_error(self.name, key, f"{key}: {err}")
        except RecursionError:
            sink.pod_error(self.name, key, f"{key}: object nested too deeply")
        else:
            sink.pod_set(self.name, key, pod)

    def ready(self) -> str | None:
        return None if self.synced else "pods from the API server not listed yet"
