"""Admission and journal-write durations as histograms, through the real agent and a sim plugin: which pods are
timed (admitted with devices, failed; not pods without devices), the journal's every write, promtool clean."""

from __future__ import annotations

import subprocess

from tests.integration.test_agent_metrics import promtool
from tests.support.alloc_env import AllocEnv
from tests.support.pods import container, pod_manifest, simple_pod, wait_settled, write_pod
from tests.support.procs import AgentProcess, wait_for

R = "example.com/timed"
ADMISSION = "deviceplane_pod_admission_duration_seconds"
SYNC = "deviceplane_journal_sync_duration_seconds"


def admissions(agent: AgentProcess, result: str) -> tuple[float | None, float | None, float | None]:
    return (
        agent.metric(f"{ADMISSION}_count", result=result),
        agent.metric(f"{ADMISSION}_bucket", result=result, le="+Inf"),
        agent.metric(f"{ADMISSION}_sum", result=result),
    )


def test_admissions_and_journal_writes_are_timed(env: AllocEnv) -> None:
    agent = env.agent
    assert agent is not None
    assert admissions(agent, "admitted") == (0.0, 0.0, 0.0) and admissions(agent, "failed") == (0.0, 0.0, 0.0)
    syncs_at_start = agent.metric(f"{SYNC}_count")
    assert syncs_at_start is not None

    env.sim(R, 1)
    simple_pod(env.pod_dir, "gets-it", R, 1)
    assert wait_settled(agent, "gets-it")["admitted"]
    count, inf, total = admissions(agent, "admitted")
    assert count == inf == 1.0 and total is not None and 0 < total < 10
    # ... and its journal record was one durable write (at least: a checkpoint rotation may add none, never fewer)
    syncs_admitted = agent.metric(f"{SYNC}_count")
    assert syncs_admitted is not None and syncs_admitted >= syncs_at_start + 1
    assert agent.metric(f"{SYNC}_bucket", le="+Inf") == syncs_admitted

    simple_pod(env.pod_dir, "too-late", R, 1)
    assert not wait_settled(agent, "too-late")["admitted"]
    assert admissions(agent, "failed")[0] == 1.0 and admissions(agent, "admitted")[0] == 1.0

    write_pod(env.pod_dir, "no-devices.json", pod_manifest("no-devices", [container("c", {"cpu": 1})]))
    assert wait_settled(agent, "no-devices")["admitted"]
    assert admissions(agent, "admitted")[0] == 1.0  # no device, no admission to time

    # a release is journaled too: one more write
    (env.pod_dir / "gets-it.json").unlink()
    wait_for(lambda: (agent.metric(f"{SYNC}_count") or 0) >= syncs_admitted + 1, what="the release's write")

    exposition = agent.get_text("/metrics")
    assert f'{ADMISSION}_bucket{{le="0.0005",result="admitted"}}' in exposition
    result = subprocess.run([promtool(), "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr
