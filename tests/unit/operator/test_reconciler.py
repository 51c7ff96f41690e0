"""The reconciler against a fake watch cache and a fake API: retries of transient failures with backoff, final 4xx
refusals, adopting its own DaemonSet back after a hand relabel, readiness while a new spec is refused, a deleted
ConfigMap, and what reconcile_total counts.

The API is a fake because the faults are ones a real API server does not produce on demand (503s, throttling,
connection errors, a 422 for a chosen request). What the real API server does with these cases is covered in
tests/e2e/test_operator.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from deviceplane.operator import conflicts as conflict_rules
from deviceplane.operator.drift import drifted_fields
from deviceplane.operator.handlers import _daemonset_key
from deviceplane.operator.metrics import OperatorMetrics
from deviceplane.operator.names import CONFIG_HASH_ANNOTATION, MANAGED_BY_LABEL, ConfigKey
from deviceplane.operator.reconciler import Reconciler, _Backoff, is_transient
from deviceplane.operator.render import Owner, render_daemonset
from deviceplane.operator.status import Observed, compute_status

from .helpers import spec

KEY = ConfigKey("plugins", "cola")
UID = "u1"
FAST_RETRY = 0.01  # seconds: the first backoff in these tests (the doubling and the cap are tested on _Backoff)


def config_body(generation: int = 1, **fields: Any) -> dict[str, Any]:
    meta = {
        "namespace": KEY.namespace,
        "name": KEY.name,
        "uid": UID,
        "generation": generation,
        "resourceVersion": "10",
        "creationTimestamp": "2024-01-01T00:00:00Z",
    }
    return {"metadata": meta, "spec": {"resourceName": "example.com/cola", "image": "img:1", **fields}, "status": {}}


def live_daemonset(ready: bool = True, **fields: Any) -> dict[str, Any]:
    """What the API server would hold for the config's first generation, rolled out on 2 nodes."""
    ds = render_daemonset(Owner(KEY, UID), spec(resourceName="example.com/cola", **fields))
    ds["metadata"].update(resourceVersion="50", generation=1, uid="ds1")
    n = 2 if ready else 0
    ds["status"] = {
        "observedGeneration": 1,
        "desiredNumberScheduled": 2,
        "currentNumberScheduled": 2,
        "updatedNumberScheduled": n,
        "numberAvailable": n,
        "numberReady": n,
    }
    return ds


def api_error(status: int, message: str = "") -> ApiException:
    exc = ApiException(status=status, reason={409: "Conflict", 422: "Unprocessable Entity"}.get(status, "Error"))
    exc.body = json.dumps({"message": message or exc.reason})
    return exc


class FakeView:
    """The watch caches: one config, its DaemonSet (None: not in the label-filtered watch), a ConfigMap hash, and
    other configs (whose DaemonSets are not looked at)."""

    def __init__(self, body: dict[str, Any], ds: dict[str, Any] | None = None, cm_hash: str | None = None) -> None:
        self.body, self.ds, self.cm_hash = body, ds, cm_hash
        self.others: list[dict[str, Any]] = []
        self.cm_errors: list[Exception] = []  # raised, in order, by the next ConfigMap reads

    def config(self, key: ConfigKey) -> dict[str, Any] | None:
        return self.body

    def configs(self) -> list[dict[str, Any]]:
        return [self.body, *self.others]

    def nodes(self) -> list[conflict_rules.NodeInfo]:
        return [conflict_rules.NodeInfo("n1")]

    def daemonset(self, key: ConfigKey) -> dict[str, Any] | None:
        return self.ds

    def pod_problems(self, key: ConfigKey) -> list[Any]:
        return []

    async def configmap_hash(self, namespace: str, name: str) -> str | None:
        if self.cm_errors:
            raise self.cm_errors.pop(0)
        return self.cm_hash


