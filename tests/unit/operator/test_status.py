"""Status from the DaemonSet, pods and conflicts: observedGeneration-aware readiness, messages that name causes."""

from __future__ import annotations

from typing import Any

from deviceplane.operator.conflicts import Conflict
from deviceplane.operator.names import ConfigKey
from deviceplane.operator.status import Observed, PodProblem, compute_status, idle_cause, pod_problem

NOW = "2026-11-23T10:00:00Z"


def ds(generation: int = 1, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "x-plugin", "generation": generation}, "status": status}


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_ready_when_the_controller_saw_this_generation_and_all_pods_are_up() -> None:
    live = ds(
        2,
        observedGeneration=2,
        desiredNumberScheduled=3,
        currentNumberScheduled=3,
        updatedNumberScheduled=3,
        numberAvailable=3,
        numberReady=3,
    )
    s = compute_status(Observed(5, False, live), None, NOW)
    assert (s["desiredNumberScheduled"], s["numberReady"], s["observedGeneration"], s["daemonSet"]) == (
        3,
        3,
        5,
        "x-plugin",
    )
    assert cond(s, "Ready")["status"] == "True" and cond(s, "Progressing")["status"] == "False"
    assert cond(s, "Ready")["observedGeneration"] == 5


def test_not_ready_while_the_controller_has_not_observed_the_new_generation() -> None:
    live = ds(3, observedGeneration=2, desiredNumberScheduled=3, updatedNumberScheduled=3, numberAvailable=3)
    s = compute_status(Observed(1, False, live), None, NOW)
    assert cond(s, "Ready")["status"] == "False"
    assert "generation 3" in cond(s, "Ready")["message"]
    assert cond(s, "Progressing")["status"] == "True"


def test_rolling_out_message_counts_and_missing_pods() -> None:
    live = ds(
        1,
        observedGeneration=1,
        desiredNumberScheduled=4,
        currentNumberScheduled=2,
        updatedNumberScheduled=1,
        numberAvailable=2,
        numberUnavailable=2,
    )
    s = compute_status(Observed(1, False, live), None, NOW)
    msg = cond(s, "Progressing")["message"]
    assert "2/4 available" in msg and "1/4 up to date" in msg and "2 pods not created" in msg


def test_no_daemonset_yet_and_paused() -> None:
    s = compute_status(Observed(1, False, None), None, NOW)
    assert cond(s, "Ready")["reason"] == "DaemonSetMissing" and "daemonSet" not in s
    paused = compute_status(Observed(1, True, ds(1, observedGeneration=1)), None, NOW)
    assert cond(paused, "Progressing")["reason"] == "Paused"


