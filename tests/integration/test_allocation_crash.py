"""Durability under SIGKILL: 50 times, kill the agent at a random moment of a storm of admissions (and removals).

After every restart: no device is held by two pods, and every pod the agent had reported admitted (and whose file
is still there) holds exactly the devices it was reported with. The kubelet checkpoint stays loadable throughout.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from deviceplane.core.checkpoint import decode
from tests.support.alloc_env import alloc_env
from tests.support.pods import devices_of, pods, simple_pod, wait_settled

RES = "example.com/sim"
DEVICES = 48
KILLS = 50


def observe(agent: Any, expected: dict[str, frozenset[str]], live: set[str]) -> None:
    """Remember the devices of every pod seen admitted; a pod once admitted must never change them."""
    for name, pod in pods(agent).items():
        if pod["admitted"] and name in live:
            held = frozenset(devices_of(pod, RES))
            assert expected.setdefault(name, held) == held, (name, expected[name], held)


def check_invariants(agent: Any, expected: dict[str, frozenset[str]], live: set[str]) -> None:
    view = {name: wait_settled(agent, name) for name in sorted(live)}
    owners: dict[str, str] = {}
    for name, pod in view.items():
        held = devices_of(pod, RES)
        if not pod["admitted"]:
            assert not held, (name, pod)
            continue
        for device in held:
            assert device not in owners, f"{device} held by {owners[device]} and {name}"
            owners[device] = name
        if name in expected:
            assert frozenset(held) == expected[name], (name, expected[name], held)
    assert all(view[name]["admitted"] for name in expected if name in live), "a reported admission was lost"
    resource = agent.resource(RES)
    assert resource is not None and resource["allocated"] == len(owners)


def test_sigkill_during_admission_storm(short_tmp: Path) -> None:
    rng = random.Random(20261122)
    with alloc_env(short_tmp, "--startup-plugin-wait", "10s") as env:
        env.start_agent()
        sim = env.sim(RES, DEVICES, 2, "--no-pre-start")
        # a slowish plugin, so that kills land while admissions are in flight
        sim.control("PUT", "/faults/Allocate", {"mode": "hang", "seconds": 0.15})
        expected: dict[str, frozenset[str]] = {}
        live: set[str] = set()
        serial = 0
        for _cycle in range(KILLS):
            assert env.agent is not None
            # churn: failed pods go, and a few admitted ones, so devices keep coming free
            view = pods(env.agent)
            failed = [n for n in live if view.get(n, {}).get("state") == "failed"]
            admitted = sorted(n for n in live if n not in failed)
            for name in failed + rng.sample(admitted, k=min(len(admitted), rng.randint(1, 4))):
                (env.pod_dir / f"{name}.json").unlink()
                live.discard(name)
                expected.pop(name, None)
            # the storm: new pods arrive while the agent is killed at a random moment
            kill_at = time.monotonic() + rng.uniform(0.0, 0.5)
            arrivals = [time.monotonic() + rng.uniform(0.0, 0.5) for _ in range(rng.randint(4, 8))]
            while time.monotonic() < kill_at:
                while arrivals and arrivals[0] <= time.monotonic():
                    arrivals.pop(0)
                    name = f"p{serial}"
                    serial += 1
                    simple_pod(env.pod_dir, name, RES, rng.choice((1, 1, 2)))
                    live.add(name)
                observe(env.agent, expected, live)
            for _ in arrivals:  # the rest arrive while the agent is down
                name = f"p{serial}"
                serial += 1
                simple_pod(env.pod_dir, name, RES, rng.choice((1, 1, 2)))
                live.add(name)
            env.agent.kill()
            env.start_agent()
            check_invariants(env.agent, expected, live)
            observe(env.agent, expected, live)
            data = decode((env.plugin_dir / "kubelet_internal_checkpoint").read_bytes())
            assert data.RegisteredDevices is not None
        assert expected, "no pod was ever admitted"
        # after a clean stop the checkpoint alone (no journal) holds every admitted pod's devices
        env.agent.stop()
        data = decode((env.plugin_dir / "kubelet_internal_checkpoint").read_bytes())
        held: dict[str, set[str]] = {}
        for entry in data.PodDeviceEntries or []:
            held.setdefault(entry.PodUID, set()).update(entry.devices())
        assert sorted(map(sorted, held.values())) == sorted(map(sorted, expected.values()))