class FakeApi:
    """Records requests; `errors` are raised, in order, by the next DaemonSet writes. With `watch` set, a successful
    write updates the view and tells the reconciler, as the watch events would."""

    def __init__(self, view: FakeView, errors: list[Exception] | None = None) -> None:
        self.view = view
        self.errors = list(errors or [])
        self.creates: list[dict[str, Any]] = []
        self.replaces: list[dict[str, Any]] = []
        self.gets = 0
        self.existing: dict[str, Any] | None = None  # what a GET of the DaemonSet returns
        self.statuses: list[dict[str, Any]] = []
        self.watch: Reconciler | None = None
        self.events: list[dict[str, Any]] = []  # what listing Events returns
        self.event_selectors: list[str] = []
        self.status_errors: list[Exception] = []  # raised, in order, by the next status writes

    async def create_daemonset(self, body: dict[str, Any]) -> dict[str, Any]:
        self.creates.append(body)
        if self.existing is not None and not self.errors:
            raise api_error(409)  # as the API server answers while a DaemonSet of that name exists
        return self._stored(body, "100")

    async def replace_daemonset(self, body: dict[str, Any]) -> dict[str, Any]:
        self.replaces.append(body)
        return self._stored(body, "101")

    async def get_daemonset(self, namespace: str, name: str) -> dict[str, Any]:
        self.gets += 1
        if self.existing is None:
            raise api_error(404)
        return copy.deepcopy(self.existing)

    async def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]:
        self.event_selectors.append(field_selector)
        return copy.deepcopy(self.events)

    async def patch_status(self, key: ConfigKey, patch: dict[str, Any]) -> dict[str, Any]:
        self.statuses.append(patch)
        if self.status_errors:
            raise self.status_errors.pop(0)
        version = str(11 + len(self.statuses))
        body = self.view.body
        status = {k: v for k, v in {**body["status"], **patch}.items() if v is not None}
        self.view.body = {**body, "status": status, "metadata": {**body["metadata"], "resourceVersion": version}}
        if self.watch is not None:
            self.watch.seen_config(KEY, version)
            self.watch.enqueue(KEY)
        return {"metadata": {"resourceVersion": version}}

    def _stored(self, body: dict[str, Any], version: str) -> dict[str, Any]:
        if self.errors:
            raise self.errors.pop(0)
        out = copy.deepcopy(body)
        out["metadata"].update(resourceVersion=version, generation=1)
        if self.watch is not None:
            self.view.ds = out
            self.watch.seen_daemonset(KEY, version)
            self.watch.enqueue(KEY)
        return out


def conditions(api: FakeApi) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in api.view.body["status"].get("conditions", [])}


