"""Reconcile one DevicePluginConfig: render, compare, write only what differs, report.

One idempotent path for create, update and resume. Work arrives as keys (a config changed, or something it depends
on: its DaemonSet, pods, ConfigMap, a node, another config of its resource) into a deduplicating queue; a key is
never reconciled twice at once. Reads come from the watch caches (`ClusterView`), so a reconcile that finds nothing
to do sends no request at all. After a write, the cache briefly lags: until the watch delivers the object we wrote,
the reconciler does not write it again (no duplicate writes, no fighting our own echo). A failure that may pass by
itself (5xx, 429, timeouts, connection errors) re-queues the key after a per-key exponential backoff. A refusal of
the DaemonSet write (another 4xx, e.g. 422) is final until something the config depends on changes; a refusal of any
other request (e.g. 403 on the ConfigMap read) is reported in the status and retried with the same backoff, since
what fixes it (RBAC, an admission policy) sends the operator no event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import urllib3
from pydantic import ValidationError

from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.core.times import rfc3339
from deviceplane.operator import conflicts as conflict_rules
from deviceplane.operator.drift import drifted_fields, render_hash
from deviceplane.operator.kube import ApiException, KubeApi, request_of
from deviceplane.operator.metrics import OperatorMetrics
from deviceplane.operator.names import CONFIG_HASH_ANNOTATION, ConfigKey
from deviceplane.operator.render import Owner, render_daemonset
from deviceplane.operator.status import (
    REQUEST_REFUSED,
    Observed,
    PodProblem,
    compute_status,
    degraded_reason,
    idle_cause,
    pods_missing,
)

log = logging.getLogger("deviceplane.operator")


class ClusterView(Protocol):
    """What the watches know (kopf indexes in production)."""

    def config(self, key: ConfigKey) -> Mapping[str, Any] | None: ...
    def configs(self) -> Iterable[Mapping[str, Any]]: ...
    def nodes(self) -> Iterable[conflict_rules.NodeInfo]: ...
    def daemonset(self, key: ConfigKey) -> Mapping[str, Any] | None: ...
    def pod_problems(self, key: ConfigKey) -> Iterable[PodProblem]: ...
    async def configmap_hash(self, namespace: str, name: str) -> str | None: ...


def key_of(body: Mapping[str, Any]) -> ConfigKey:
    meta = body["metadata"]
    return ConfigKey(meta["namespace"], meta["name"])


def candidate_of(body: Mapping[str, Any]) -> conflict_rules.Candidate | None:
    try:
        spec = DevicePluginConfigSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return None
    return conflict_rules.Candidate(
        key=key_of(body),
        resource_name=spec.resourceName,
        created=str(body["metadata"].get("creationTimestamp") or ""),
        node_selector=spec.nodeSelector,
        tolerations=spec.tolerations,
        idle_cause=idle_cause(body),
    )


ECHO_TIMEOUT = 5.0  # seconds to wait for the watch to show our own write before trusting the cache again
# Seconds the DaemonSet may have fewer pods than it wants, at its current generation, before Degraded says
# PodsNotCreated: far more than the controller takes to create pods that it can create (not measured here; a
# generous margin), while what stops it (a missing PriorityClass, an exhausted quota, an admission webhook refusing
# them) will not pass by itself.
PODS_NOT_CREATED_AFTER = 30.0
RETRY_BASE = 0.5  # seconds before the first retry after a transient failure; doubled per failure in a row
RETRY_CAP = 60.0  # seconds: the longest wait between retries


def is_transient(exc: BaseException) -> bool:
    """May the same request succeed later? Server errors, throttling, timeouts, lost connections; not other 4xx."""
    if isinstance(exc, ApiException):
        return not exc.status or exc.status >= 500 or exc.status == 429
    return isinstance(exc, (urllib3.exceptions.HTTPError, OSError, TimeoutError))


@dataclass
class _Backoff:
    """Per-key exponential backoff: base, 2 x base, ... up to cap; a key's count is dropped when it succeeds."""

    base: float = RETRY_BASE
    cap: float = RETRY_CAP
    failures: dict[ConfigKey, int] = field(default_factory=dict)

    def next_delay(self, key: ConfigKey) -> float:
        count = self.failures.get(key, 0)
        self.failures[key] = count + 1
        return float(min(self.cap, self.base * 2**count))

    def reset(self, key: ConfigKey) -> None:
        self.failures.pop(key, None)


