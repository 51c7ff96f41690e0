"""Finding 5 of issue 9: after a restart, while `--startup-plugin-wait` runs and the plugin is still away, what do
PodResources `List` and `/api/v1/pods` say? The truth: a restored pod (its checkpoint covers every request) holds
its devices and needs no plugin, so it is admitted (restored) at once and listed with them; a new pod for the
absent plugin waits, says so in its reason, and is not listed (it holds nothing)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.alloc_env import alloc_env
from tests.support.pods import devices_of, listed_devices, pods, simple_pod, wait_settled
from tests.support.procs import wait_for

R = "example.com/restored"
WAIT = ("--startup-plugin-wait", "60s")


def test_restored_pods_tell_the_truth_while_their_plugin_is_away(short_tmp: Path) -> None:
    with alloc_env(short_tmp) as env:
        env.start_agent(*WAIT)
        sim = env.sim(R, 2)
        simple_pod(env.pod_dir, "old", R, 1)
        held = devices_of(wait_settled(env.agent, "old"), R)
        assert len(held) == 1
        sim.stop()
        env.restart_agent(True, *WAIT)
        started = time.monotonic()
        simple_pod(env.pod_dir, "new", R, 1)
        old = wait_settled(env.agent, "old", timeout=10)
        assert time.monotonic() - started < 10, "a restored pod must not wait for its plugin"
        assert (old["state"], old["admitted"], old["restored"]) == ("admitted", True, True)
        assert devices_of(old, R) == held
        client = env.pod_resources()
        assert listed_devices(client.list()) == {("default", "old", "main"): {R: held}}
        assert client.get("default", "old").pod_resources.name == "old"

        new = wait_for(lambda: pods(env.agent).get("new"), what="the new pod reported")
        assert (new["state"], new["admitted"]) == ("admitting", False)
        assert new["reason"] == f"waiting up to 60s after start for device plugins: {R}"
        assert devices_of(new, R) == set()
        assert ("default", "new", "main") not in listed_devices(client.list())
        # the plugin comes back: the waiting pod is admitted on a device the restored pod does not hold
        env.sim(R, 2)
        new = wait_settled(env.agent, "new")
        assert new["admitted"] and new["reason"] == "" and devices_of(new, R) and not devices_of(new, R) & held


def test_a_plugin_back_with_no_device_fails_the_pod_at_once_not_after_the_wait(short_tmp: Path) -> None:
    """A plugin that registered and listed no device has answered: a pod asking for its devices fails as it would a
    minute later, with the device manager's message, instead of waiting out the startup wait."""
    with alloc_env(short_tmp) as env:
        env.start_agent(*WAIT)
        env.sim(R, 0)
        started = time.monotonic()
        simple_pod(env.pod_dir, "p", R, 1)
        pod = wait_settled(env.agent, "p", timeout=20)
        assert time.monotonic() - started < 20
        assert pod["state"] == "failed"
        assert pod["reason"] == f"no healthy devices present; cannot allocate unhealthy devices {R}"