def test_degraded_names_failing_pods_bounded() -> None:
    problems = [PodProblem(f"x-plugin-{i}", f"node-{i}", "CrashLoopBackOff", "back-off 5m0s") for i in range(5)]
    s = compute_status(Observed(1, False, ds(1, observedGeneration=1), pod_problems=problems), None, NOW)
    degraded = cond(s, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PodsFailing"
    assert "5 plugin pods failing" in degraded["message"]
    assert "x-plugin-0 on node-0: CrashLoopBackOff (back-off 5m0s)" in degraded["message"]
    assert "x-plugin-4" not in degraded["message"] and "and 2 more" in degraded["message"]


def test_operator_problem_wins_in_degraded() -> None:
    s = compute_status(Observed(1, False, None, problem=("ConfigMapMissing", "ConfigMap ns/cfg not found")), None, NOW)
    assert cond(s, "Degraded")["message"] == "ConfigMap ns/cfg not found"


def test_conflict_condition_names_the_other_config_and_bounds_nodes() -> None:
    nodes = tuple(f"node-{i:02d}" for i in range(30))
    conflict = Conflict(ConfigKey("team-a", "gpu-old"), owner=False, nodes=nodes)
    s = compute_status(Observed(1, False, None, conflicts=[conflict]), None, NOW)
    c = cond(s, "Conflict")
    assert c["status"] == "True" and c["reason"] == "YieldsNodes"
    assert "team-a/gpu-old" in c["message"] and "30 nodes" in c["message"] and "node-29" not in c["message"]
    (view,) = s["conflicts"]
    assert view == {"config": "team-a/gpu-old", "owner": False, "nodes": list(nodes[:20]), "nodeCount": 30}


def test_transition_time_kept_while_status_holds_and_equal_input_gives_equal_output() -> None:
    first = compute_status(Observed(1, False, None), None, NOW)
    again = compute_status(Observed(1, False, None), first, "2026-11-23T11:00:00Z")
    assert again == first  # nothing changed: nothing to write
    live = ds(1, observedGeneration=1, desiredNumberScheduled=0)
    moved = compute_status(Observed(1, False, live), first, "2026-11-23T12:00:00Z")
    assert cond(moved, "Ready")["lastTransitionTime"] == "2026-11-23T12:00:00Z"
    assert cond(moved, "Degraded")["lastTransitionTime"] == NOW


def test_pod_problem_reads_waiting_terminated_unschedulable_and_failed() -> None:
    def pod(status: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": "p"}, "spec": {"nodeName": "n"}, "status": status}

    waiting = {
        "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}]
    }
    assert pod_problem(pod(waiting)) == PodProblem("p", "n", "ImagePullBackOff", "no such image")
    starting = {"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}
    assert pod_problem(pod(starting)) is None
    crashed = {"containerStatuses": [{"state": {"terminated": {"exitCode": 2, "reason": "Error"}}}]}
    assert pod_problem(pod(crashed)).reason == "Error"  # type: ignore[union-attr]
    unschedulable = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}
    assert pod_problem(pod(unschedulable)).reason == "Unschedulable"  # type: ignore[union-attr]
    assert pod_problem(pod({"phase": "Failed", "reason": "Evicted"})).reason == "Evicted"  # type: ignore[union-attr]
    assert pod_problem(pod({"phase": "Running"})) is None


def test_not_ready_while_the_daemonset_runs_an_outdated_rendering() -> None:
    """All pods available, but of a spec the config no longer asks for (its update was refused): not Ready."""
    live = ds(1, observedGeneration=1, desiredNumberScheduled=2, updatedNumberScheduled=2, numberAvailable=2)
    outdated = "the DaemonSet still runs an older rendering of this config: the API server refused the DaemonSet"
    s = compute_status(Observed(2, False, live, outdated=outdated), None, NOW)
    assert cond(s, "Ready")["status"] == "False" and cond(s, "Ready")["reason"] == "DaemonSetOutdated"
    assert "refused" in cond(s, "Ready")["message"]
    paused = compute_status(Observed(2, True, live, outdated=outdated), None, NOW)
    assert cond(paused, "Ready")["reason"] != "DaemonSetOutdated"


def test_no_nodes_names_the_nodes_yielded_to_older_configs() -> None:
    live = ds(1, observedGeneration=1, desiredNumberScheduled=0)
    alone = compute_status(Observed(1, False, live), None, NOW)
    assert cond(alone, "Ready")["message"] == "no node matches the nodeSelector and tolerations"
    yielded = compute_status(Observed(1, False, live, yielded_nodes=3), None, NOW)
    message = cond(yielded, "Ready")["message"]
    assert cond(yielded, "Ready")["reason"] == "NoNodes"
    assert "3 nodes" in message and "yielded to older configs" in message and "no node matches" not in message


def test_conflict_messages_say_when_the_older_config_runs_nowhere_and_count_one_node() -> None:
    other = ConfigKey("team-a", "gpu-old")
    keeps_conflict = Conflict(other, True, ("n3",), idle="other", idle_cause="refused")
    keeps = compute_status(Observed(1, False, None, conflicts=[keeps_conflict]), None, NOW)
    message = cond(keeps, "Conflict")["message"]
    assert message == (
        "team-a/gpu-old serves the same resource on 1 node (it is older, but its DaemonSet could not be created, so "
        "it runs nowhere: this config keeps them until it runs): n3"
    )
    assert cond(keeps, "Conflict")["reason"] == "KeepsNodes"
    yields_conflict = Conflict(other, False, ("n3",), idle="this", idle_cause="refused")
    yields = compute_status(Observed(1, False, None, conflicts=[yields_conflict]), None, NOW)
    assert "this config is older, but its DaemonSet could not be created" in cond(yields, "Conflict")["message"]
    assert cond(yields, "Conflict")["reason"] == "YieldsNodes"


def test_runs_nowhere_reads_the_stored_status_of_the_current_generation() -> None:
    def config(generation: int, reason: str, daemon_set: str | None = None, observed: int = 1) -> dict[str, Any]:
        status = compute_status(Observed(observed, False, None, problem=(reason, "m")), None, NOW)
        if daemon_set:
            status["daemonSet"] = daemon_set
        return {"metadata": {"generation": generation}, "status": status}

    assert idle_cause(config(1, "DaemonSetRejected")) == "refused"
    assert idle_cause(config(1, "DaemonSetNotOurs")) == "refused"
    assert idle_cause(config(1, "DaemonSetWriteFailed")) == "", "retrying: it may well run soon"
    assert idle_cause(config(1, "DaemonSetRejected", daemon_set="x-plugin")) == "", "an update refused: it runs"
    assert idle_cause(config(2, "DaemonSetRejected")) == "", "a new generation is tried again"
    assert idle_cause({"metadata": {"generation": 1}}) == ""
    assert idle_cause({"metadata": {}, "status": {"conditions": "junk", "observedGeneration": None}}) == ""


def test_a_config_paused_before_its_daemonset_was_created_runs_nowhere() -> None:
    """Paused with no DaemonSet it creates none, status written or not; paused with its DaemonSet it keeps running
    it; unpaused (a new generation) it is tried again."""
    paused_status = compute_status(Observed(2, True, None), None, NOW)
    assert idle_cause({"metadata": {"generation": 1}, "spec": {"paused": True}}) == "paused", "not yet reconciled"
    assert idle_cause({"metadata": {"generation": 2}, "spec": {"paused": True}, "status": paused_status}) == "paused"
    with_ds = {**paused_status, "daemonSet": "x-plugin"}
    assert idle_cause({"metadata": {"generation": 2}, "spec": {"paused": True}, "status": with_ds}) == ""
    assert idle_cause({"metadata": {"generation": 3}, "spec": {"paused": False}, "status": paused_status}) == ""


def test_conflict_messages_say_when_the_older_config_is_paused_without_a_daemonset() -> None:
    other = ConfigKey("team-a", "gpu-old")
    keeps = Conflict(other, True, ("n3",), idle="other", idle_cause="paused")
    assert cond(compute_status(Observed(1, False, None, conflicts=[keeps]), None, NOW), "Conflict")["message"] == (
        "team-a/gpu-old serves the same resource on 1 node (it is older, but it is paused and has no DaemonSet, so "
        "it runs nowhere: this config keeps them until it is unpaused): n3"
    )
    yields = Conflict(other, False, ("n3",), idle="this", idle_cause="paused")
    assert cond(compute_status(Observed(1, True, None, conflicts=[yields]), None, NOW), "Conflict")["message"] == (
        "team-a/gpu-old serves the same resource on 1 node (this config is older, but it is paused and has no "
        "DaemonSet, so it runs nowhere: it keeps them until this config is unpaused): n3"
    )


def test_on_delete_waits_for_pod_deletion_instead_of_rolling_out_forever() -> None:
    live = ds(
        2,
        observedGeneration=2,
        desiredNumberScheduled=3,
        currentNumberScheduled=3,
        updatedNumberScheduled=1,
        numberAvailable=3,
        numberReady=3,
    )
    live["metadata"]["labels"] = {"deviceplane.io/config": "x"}
    live["spec"] = {"updateStrategy": {"type": "OnDelete"}}
    s = compute_status(Observed(2, False, live), None, NOW)
    progressing, ready = cond(s, "Progressing"), cond(s, "Ready")
    assert (progressing["status"], progressing["reason"]) == ("False", "WaitingForPodDeletion"), progressing
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForPodDeletion"), ready
    assert progressing["message"].startswith("2 pods of 3 still run the previous pod template")
    assert "kubectl delete pod -l deviceplane.io/config=x" in progressing["message"]
    live["spec"] = {"updateStrategy": {"type": "RollingUpdate"}}
    assert cond(compute_status(Observed(2, False, live), None, NOW), "Progressing")["reason"] == "RollingOut"


def test_a_daemonset_that_could_not_be_created_is_not_progressing() -> None:
    refused = compute_status(Observed(1, False, None, problem=("DaemonSetRejected", "refused: x")), None, NOW)
    assert (cond(refused, "Progressing")["status"], cond(refused, "Progressing")["reason"]) == (
        "False",
        "DaemonSetNotCreated",
    )
    assert cond(refused, "Ready")["message"] == "the DaemonSet could not be created (see the Degraded condition)"
    retrying = compute_status(Observed(1, False, None, problem=("DaemonSetWriteFailed", "503: retrying")), None, NOW)
    assert cond(retrying, "Progressing")["reason"] == "Creating", "a transient failure is retried: still creating"