@dataclass(frozen=True)
class _Outcome:
    result: str  # "unchanged" (no write), "changed" or "failed", as counted in reconcile_total
    retry: bool = False  # failed for a reason that may pass by itself: reconcile again after a backoff


@dataclass(frozen=True)
class _Applied:
    """What writing the DaemonSet came to."""

    live: Mapping[str, Any] | None  # the DaemonSet as it now is (None: none of ours exists)
    changed: bool = False
    problem: tuple[str, str] | None = None  # (reason, message) for Degraded: the write failed or was not ours to make
    retry: bool = False
    stale: bool = False  # the DaemonSet changed or went since our cache saw it (409/404): nothing to report
    refused: str | None = None  # a final refusal of the write: its failure cause, as counted in the metrics

    @property
    def failed(self) -> bool:
        """The DaemonSet does not carry what we rendered."""
        return self.problem is not None


@dataclass
class _Echo:
    """Writes the watch has not shown us yet: key → (resourceVersion the cache had before the write, give-up time).

    Any later event carries another version, and the watch delivers versions in order, so from then on the cache
    includes our write (kopf may coalesce events, so waiting for our exact version could wait forever). Until then
    the cache is older than our write and must not trigger another one. Not relying on the event alone, the
    reconciler re-queues the key when the wait gives up.
    """

    pending: dict[ConfigKey, tuple[str | None, float]] = field(default_factory=dict)

    def wrote(self, key: ConfigKey, version_before: str | None) -> None:
        self.pending[key] = (version_before, time.monotonic() + ECHO_TIMEOUT)

    def seen(self, key: ConfigKey, resource_version: str | None) -> None:
        if key in self.pending and self.pending[key][0] != resource_version:
            del self.pending[key]

    def waiting(self, key: ConfigKey) -> bool:
        entry = self.pending.get(key)
        if entry is None:
            return False
        if time.monotonic() > entry[1]:
            del self.pending[key]
            return False
        return True

    def forget(self, key: ConfigKey) -> None:
        self.pending.pop(key, None)