def run_workers(reconciler: Reconciler, until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Run the reconciler's workers on the key until `until()` holds (or the timeout: then the test's asserts fail)."""

    async def go() -> None:
        task = asyncio.create_task(reconciler.run())
        reconciler.enqueue(KEY)
        deadline = asyncio.get_running_loop().time() + timeout
        while not until() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 (polls a fake)
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(go())


def started(view: FakeView, errors: list[Exception] | None = None) -> tuple[Reconciler, FakeApi, OperatorMetrics]:
    api = FakeApi(view, errors)
    metrics = OperatorMetrics()
    reconciler = Reconciler(view, api, metrics, workers=1, retry_base=FAST_RETRY)  # type: ignore[arg-type]
    api.watch = reconciler
    return reconciler, api, metrics


def once(reconciler: Reconciler) -> str:
    async def go() -> str:
        return await reconciler.reconcile(KEY)

    return asyncio.run(go())


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# ---- transient failures are retried with backoff; other refusals are final ---------------------------------------


@pytest.mark.parametrize(
    "errors",
    [
        [api_error(503), api_error(503), api_error(503)],
        [api_error(429)],
        [urllib3.exceptions.MaxRetryError(None, "/", "connection refused")],  # type: ignore[arg-type]
        [urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out")],  # type: ignore[arg-type]
        [ConnectionResetError("connection reset by peer")],
    ],
    ids=["503-three-times", "429", "connection-refused", "read-timeout", "connection-reset"],
)
def test_a_transient_api_failure_is_retried_until_the_daemonset_exists(errors: list[Exception]) -> None:
    """The API server is briefly unavailable (a restart, throttling, a dropped connection): the reconciler retries
    on its own, with no event to wake it, until the DaemonSet is created, and the status ends up clean."""
    view = FakeView(config_body())
    reconciler, api, metrics = started(view, errors)
    run_workers(
        reconciler, lambda: view.ds is not None and conditions(api).get("Degraded", {}).get("status") == "False"
    )
    assert view.ds is not None, f"no DaemonSet after {len(api.creates)} attempts"
    assert len(api.creates) == len(errors) + 1
    assert conditions(api)["Degraded"]["status"] == "False", conditions(api)["Degraded"]
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="api_error") == len(errors)
    assert reconciler._backoff.failures == {}, "the backoff must be reset by the success"


def test_a_transient_failure_is_reported_while_retrying(caplog: pytest.LogCaptureFixture) -> None:
    """While the API server keeps answering 503, Degraded says the DaemonSet write failed and is being retried, and
    so does the log, with the cause (it said only when the next attempt would be)."""
    view = FakeView(config_body())
    reconciler, api, _ = started(view, [api_error(503)] * 100)
    with caplog.at_level(logging.WARNING, logger="deviceplane.operator"):
        run_workers(reconciler, lambda: len(api.creates) >= 3)
    assert len(api.creates) >= 3
    degraded = conditions(api)["Degraded"]
    assert degraded["reason"] == "DaemonSetWriteFailed" and "retrying" in degraded["message"], degraded
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "DaemonSet" in r.getMessage()]
    assert len(failed) >= 3 and all("503" in line and str(KEY) in line for line in failed), failed


def test_a_4xx_refusal_is_final_until_the_config_changes(caplog: pytest.LogCaptureFixture) -> None:
    """422 will not pass by itself: one attempt, reported as DaemonSetRejected, no retry however long we wait, and
    not re-sent on events that change neither the rendering nor the DaemonSet (its own status write, an annotation
    on the config: each brought one more refused create); a spec change makes the next attempt."""
    view = FakeView(config_body())
    reconciler, api, metrics = started(
        view, [api_error(422, "spec.template: invalid"), api_error(422, "still invalid")]
    )
    api.watch = None  # no watch events: only a retry could make another attempt

    async def go() -> None:
        task = asyncio.create_task(reconciler.run())
        reconciler.enqueue(KEY)
        await asyncio.sleep(50 * FAST_RETRY)  # several backoff periods
        assert len(api.creates) == 1, "a 4xx refusal was retried"
        for i in range(3):  # events that change nothing the DaemonSet is made of
            reconciler.seen_config(KEY, f"annotated-{i}")
            reconciler.enqueue(KEY)
            await asyncio.sleep(5 * FAST_RETRY)
        assert len(api.creates) == 1, "a refused create was re-sent unchanged"
        assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="api_error") == 4
        view.body = config_body(generation=2, image="img:2")  # the config changed: its watch event
        reconciler.seen_config(KEY, "changed-by-someone")
        reconciler.enqueue(KEY)
        await asyncio.sleep(50 * FAST_RETRY)
        task.cancel()

    with caplog.at_level(logging.WARNING, logger="deviceplane.operator"):
        asyncio.run(go())
    assert len(api.creates) == 2
    degraded = conditions(api)["Degraded"]
    assert degraded["reason"] == "DaemonSetRejected" and "still invalid" in degraded["message"], degraded
    refused = [r.getMessage() for r in caplog.records if "refused the DaemonSet" in r.getMessage()]
    assert len(refused) == 2 and "still invalid" in refused[1], refused  # once per refused write, not per reconcile


def client_refusal() -> ValidationError:
    """What the real Kubernetes client raises, before sending anything, for a body its models do not take."""
    from kubernetes import client

    api = client.AppsV1Api(client.ApiClient(client.Configuration(host="http://127.0.0.1:9")))
    body = {"spec": {"template": {"spec": {"containers": [{"name": "c", "securityContext": {"runAsUSer": 0}}]}}}}
    with pytest.raises(ValidationError) as err:
        api.create_namespaced_daemon_set("plugins", body)
    return err.value


@pytest.mark.parametrize("exists", [True, False], ids=["update", "create"])
def test_a_daemonset_the_client_refuses_to_send_is_reported(exists: bool) -> None:
    """The client's refusal is a pydantic ValidationError, not an ApiException: it must still end in a written
    status (Degraded/DaemonSetRejected naming the field, Ready False), not in an `internal` failure that left an
    edited config reading Available and a deleted DaemonSet never recreated. No retry: it would be refused again."""
    view = FakeView(config_body(generation=2, image="img:2"), ds=live_daemonset() if exists else None)
    reconciler, api, metrics = started(view, [client_refusal()])
    api.watch = None
    assert once(reconciler) == "failed"
    conds = conditions(api)
    assert conds["Degraded"]["reason"] == "DaemonSetRejected", conds["Degraded"]
    message = conds["Degraded"]["message"]
    assert "client refused" in message and "spec.template.spec.containers.0.securityContext.runAsUSer" in message
    assert conds["Ready"]["status"] == "False"
    assert conds["Ready"]["reason"] == ("DaemonSetOutdated" if exists else "DaemonSetMissing"), conds["Ready"]
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="internal") == 0
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="invalid_spec") == 1
    assert reconciler._retry_timers == {}


def test_backoff_doubles_per_failure_up_to_its_cap_and_resets() -> None:
    backoff = _Backoff(base=0.5, cap=4.0)
    assert [backoff.next_delay(KEY) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    other = ConfigKey("plugins", "other")
    assert backoff.next_delay(other) == 0.5, "the backoff is per key"
    backoff.reset(KEY)
    assert backoff.next_delay(KEY) == 0.5


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (api_error(500), True),
        (api_error(503), True),
        (api_error(429), True),
        (api_error(400), False),
        (api_error(403), False),
        (api_error(422), False),
        (urllib3.exceptions.ProtocolError("connection aborted"), True),
        (TimeoutError(), True),
        (ValueError("a bug"), False),
    ],
)
def test_what_counts_as_transient(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


# ---- the operator's own DaemonSet, relabelled by hand, is adopted back ---------------------------------------------


def test_a_409_for_our_own_relabelled_daemonset_adopts_and_repairs_it() -> None:
    """Its managed-by label removed by hand, the DaemonSet drops out of the label-filtered watch, so the create gets
    409. Its controller ownerReference is this config's uid: the operator replaces it with the rendered object
    (labels restored) instead of reporting DaemonSetNotOurs."""
    view = FakeView(config_body())
    reconciler, api, metrics = started(view, [api_error(409)])
    existing = live_daemonset()
    del existing["metadata"]["labels"][MANAGED_BY_LABEL]
    api.existing = existing
    assert once(reconciler) == "changed"
    (replaced,) = api.replaces
    assert replaced["metadata"]["labels"][MANAGED_BY_LABEL] == "deviceplane-operator"
    assert replaced["metadata"]["resourceVersion"] == "50"
    assert conditions(api)["Degraded"]["status"] == "False", conditions(api)["Degraded"]
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="conflict") == 0


def test_a_409_for_our_own_daemonset_the_watch_has_not_shown_yet_sends_no_write() -> None:
    """The same 409 when the watch is merely late (nothing edited): the DaemonSet is ours and carries what we
    render, so there is nothing to repair and nothing to report."""
    view = FakeView(config_body())
    reconciler, api, _ = started(view, [api_error(409)])
    api.existing = live_daemonset()
    once(reconciler)
    assert api.replaces == [] and api.gets == 1
    assert conditions(api)["Degraded"]["status"] == "False", conditions(api)["Degraded"]


def test_a_409_for_someone_elses_daemonset_is_reported_and_left_alone() -> None:
    view = FakeView(config_body())
    reconciler, api, metrics = started(view, [api_error(409)])
    foreign = live_daemonset()
    foreign["metadata"]["ownerReferences"] = []
    api.existing = foreign
    assert once(reconciler) == "failed"
    assert api.replaces == []
    assert conditions(api)["Degraded"]["reason"] == "DaemonSetNotOurs"
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="conflict") == 1


def test_deleting_someone_elses_daemonset_lets_the_retry_create_ours_with_reads_only_meanwhile() -> None:
    """DaemonSetNotOurs says "delete or rename it", and a DaemonSet outside the label-filtered watch sends no event
    when it goes: the operator retries with its backoff, reading (not re-sending the create) while it stays, and
    creates its own once it is gone, with no event to wake it."""
    view = FakeView(config_body())
    reconciler, api, _ = started(view, [api_error(409)])
    foreign = live_daemonset()
    foreign["metadata"]["ownerReferences"] = []
    api.existing = foreign

    async def go() -> None:
        task = asyncio.create_task(reconciler.run())
        reconciler.enqueue(KEY)
        await asyncio.sleep(40 * FAST_RETRY)  # several backoff periods
        assert conditions(api)["Degraded"]["reason"] == "DaemonSetNotOurs"
        assert len(api.creates) == 1, "the create was sent again while the foreign DaemonSet stayed"
        assert api.gets >= 3, f"no retry: {api.gets} reads"
        api.existing = None  # `kubectl delete ds`: no event reaches the operator
        deadline = asyncio.get_running_loop().time() + 5
        while view.ds is None and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 (polls a fake)
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(go())
    assert view.ds is not None and len(api.creates) == 2
    assert conditions(api)["Degraded"]["status"] == "False", conditions(api)["Degraded"]


def test_a_daemonset_controlled_by_another_config_uid_is_not_replaced() -> None:
    """E.g. left by a deleted config of the same name until the garbage collector removes it."""
    old = live_daemonset()
    old["metadata"]["ownerReferences"][0]["uid"] = "uid-of-a-deleted-config"
    view = FakeView(config_body(), ds=old)
    reconciler, api, _ = started(view)
    assert once(reconciler) == "failed"
    assert api.replaces == []
    assert conditions(api)["Degraded"]["reason"] == "DaemonSetNotOurs"


def test_daemonsets_are_keyed_by_their_name_not_their_editable_label() -> None:
    ds = live_daemonset()
    ds["metadata"]["labels"]["deviceplane.io/config"] = "elsewhere"
    assert _daemonset_key(ds) == KEY
    assert _daemonset_key({"metadata": {"namespace": "plugins", "name": "unrelated"}}) is None


# ---- readiness while a new spec is refused; reconcile_total agrees with the failures -------------------------------


def test_ready_is_false_while_the_api_server_refuses_the_new_spec() -> None:
    """The old DaemonSet is fully available, but the config's new generation was refused (422): its pods run a
    spec the config no longer asks for, so Ready is False with a reason saying so."""
    view = FakeView(config_body(generation=2, image="img:2"), ds=live_daemonset())
    reconciler, api, metrics = started(view, [api_error(422, 'DaemonSet.apps "cola-plugin" is invalid')])
    assert once(reconciler) == "failed"
    status = api.statuses[-1]
    conds = {c["type"]: c for c in status["conditions"]}
    assert status["observedGeneration"] == 2
    assert conds["Degraded"]["reason"] == "DaemonSetRejected"
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "DaemonSetOutdated", conds["Ready"]
    assert "refused" in conds["Ready"]["message"]
    assert sample(metrics, "deviceplane_operator_reconcile_total", result="failed") == 1


def test_ready_holds_when_the_daemonset_carries_the_current_rendering() -> None:
    view = FakeView(config_body(), ds=live_daemonset())
    reconciler, api, _ = started(view)
    once(reconciler)
    assert api.replaces == [] and api.creates == []
    assert conditions(api)["Ready"]["status"] == "True", conditions(api)["Ready"]


def test_paused_config_with_an_older_daemonset_is_not_called_outdated() -> None:
    view = FakeView(config_body(generation=2, image="img:2", paused=True), ds=live_daemonset())
    reconciler, api, _ = started(view)
    once(reconciler)
    assert api.replaces == []
    assert conditions(api)["Ready"]["reason"] != "DaemonSetOutdated"


def test_an_invalid_spec_counts_as_a_failed_reconcile() -> None:
    body = config_body()
    del body["spec"]["image"]  # the CRD schema refuses this; the operator must not rely on it alone
    reconciler, api, metrics = started(FakeView(body))
    assert once(reconciler) == "failed"
    assert conditions(api)["Degraded"]["reason"] == "InvalidSpec"
    assert sample(metrics, "deviceplane_operator_reconcile_total", result="failed") == 1
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="invalid_spec") == 1


# ---- a deleted ConfigMap does not roll the plugin ------------------------------------------------------------------


def test_a_missing_configmap_keeps_the_running_config_hash() -> None:
    """A pod whose ConfigMap volume is missing cannot start: while the ConfigMap is gone, the pod template keeps
    the hash the pods run with (no rollout), and Degraded says ConfigMapMissing."""
    ref = {"name": "cola-config"}
    live = render_daemonset(
        Owner(KEY, UID), spec(resourceName="example.com/cola", configMapRef=ref), config_hash="abc123"
    )
    live["metadata"].update(resourceVersion="50", generation=1)
    view = FakeView(config_body(configMapRef=ref), ds=live, cm_hash=None)
    reconciler, api, _ = started(view)
    once(reconciler)
    assert api.replaces == [], drifted_fields(api.replaces[0], live) if api.replaces else None
    assert conditions(api)["Degraded"]["reason"] == "ConfigMapMissing"


def test_a_missing_configmap_before_the_daemonset_exists_still_creates_it() -> None:
    ref = {"name": "cola-config"}
    reconciler, api, _ = started(FakeView(config_body(configMapRef=ref), cm_hash=None))
    once(reconciler)
    (created,) = api.creates
    assert created["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == "missing"


# ---- a refused request other than the DaemonSet write -----------------------------------------------------------


def rbac_refusal(doing: str) -> ApiException:
    """A 403 as KubeApi raises it: the API server's answer, with what the request was for as a note."""
    exc = api_error(403, f'configmaps is forbidden: User "op" cannot list resource "configmaps" in "{KEY.namespace}"')
    exc.reason = "Forbidden"
    exc.add_note(f"while {doing}")
    return exc


