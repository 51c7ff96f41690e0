"""Property test over real processes: random sequences of pod additions and removals, device health flips, plugin
restarts and agent restarts (SIGKILL or SIGTERM) keep the allocation invariants:

- no device is held by two live pods, nor by two app containers of one pod;
- every allocated device is one the plugin registered;
- every admitted live pod holds the same devices after an agent restart;
- PodResources List agrees with /api/v1/pods.

Bounded (few examples, short sequences) so it runs in well under two minutes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.alloc_env import AllocEnv
from tests.support.pods import (
    container,
    devices_of,
    listed_devices,
    pod_manifest,
    pods,
    wait_settled,
    write_pod,
)
from tests.support.procs import wait_for

RES = "example.com/sim"
DEVICES = 8
SIM_IDS = {f"sim-{i}" for i in range(DEVICES)}


class AllocationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="dp-prop-", dir="/tmp"))
        self.env = AllocEnv(self.root, "--startup-plugin-wait", "10s")
        self.env.start_agent()
        self.sim = self.env.sim(RES, DEVICES, 2, "--no-pre-start")
        self.live: set[str] = set()
        self.serial = 0
        self.healthy = set(SIM_IDS)

    def teardown(self) -> None:
        self.env.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def agent(self) -> Any:
        assert self.env.agent is not None
        return self.env.agent

    def settled(self) -> dict[str, dict[str, Any]]:
        # removed files are gone from the agent's view too (it learns of removals asynchronously)
        wait_for(lambda: set(pods(self.agent)) <= self.live, what="removed pods to leave the view")
        return {name: wait_settled(self.agent, name) for name in sorted(self.live)}

    # -- rules --------------------------------------------------------------------------------------------------------

    @rule(count=st.integers(0, 3), second=st.integers(0, 1), init=st.integers(0, 2))
    def add_pod(self, count: int, second: int, init: int) -> None:
        name = f"p{self.serial}"
        self.serial += 1
        apps = [container("a", {RES: count})] + ([container("b", {RES: second})] if second else [])
        inits = [container("i", {RES: init})] if init else []
        write_pod(self.env.pod_dir, f"{name}.json", pod_manifest(name, apps, init=inits))
        self.live.add(name)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def remove_pod(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.live)))
        (self.env.pod_dir / f"{name}.json").unlink()
        self.live.discard(name)

    @rule(device=st.sampled_from(sorted(SIM_IDS)))
    def flip_health(self, device: str) -> None:
        healthy = device not in self.healthy
        self.sim.control("POST", f"/devices/{device}/{'healthy' if healthy else 'unhealthy'}")
        (self.healthy.add if healthy else self.healthy.discard)(device)
        self.env.wait_devices(RES, len(self.healthy))

    @rule()
    def restart_plugin(self) -> None:
        self.sim.stop()
        self.env.plugins.remove(self.sim)
        self.sim = self.env.sim(RES, DEVICES, 2, "--no-pre-start")
        self.healthy = set(SIM_IDS)

    @rule(kill=st.booleans())
    def restart_agent(self, kill: bool) -> None:
        before = {n: devices_of(p, RES) for n, p in self.settled().items() if p["admitted"]}
        self.env.restart_agent(kill)
        self.env.wait_devices(RES, len(self.healthy))
        after = self.settled()
        for name, held in before.items():
            assert after[name]["admitted"], (name, after[name])
            assert devices_of(after[name], RES) == held, name

    # -- invariants ---------------------------------------------------------------------------------------------------

    @invariant()
    def allocation_is_consistent(self) -> None:
        view = self.settled()
        owners: dict[str, str] = {}
        for name, pod in view.items():
            if not pod["admitted"]:
                assert not devices_of(pod, RES), pod
                continue
            apps: set[str] = set()
            for c in pod["containers"]:
                held = set(c["devices"].get(RES, []))
                assert held <= SIM_IDS  # allocated ⊆ registered
                if c["type"] == "app":
                    assert not held & apps, (name, c)
                    apps |= held
            for device in devices_of(pod, RES):
                assert owners.setdefault(device, name) == name, f"{device}: {owners[device]} and {name}"
        listed = listed_devices(self.env.pod_resources().list())
        shown = {
            ("default", p["name"], c["name"]): {r: set(ids) for r, ids in c["devices"].items()}
            for p in pods(self.agent).values()
            if p["admitted"] and p["name"] in self.live
            for c in p["containers"]
            if c["type"] != "init"
        }
        assert listed == shown


TestAllocationProperties = AllocationMachine.TestCase
TestAllocationProperties.settings = settings(
    max_examples=16,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
