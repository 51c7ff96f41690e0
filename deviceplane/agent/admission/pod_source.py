"""Pod sources: where the pods to admit come from (DESIGN; spec §4.8 relies on knowing when they are synced).

A source reports pods appearing or changing (`pod_set`), objects it cannot turn into a pod (`pod_error`), pods
disappearing (`pod_gone`), and, once, that it has reported everything it had at start (`synced`). The static
directory source is here; the API-server source (a watch on `spec.nodeName`) implements the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import yaml
from watchfiles import awatch

from deviceplane.aio import cancel_and_wait
from deviceplane.core.pods import Pod, PodError, parse_pod

log = logging.getLogger("deviceplane.podsource")

MAX_MANIFEST_BYTES = 1 << 20
# inotify gives changes at once; the periodic rescan (the kubelet's file source also re-lists its directory) catches
# anything a watch can miss: changes made before the watch started, overflowed event queues.
RESCAN_INTERVAL_SECONDS = 2.0

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class PodSink(Protocol):
    def pod_set(self, source: str, key: str, pod: Pod) -> None: ...

    def pod_error(self, source: str, key: str, error: str) -> None: ...

    def pod_gone(self, source: str, key: str) -> None: ...

    def synced(self, source: str) -> None: ...


class PodSource(Protocol):
    name: str

    async def run(self, sink: PodSink) -> None:
        """Report every pod, then `synced`, then changes until cancelled."""
        ...


def load_manifest(raw: bytes, file_name: str) -> Any:
    """One Pod document from YAML or JSON bytes; PodError with what is wrong otherwise."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise PodError(f"file is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PodError(f"not UTF-8 text: {err}") from None
    if file_name.endswith(".json"):
        try:
            return json.loads(text)
        except ValueError as err:
            raise PodError(f"invalid JSON: {err}") from None
    try:
        documents = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an integer too long to convert
        raise PodError(f"invalid YAML: {' '.join(str(err).split())}") from None
    if len(documents) != 1:
        raise PodError(f"expected exactly one Pod per file, found {len(documents)} documents")
    _check_size(documents[0])
    return documents[0]


MAX_MANIFEST_NODES = 100_000


def _check_size(document: Any) -> None:
    """YAML aliases let a small file stand for a huge object ("billion laughs"); walking it as a tree, as anything
    that serialises it would, must stay bounded."""
    stack = [document]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_MANIFEST_NODES:
            raise PodError(f"document expands to more than {MAX_MANIFEST_NODES} values (YAML aliases?)")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _ignored(name: str) -> bool:
    # Hidden files (editors' and atomic writers' temp files) are not manifests, as for the kubelet.
    return name.startswith(".") or name.endswith("~") or name.endswith(".swp")


Signature = tuple[int, int, int]  # (inode, size, mtime_ns)


class StaticPodDirectory:
    """`--pod-manifest-dir`: one Pod (YAML or JSON) per file; the file name is the key."""

    name = "file"

    def __init__(self, directory: Path, node_name: str, rescan_interval: float = RESCAN_INTERVAL_SECONDS) -> None:
        self.directory = directory
        self.node_name = node_name
        self.rescan_interval = rescan_interval
        self._known: dict[str, Signature] = {}
        self._rescan_lock = asyncio.Lock()

    async def run(self, sink: PodSink) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        await self._rescan(sink)
        sink.synced(self.name)
        watcher = asyncio.create_task(self._watch(sink), name="pod-dir-watch")
        try:
            while True:
                await asyncio.sleep(self.rescan_interval)
                await self._rescan(sink)
        finally:
            await cancel_and_wait([watcher])

    async def _watch(self, sink: PodSink) -> None:
        """Rescan at every change. A watch that fails (watchfiles cannot report a file name that is not UTF-8, say)
        is logged and set up again after one rescan interval, which the periodic rescan covers meanwhile: it used
        to end without a word, leaving only the rescan."""
        while True:
            try:
                async for _changes in awatch(self.directory, debounce=50, step=10, recursive=False, watch_filter=None):
                    await self._rescan(sink)
            except Exception:
                log.exception("pod directory watch failed; watching again", extra={"directory": str(self.directory)})
            await asyncio.sleep(self.rescan_interval)

    async def _rescan(self, sink: PodSink) -> None:
        """Report what changed since the last look; unchanged files (same inode, size, mtime) are not re-read.

        The periodic loop and the watch both rescan; the lock keeps their steps from interleaving across the
        thread hops, which could otherwise report a pod again after a later rescan reported its file gone."""
        async with self._rescan_lock:
            try:
                current = await asyncio.to_thread(self._signatures)
            except OSError as err:
                log.warning("cannot list pod manifest directory", extra={"dir": str(self.directory), "error": str(err)})
                return
            for name in sorted(set(self._known) - set(current)):
                del self._known[name]
                sink.pod_gone(self.name, name)
            changed = [n for n in sorted(current) if self._known.get(n) != current[n]]
            if not changed:
                return
            loaded = await asyncio.to_thread(self._load_all, changed)
            for name, result in loaded:
                self._known[name] = current[name]
                try:
                    if isinstance(result, Pod):
                        sink.pod_set(self.name, name, result)
                    elif result is None:
                        self._known.pop(name, None)
                        sink.pod_gone(self.name, name)
                    else:
                        sink.pod_error(self.name, name, result)
                except Exception as err:  # a bug handling one pod is that pod's error; the others go on
                    log.exception("pod could not be handled", extra={"file": name})
                    sink.pod_error(self.name, name, f"{name}: internal error: {type(err).__name__}: {err}")

    def _signatures(self) -> dict[str, Signature]:
        out = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if _ignored(entry.name):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    if entry.is_file():
                        out[entry.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return out

    def _load_all(self, names: list[str]) -> list[tuple[str, Pod | str | None]]:
        return [(name, self._load(name)) for name in names]

    def _load(self, name: str) -> Pod | str | None:
        """The pod in a file, its error message, or None if the file vanished meanwhile."""
        try:
            raw = (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            return f"{name}: cannot read: {err.strerror}"
        try:
            return parse_pod(load_manifest(raw, name), self.node_name, name)
        except PodError as err:
            return f"{name}: {err}"
        except RecursionError:
            return f"{name}: document nested too deeply"
        except Exception as err:
            # A parser bug, not the file's fault alone: keep the traceback, report the file, read the others.
            log.exception("pod manifest could not be read", extra={"file": name})
            return f"{name}: cannot be read as a pod: {type(err).__name__}: {err}"