def test_a_refused_read_is_reported_and_retried_until_it_is_taken() -> None:
    """A 403 on the ConfigMap read (RBAC) wrote no status and was never retried: the user saw only a log line. Now
    Degraded says RequestRefused naming the request and the API server's answer, the config is retried with the
    backoff (nothing the operator watches changes when RBAC is fixed), and once the read is taken the DaemonSet is
    created and Degraded clears."""
    ref = {"name": "cola-config"}
    view = FakeView(config_body(configMapRef=ref), cm_hash="abc123")
    view.cm_errors = [rbac_refusal(f"listing ConfigMaps in {KEY.namespace} named cola-config")] * 3
    reconciler, api, metrics = started(view)
    run_workers(reconciler, lambda: view.ds is not None and conditions(api)["Degraded"]["status"] == "False")

    refused = {c["type"]: c for c in api.statuses[0]["conditions"]}  # the first status written
    degraded = refused["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "RequestRefused"), degraded
    assert degraded["message"].startswith(
        f"the API server refused listing ConfigMaps in {KEY.namespace} named cola-config: 403 Forbidden: "
        'configmaps is forbidden: User "op" cannot list'
    ), degraded
    assert (refused["Ready"]["status"], refused["Ready"]["reason"]) == ("False", "DaemonSetMissing")
    assert (refused["Progressing"]["status"], refused["Progressing"]["reason"]) == ("False", "DaemonSetNotCreated")
    assert len(api.statuses) >= 2, "the refusal was written once, not at each retry: then the cleared status"

    assert view.cm_errors == [] and len(api.creates) == 1, "three refused reads, then the DaemonSet created once"
    assert conditions(api)["Degraded"]["reason"] == "AsExpected"
    assert conditions(api)["Ready"]["reason"] != "RequestRefused"
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="api_error") == 3
    assert reconciler._backoff.failures == {}, "the backoff must be reset by the success"