class Reconciler:
    def __init__(
        self,
        view: ClusterView,
        api: KubeApi,
        metrics: OperatorMetrics,
        *,
        workers: int = 4,
        retry_base: float = RETRY_BASE,
        retry_cap: float = RETRY_CAP,
        pods_not_created_after: float = PODS_NOT_CREATED_AFTER,
    ) -> None:
        self._view = view
        self._api = api
        self._metrics = metrics
        self._workers = workers
        self._queue: asyncio.Queue[ConfigKey] = asyncio.Queue()
        self._queued: set[ConfigKey] = set()
        self._running: set[ConfigKey] = set()
        self._again: set[ConfigKey] = set()
        self._ds_echo = _Echo()
        self._status_echo = _Echo()
        self._backoff = _Backoff(retry_base, retry_cap)
        self._retry_timers: dict[ConfigKey, asyncio.TimerHandle] = {}
        self._not_ours_seen: set[ConfigKey] = set()  # last seen: a DaemonSet of the config's name not ours
        # A refused write: ((render hash, live resourceVersion), failure cause, problem), not re-sent while equal.
        self._refused: dict[ConfigKey, tuple[tuple[str | None, str | None], str, tuple[str, str]]] = {}
        self._pods_not_created_after = pods_not_created_after
        # Pods missing: (DaemonSet uid, generation) -> since when (monotonic), and the cause read for it.
        self._missing_since: dict[ConfigKey, tuple[tuple[str, int], float]] = {}
        self._missing_cause: dict[ConfigKey, tuple[tuple[str, int, int], str]] = {}
        self._missing_timers: dict[ConfigKey, asyncio.TimerHandle] = {}
        self._resolution: dict[ConfigKey, conflict_rules.Resolution] | None = None
        self.statuses: dict[ConfigKey, Mapping[str, Any]] = {}  # last computed, for the metrics

    # ---- the queue ------------------------------------------------------------------------------------------

    def enqueue(self, key: ConfigKey) -> None:
        if key in self._running:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def enqueue_all(self, keys: Iterable[ConfigKey] | None = None) -> None:
        for key in keys if keys is not None else (key_of(b) for b in self._view.configs()):
            self.enqueue(key)

    def topology_changed(self) -> None:
        """Configs or nodes changed: conflicts must be recomputed."""
        self._resolution = None

    def seen_daemonset(self, key: ConfigKey, resource_version: str | None) -> None:
        """The watch delivered this version of the config's DaemonSet."""
        self._ds_echo.seen(key, resource_version)

    def seen_config(self, key: ConfigKey, resource_version: str | None) -> None:
        self._status_echo.seen(key, resource_version)

    def idle(self) -> bool:
        return not self._queued and not self._running

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self._workers)))

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._running.add(key)
            try:
                await self.reconcile(key)
            finally:
                self._running.discard(key)
                if key in self._again:
                    self._again.discard(key)
                    self.enqueue(key)

    # ---- one config ---------------------------------------------------------------------------------------

    async def reconcile(self, key: ConfigKey) -> str:
        started = time.monotonic()
        try:
            outcome = await self._reconcile(key)
        except Exception as exc:
            outcome = await self._failed(key, exc)
        self._schedule_retry(key, outcome.retry)
        self._metrics.reconciles.labels(outcome.result).inc()
        self._metrics.duration.observe(time.monotonic() - started)
        return outcome.result

    async def _failed(self, key: ConfigKey, exc: Exception) -> _Outcome:
        """A request other than the DaemonSet write (which _send_daemonset reports itself) failed, or a bug of ours.
        Both kinds of API failure are retried with the backoff; a refusal is also reported in the status."""
        if is_transient(exc):
            log.warning("reconcile %s: API request failed: %s (%s)", key, _describe(exc), request_of(exc))
            self._metrics.failures.labels("api_error").inc()
            return _Outcome("failed", retry=True)
        if isinstance(exc, ApiException):
            # Not final, unlike a refused DaemonSet: these requests (reads, the status write) do not depend on the
            # spec alone, and what refuses them is mostly outside the config (RBAC, an admission policy, expired
            # credentials) and changes without an event the operator watches. The backoff is capped (RETRY_CAP), so
            # a refusal that lasts costs one request per config per cap.
            message = f"the API server refused {request_of(exc)}: {_describe(exc)}: {_api_message(exc)}"
            log.warning("reconcile %s: %s", key, message)
            self._metrics.failures.labels("api_error").inc()
            try:
                await self._report_refused(key, message)
            except Exception as bug:  # _write_status handles the API's answers: this is ours, never the worker's end
                log.error("reconcile %s: reporting the refusal failed", key, exc_info=bug)
                self._metrics.failures.labels("internal").inc()
            return _Outcome("failed", retry=True)
        log.error("reconcile %s failed", key, exc_info=exc)
        self._metrics.failures.labels("internal").inc()
        return _Outcome("failed")

    async def _report_refused(self, key: ConfigKey, message: str) -> None:
        """Write the status of a reconcile that stopped at a refused request, from what the caches know: Degraded
        names the request and the API server's answer; the DaemonSet was neither written nor checked."""
        body = self._view.config(key)
        if body is None:
            return
        try:
            spec = DevicePluginConfigSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return  # reported as InvalidSpec, before any request
        live = self._view.daemonset(key)
        resolution = self._resolve().get(key, conflict_rules.Resolution(frozenset(), ()))
        retry = f"tried again at most {self._backoff.cap:g} s apart until it is taken"
        observed = Observed(
            int(body["metadata"].get("generation", 0)),
            paused=spec.paused,
            daemonset=live,
            pod_problems=tuple(self._view.pod_problems(key)),
            conflicts=resolution.conflicts,
            problem=(REQUEST_REFUSED, f"{message}; {retry}"),
            yielded_nodes=len(resolution.excluded),
            unchecked="whether the DaemonSet runs this generation is not known: the reconcile stopped at a refused "
            "request (see the Degraded condition)",
        )
        await self._write_status(key, body, observed)

    def _schedule_retry(self, key: ConfigKey, retry: bool) -> None:
        """After a transient failure, reconcile the key again after its backoff; any other outcome resets it."""
        timer = self._retry_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if not retry:
            self._backoff.reset(key)
            return
        delay = self._backoff.next_delay(key)
        log.info("reconcile %s again in %.1f s", key, delay)
        self._retry_timers[key] = asyncio.get_running_loop().call_later(delay, self._retry_due, key)

    def _retry_due(self, key: ConfigKey) -> None:
        self._retry_timers.pop(key, None)
        self.enqueue(key)

    async def _reconcile(self, key: ConfigKey) -> _Outcome:
        body = self._view.config(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            # Deleted: the DaemonSet goes by ownerReference garbage collection, nothing of ours to clean up.
            self.statuses.pop(key, None)
            self._not_ours_seen.discard(key)
            self._refused.pop(key, None)
            self._forget_missing(key)
            self._ds_echo.forget(key)
            self._status_echo.forget(key)
            return _Outcome("unchanged")
        meta = body["metadata"]
        generation = int(meta.get("generation", 0))
        live = self._view.daemonset(key)
        try:
            spec = DevicePluginConfigSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            self._metrics.failures.labels("invalid_spec").inc()
            invalid = ("InvalidSpec", _validation_message(exc))
            written = await self._write_status(
                key, body, Observed(generation, paused=True, daemonset=live, problem=invalid)
            )
            return _Outcome("failed", retry=written == "failed")
        if self._ds_echo.waiting(key) or self._status_echo.waiting(key):
            return _Outcome("unchanged")  # the cache is older than our last write; its watch event brings us back

        resolution = self._resolve().get(key, conflict_rules.Resolution(frozenset(), ()))
        config_hash, problem = await self._config_hash(key, spec, live)
        uid = str(meta["uid"])
        rendered = render_daemonset(Owner(key, uid), spec, config_hash=config_hash, excluded_nodes=resolution.excluded)
        applied = _Applied(live)
        if not spec.paused:
            applied = await self._apply_daemonset(key, uid, rendered, live)
            if applied.stale:
                # Its watch event normally brings us back; a DaemonSet the filtered watch does not show sends none.
                return _Outcome("unchanged", retry=True)
        observed = Observed(
            generation,
            paused=spec.paused,
            daemonset=applied.live,
            pod_problems=tuple(self._view.pod_problems(key)),
            conflicts=resolution.conflicts,
            problem=applied.problem or problem,
            outdated=None if spec.paused else _outdated(applied, rendered),
            yielded_nodes=len(resolution.excluded),
            pods_not_created=await self._pods_not_created(key, body, applied.live),
            paused_on_yielded=_not_excluded(applied.live, resolution.excluded) if spec.paused else (),
        )
        status_result = await self._write_status(key, body, observed)
        if applied.failed or status_result == "failed":
            return _Outcome("failed", retry=applied.retry or status_result == "failed")
        return _Outcome("changed" if applied.changed or status_result == "changed" else status_result)

    async def _pods_not_created(
        self, key: ConfigKey, body: Mapping[str, Any], ds: Mapping[str, Any] | None
    ) -> str | None:
        """The cause to report when the DaemonSet has lacked pods for PODS_NOT_CREATED_AFTER at its current generation
        (None: it has not, or not for that long yet; the key is looked at again when that time is up)."""
        if not pods_missing(ds):
            self._forget_missing(key)
            return None
        assert ds is not None
        meta, ds_status = ds.get("metadata") or {}, ds.get("status") or {}
        episode = (str(meta.get("uid") or ""), int(meta.get("generation", 0)))
        now = time.monotonic()
        since = self._missing_since.get(key)
        if since is None or since[0] != episode:
            # Already reported before (e.g. before an operator restart): it has lasted long enough.
            reported = degraded_reason(body) == "PodsNotCreated"
            since = (episode, now - self._pods_not_created_after if reported else now)
            self._missing_since[key] = since
        due = since[1] + self._pods_not_created_after - now
        if due > 0:
            if key not in self._missing_timers:
                self._missing_timers[key] = asyncio.get_running_loop().call_later(due + 0.1, self._missing_due, key)
            return None
        # Read the DaemonSet's latest FailedCreate event once per episode and count of pods scheduled.
        cause_key = (*episode, int(ds_status.get("currentNumberScheduled", 0)))
        cached = self._missing_cause.get(key)
        if cached is None or cached[0] != cause_key:
            cached = (cause_key, await self._failed_create_message(key, episode[0]))
            self._missing_cause[key] = cached
        return cached[1]

    def _missing_due(self, key: ConfigKey) -> None:
        self._missing_timers.pop(key, None)
        self.enqueue(key)

    def _forget_missing(self, key: ConfigKey) -> None:
        self._missing_since.pop(key, None)
        self._missing_cause.pop(key, None)
        timer = self._missing_timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    async def _failed_create_message(self, key: ConfigKey, ds_uid: str) -> str:
        """The message of the DaemonSet's latest FailedCreate event ("" if none, or the read failed: the status
        then points to the events)."""
        selector = (
            f"involvedObject.kind=DaemonSet,involvedObject.name={key.daemonset},"
            f"involvedObject.uid={ds_uid},reason=FailedCreate"
        )
        try:
            events = await self._api.list_events(key.namespace, selector)
        except Exception as exc:  # a read for a better message only: never fails the reconcile
            log.warning("reconcile %s: reading the DaemonSet's events failed: %s", key, _describe(exc))
            return ""
        if not events:
            return ""
        latest = max(events, key=_event_time)
        return str(latest.get("message") or "")

    async def _config_hash(
        self, key: ConfigKey, spec: DevicePluginConfigSpec, live: Mapping[str, Any] | None
    ) -> tuple[str | None, tuple[str, str] | None]:
        """The referenced ConfigMap's content hash for the pod template, and a problem when it is missing."""
        if spec.configMapRef is None:
            return None, None
        found = await self._view.configmap_hash(key.namespace, spec.configMapRef.name)
        if found is not None:
            return found, None
        problem = ("ConfigMapMissing", f"ConfigMap {key.namespace}/{spec.configMapRef.name} not found")
        # Keep the hash the pods run with: a rollout now would only make pods that cannot mount their ConfigMap.
        return _template_annotation(live, CONFIG_HASH_ANNOTATION) or "missing", problem

    def _resolve(self) -> dict[ConfigKey, conflict_rules.Resolution]:
        if self._resolution is None:
            candidates = [c for c in (candidate_of(b) for b in self._view.configs()) if c is not None]
            self._resolution = conflict_rules.resolve(candidates, self._view.nodes())
        return self._resolution

    async def _apply_daemonset(
        self, key: ConfigKey, uid: str, rendered: dict[str, Any], live: Mapping[str, Any] | None
    ) -> _Applied:
        """Create or repair the DaemonSet, turning the API server's refusals into a problem to report. A write that
        was refused is not sent again while neither our rendering nor the live DaemonSet changed: it would be
        refused again (the status write and its echo each brought a reconcile, so it went out three times)."""
        attempt = (render_hash(rendered), _version(live) if live is not None else None)
        refused = self._refused.get(key)
        if refused is not None and refused[0] == attempt:
            self._metrics.failures.labels(refused[1]).inc()
            return _Applied(live, problem=refused[2])
        self._refused.pop(key, None)
        applied = await self._send_daemonset(key, uid, rendered, live)
        if applied.refused is not None and applied.problem is not None:
            self._refused[key] = (attempt, applied.refused, applied.problem)
        return applied

    async def _send_daemonset(
        self, key: ConfigKey, uid: str, rendered: dict[str, Any], live: Mapping[str, Any] | None
    ) -> _Applied:
        try:
            if live is None and key in self._not_ours_seen:
                # Last time a DaemonSet of this name was someone else's: read before writing again, so the retries
                # while it stays are reads only.
                existing = await self._get_daemonset(key)
                if existing is not None:
                    return await self._adopt_or_leave(key, uid, rendered, existing)
            if live is None:
                return await self._create_daemonset(key, uid, rendered)
            if _controller_uid(live) not in (None, uid):
                return self._not_ours(key)  # e.g. left by a deleted config of the same name, until it is collected
            self._not_ours_seen.discard(key)
            written = await self._update_daemonset(key, rendered, live)
        except Exception as exc:
            # The API server's answers, and anything raised while building or sending the request: the Kubernetes
            # client checks the body against its models first (pydantic ValidationError); left to reconcile(), such
            # a failure wrote no status, so a config whose DaemonSet could not be sent kept reading Available.
            if isinstance(exc, ApiException) and exc.status in (404, 409):
                return _Applied(live, stale=True)
            if is_transient(exc):
                self._metrics.failures.labels("api_error").inc()
                message = f"the API server did not take the DaemonSet ({_describe(exc)}): retrying"
                log.warning("reconcile %s: %s", key, message)  # the retry's own line says when
                return _Applied(live, problem=("DaemonSetWriteFailed", message), retry=True)
            cause, message = _refusal(key, exc)
            self._metrics.failures.labels(cause).inc()
            return _Applied(live, problem=("DaemonSetRejected", message), refused=cause)
        return _Applied(written or live, changed=written is not None)

    async def _create_daemonset(self, key: ConfigKey, uid: str, rendered: dict[str, Any]) -> _Applied:
        affinity = rendered["spec"]["template"]["spec"].get("affinity")
        log.info("creating DaemonSet %s/%s", key.namespace, key.daemonset, extra={"excludedNodes": _excluded(affinity)})
        self._metrics.writes.labels("daemonset_create").inc()
        try:
            created = await self._write(self._ds_echo, key, None, self._api.create_daemonset(rendered))
        except ApiException as exc:
            if exc.status != 409:
                raise
            existing = await self._get_daemonset(key)
            if existing is None:
                return _Applied(None, stale=True)  # gone again meanwhile: try once more
            return await self._adopt_or_leave(key, uid, rendered, existing)
        self._not_ours_seen.discard(key)
        return _Applied(created, changed=True)

    async def _get_daemonset(self, key: ConfigKey) -> dict[str, Any] | None:
        try:
            return await self._api.get_daemonset(key.namespace, key.daemonset)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def _adopt_or_leave(
        self, key: ConfigKey, uid: str, rendered: dict[str, Any], existing: Mapping[str, Any]
    ) -> _Applied:
        """The DaemonSet exists but the (label-filtered) watch does not show it: if its controller is this config,
        it is ours with its labels edited by hand (drift: repaired), or the watch is just late (nothing to do);
        anyone else's is left alone."""
        if _controller_uid(existing) != uid:
            return self._not_ours(key)
        self._not_ours_seen.discard(key)
        log.info("DaemonSet %s/%s is ours though the watch does not show it", key.namespace, key.daemonset)
        written = await self._update_daemonset(key, rendered, existing)
        return _Applied(written or existing, changed=written is not None)

    def _not_ours(self, key: ConfigKey) -> _Applied:
        """Left alone and reported; retried with the backoff, since deleting that DaemonSet (as the message says)
        sends us no event when it is outside our label-filtered watch."""
        self._metrics.failures.labels("conflict").inc()
        self._not_ours_seen.add(key)
        message = (
            f"DaemonSet {key.namespace}/{key.daemonset} exists and is not managed by this config: delete or rename it"
        )
        return _Applied(None, problem=("DaemonSetNotOurs", message), retry=True)

    async def _update_daemonset(
        self, key: ConfigKey, rendered: dict[str, Any], live: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Replace the DaemonSet with what we rendered; None when it already carries that."""
        drift = drifted_fields(rendered, live)
        if render_hash(live) == render_hash(rendered) and not drift:
            return None
        affinity = rendered["spec"]["template"]["spec"].get("affinity")
        log.info(
            "updating DaemonSet %s/%s: %s",
            key.namespace,
            key.daemonset,
            ", ".join(drift[:5]) or "new rendering",
            extra={"drift": drift[:20], "excludedNodes": _excluded(affinity)},
        )
        live_meta = live["metadata"]
        body = {
            **rendered,
            "metadata": {
                **rendered["metadata"],
                "resourceVersion": live_meta.get("resourceVersion"),
                # Labels/annotations others put on the DaemonSet stay; ours win.
                "labels": {**(live_meta.get("labels") or {}), **rendered["metadata"]["labels"]},
                "annotations": {**(live_meta.get("annotations") or {}), **rendered["metadata"]["annotations"]},
            },
        }
        self._metrics.writes.labels("daemonset_update").inc()
        return await self._write(
            self._ds_echo, key, live_meta.get("resourceVersion"), self._api.replace_daemonset(body)
        )

    async def _write_status(self, key: ConfigKey, body: Mapping[str, Any], observed: Observed) -> str:
        """Write the status computed from `observed` if it differs from the stored one: unchanged, changed or failed
        (refused or failed: logged and counted here, since the status, where failures are reported, is what failed;
        the caller retries with the backoff)."""
        previous = body.get("status") or {}
        status = compute_status(observed, previous, rfc3339(time.time()))
        self.statuses[key] = status
        if status == previous:
            return "unchanged"
        patch: dict[str, Any] = {k: None for k in previous if k not in status}
        patch.update(status)
        self._metrics.writes.labels("status").inc()
        try:
            await self._write(
                self._status_echo, key, body["metadata"].get("resourceVersion"), self._api.patch_status(key, patch)
            )
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                return "unchanged"  # deleted meanwhile
            if not (isinstance(exc, ApiException) or is_transient(exc)):
                raise  # a bug of ours: reconcile() logs it with its traceback
            why = _api_message(exc) if isinstance(exc, ApiException) else str(exc)
            log.warning("reconcile %s: the status could not be written: %s: %s", key, _describe(exc), why)
            self._metrics.failures.labels("api_error").inc()
            return "failed"
        return "changed"

    async def _write(
        self, echo: _Echo, key: ConfigKey, version_before: str | None, request: Awaitable[dict[str, Any]]
    ) -> dict[str, Any]:
        """Send a write, marking its echo as awaited first: the watch event may arrive before the response does."""
        echo.wrote(key, version_before)
        try:
            result = await request
        except BaseException:
            echo.forget(key)
            raise
        if _version(result) == version_before:
            echo.forget(key)  # the write changed nothing (the cache was behind): no watch event will follow
        else:
            asyncio.get_running_loop().call_later(ECHO_TIMEOUT + 0.1, self.enqueue, key)
        return result


def _controller_uid(body: Mapping[str, Any]) -> str | None:
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    return next((str(r.get("uid")) for r in refs if r.get("controller")), None)


def _outdated(applied: _Applied, rendered: Mapping[str, Any]) -> str | None:
    """Why the live DaemonSet does not run what this config now renders (None: it does, or there is none)."""
    if applied.live is None:
        return None
    if applied.problem is not None:
        return f"the DaemonSet still runs an older rendering of this config: {applied.problem[1]}"
    if render_hash(applied.live) != render_hash(rendered):
        return "the DaemonSet still runs an older rendering of this config: its update is pending"
    return None


def _not_excluded(ds: Mapping[str, Any] | None, excluded: frozenset[str]) -> tuple[str, ...]:
    """Nodes to exclude that the live DaemonSet's pod template does not keep out."""
    if ds is None or not excluded:
        return ()
    affinity = ((ds.get("spec") or {}).get("template") or {}).get("spec", {}).get("affinity")
    return tuple(sorted(excluded - set(_excluded(affinity))))


def _event_time(event: Mapping[str, Any]) -> str:
    """When an Event last happened (RFC 3339 text sorts chronologically; the API server fills one of these)."""
    series = event.get("series") or {}
    meta = event.get("metadata") or {}
    return str(
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or meta.get("creationTimestamp")
        or ""
    )


def _template_annotation(ds: Mapping[str, Any] | None, name: str) -> str | None:
    template_meta = ((ds or {}).get("spec") or {}).get("template", {}).get("metadata") or {}
    value = (template_meta.get("annotations") or {}).get(name)
    return str(value) if value is not None else None


def _version(body: Mapping[str, Any]) -> str | None:
    value = (body.get("metadata") or {}).get("resourceVersion")
    return str(value) if value is not None else None


def _excluded(affinity: Mapping[str, Any] | None) -> list[str]:
    terms = (affinity or {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return [v for t in terms.get("nodeSelectorTerms", []) for f in t.get("matchFields", []) for v in f["values"]]


def _refusal(key: ConfigKey, exc: Exception) -> tuple[str, str]:
    """The failure cause (metric label) and the status message of a DaemonSet write that failed for good, logged."""
    if isinstance(exc, ApiException):
        cause, message = "api_error", f"the API server refused the DaemonSet: {_api_message(exc)}"
    elif isinstance(exc, ValidationError):
        message = f"the Kubernetes client refused the DaemonSet before sending it: {_client_message(exc)}"
        cause = "invalid_spec"
    else:
        log.error("reconcile %s: writing the DaemonSet failed", key, exc_info=exc)
        return "internal", f"the DaemonSet could not be written: {type(exc).__name__}: {exc}"
    log.warning("reconcile %s: %s", key, message)
    return cause, message


def _errors_message(exc: ValidationError, prefix: str = "", skip_argument: bool = False) -> str:
    """pydantic's first three complaints as `path: message`; `skip_argument`: the first location is the position of
    the argument the client checked, not part of the path."""
    parts = []
    for e in exc.errors()[:3]:
        loc = [str(p) for p in e["loc"]]
        if skip_argument and loc and loc[0].isdigit():
            loc = loc[1:]
        parts.append(f"{prefix}{'.'.join(loc)}: {e['msg']}")
    return "; ".join(parts)


def _validation_message(exc: ValidationError) -> str:
    return _errors_message(exc, prefix="spec.")


def _client_message(exc: ValidationError) -> str:
    """The client's own complaint, with paths into the DaemonSet."""
    return _errors_message(exc, skip_argument=True)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def _api_message(exc: ApiException) -> str:
    import json

    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)