def test_a_refused_read_with_a_live_daemonset_leaves_ready_unknown() -> None:
    """The DaemonSet exists but this generation could not be rendered: whether it runs it is not known, so Ready
    is neither an Available nor an Outdated it cannot know."""
    ref = {"name": "cola-config"}
    view = FakeView(config_body(generation=2, configMapRef=ref), ds=live_daemonset(), cm_hash="abc123")
    view.cm_errors = [rbac_refusal("listing ConfigMaps")]
    reconciler, api, _ = started(view)
    api.watch = None
    assert once(reconciler) == "failed"
    ready = conditions(api)["Ready"]
    assert (ready["status"], ready["reason"]) == ("Unknown", "RequestRefused"), ready
    assert api.replaces == []


def test_a_refused_status_write_is_logged_counted_and_retried_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
    """The status, where failures are reported, is what is refused: logged and counted, never raised to the
    worker, and retried with the growing backoff (not at once, not in a hot loop)."""
    view = FakeView(config_body())
    reconciler, api, metrics = started(view)
    api.status_errors = [rbac_refusal("patching the status")] * 1000
    with caplog.at_level(logging.WARNING, logger="deviceplane.operator"):
        run_workers(reconciler, lambda: False, timeout=60 * FAST_RETRY)
    attempts = len(api.statuses)
    # Backoff 0.01, 0.02, 0.04, 0.08 ... s: 0.6 s hold about 6 attempts (a hot loop would make thousands).
    assert 3 <= attempts <= 8, attempts
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="api_error") == attempts
    assert sample(metrics, "deviceplane_operator_reconcile_failures_total", cause="internal") == 0
    written = [r.getMessage() for r in caplog.records if "the status could not be written" in r.getMessage()]
    assert len(written) == attempts and "403" in written[0] and "forbidden" in written[0], written
    assert not [r for r in caplog.records if r.exc_info], "a refused status write is not a traceback"


# ---- quantities the API server canonicalises ------------------------------------------------------------------------


def test_a_canonicalised_divisor_causes_no_update() -> None:
    """env valueFrom.resourceFieldRef.divisor is a quantity the API server canonicalises ("0.001" → "1m"): not
    drift, or every reconcile would send a DaemonSet update."""
    env = [{"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "0.001"}}}]
    live = live_daemonset(env=env)
    live["spec"]["template"]["spec"]["containers"][0]["env"][1]["valueFrom"]["resourceFieldRef"]["divisor"] = "1m"
    reconciler, api, _ = started(FakeView(config_body(env=env), ds=live))

    async def three() -> None:
        for _ in range(3):
            await reconciler.reconcile(KEY)
            reconciler._status_echo.forget(KEY)  # as if the watch had shown the status write

    asyncio.run(three())
    assert api.replaces == [], drifted_fields(live_daemonset(env=env), live)


# ---- pods the DaemonSet controller cannot create -------------------------------------------------------------------


def starved_daemonset() -> dict[str, Any]:
    """Observed at its generation, 3 nodes wanted, no pod created (e.g. its PriorityClass does not exist)."""
    ds = live_daemonset(ready=False)
    ds["status"].update(desiredNumberScheduled=3, currentNumberScheduled=0)
    return ds


FAILED_CREATE = [
    {"message": "old cause", "lastTimestamp": "2026-01-01T00:00:01Z"},
    {
        "message": 'pods "cola-plugin-" is forbidden: no PriorityClass with name does-not-exist was found',
        "lastTimestamp": "2026-01-01T00:00:09Z",
    },
]


def test_pods_not_created_for_a_while_is_degraded_with_the_latest_failed_create_event() -> None:
    """Not at once (the controller creates pods in a moment), but once the shortfall has lasted: Degraded names the
    cause from the DaemonSet's latest FailedCreate event, with no event or other write needed to get there."""
    view = FakeView(config_body(), ds=starved_daemonset())
    api = FakeApi(view)
    api.events = FAILED_CREATE
    reconciler = Reconciler(view, api, OperatorMetrics(), workers=1, pods_not_created_after=0.3)  # type: ignore[arg-type]
    api.watch = reconciler
    run_workers(reconciler, lambda: conditions(api).get("Degraded", {}).get("reason") == "PodsNotCreated", timeout=5)
    first = {c["type"]: c for c in api.statuses[0]["conditions"]}
    assert first["Degraded"]["reason"] == "AsExpected", "reported before the shortfall had lasted"
    degraded = conditions(api)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "PodsNotCreated", degraded
    assert degraded["message"] == (
        '3 plugin pods could not be created: pods "cola-plugin-" is forbidden: no PriorityClass with name '
        "does-not-exist was found"
    )
    (selector,) = api.event_selectors
    assert "involvedObject.name=cola-plugin" in selector and "involvedObject.uid=ds1" in selector
    assert "reason=FailedCreate" in selector


def test_pods_not_created_without_a_readable_event_points_to_the_events_and_survives_a_restart() -> None:
    view = FakeView(config_body(), ds=starved_daemonset())
    api = FakeApi(view)
    reconciler = Reconciler(view, api, OperatorMetrics(), workers=1, pods_not_created_after=0.05)  # type: ignore[arg-type]
    api.watch = reconciler
    run_workers(reconciler, lambda: conditions(api).get("Degraded", {}).get("reason") == "PodsNotCreated", timeout=5)
    assert "kubectl describe daemonset cola-plugin" in conditions(api)["Degraded"]["message"]

    # A restarted operator (nothing in memory) finds it reported already: it says the same at once, no write.
    writes = len(api.statuses)
    restarted = Reconciler(view, api, OperatorMetrics(), workers=1, pods_not_created_after=60)  # type: ignore[arg-type]
    assert once(restarted) == "unchanged"
    assert len(api.statuses) == writes


def test_a_brief_shortfall_or_one_of_an_older_generation_is_not_degraded() -> None:
    ds = starved_daemonset()
    ds["metadata"]["generation"] = 2  # the controller has not observed the new spec yet: its counts are old
    view = FakeView(config_body(), ds=ds)
    api = FakeApi(view)
    reconciler = Reconciler(view, api, OperatorMetrics(), workers=1, pods_not_created_after=0.0)  # type: ignore[arg-type]
    once(reconciler)
    assert conditions(api)["Degraded"]["reason"] == "AsExpected"
    assert api.event_selectors == []


def test_a_paused_config_says_its_daemonset_still_runs_on_nodes_it_now_yields() -> None:
    """An older config of the same resource now wants n1; this one is paused, so its DaemonSet keeps its old pod
    template without the exclusion: its Conflict message must say both plugins may serve n1."""
    view = FakeView(config_body(generation=2, paused=True), ds=live_daemonset())
    older = config_body()
    older["metadata"].update(name="older", uid="u0", creationTimestamp="2023-01-01T00:00:00Z")
    view.others = [older]
    reconciler, api, _ = started(view)
    once(reconciler)
    assert api.replaces == []
    conflict = conditions(api)["Conflict"]
    assert conflict["reason"] == "YieldsNodes"
    assert conflict["message"].endswith(
        "this config is paused and its DaemonSet does not exclude 1 node it yields, so both plugins may serve them "
        "until it is unpaused: n1"
    ), conflict["message"]


def test_an_older_config_paused_before_its_daemonset_was_created_leaves_the_node_until_unpaused() -> None:
    """The older config was paused before it had a DaemonSet, so it runs nowhere: this newer config keeps n1 (its
    DaemonSet does not exclude it) and says why. Unpaused (a new generation, not yet reconciled) the older one runs
    again and keeps n1 by age: this config's DaemonSet leaves it, in one update."""
    view = FakeView(config_body())
    older = config_body(paused=True)
    older["metadata"].update(name="older", uid="u0", creationTimestamp="2023-01-01T00:00:00Z")
    older["status"] = compute_status(Observed(1, True, None), None, "2023-01-01T00:00:01Z")
    view.others = [older]
    reconciler, api, _ = started(view)
    once(reconciler)
    (created,) = api.creates
    assert "affinity" not in created["spec"]["template"]["spec"], "the paused config's node was excluded"
    conflict = conditions(api)["Conflict"]
    assert conflict["reason"] == "KeepsNodes"
    assert "it is paused and has no DaemonSet" in conflict["message"], conflict["message"]

    older["spec"]["paused"] = False
    older["metadata"]["generation"] = 2
    reconciler.topology_changed()  # as the handlers do on the older config's new generation
    once(reconciler)
    (replaced,) = api.replaces
    affinity = replaced["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}
    ]
    assert conditions(api)["Conflict"]["reason"] == "YieldsNodes"
