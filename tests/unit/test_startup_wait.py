"""The startup plugin wait (agent/plugins/startup_wait.py) over a real registry: a plugin is back once registered
with its first list applied (an empty list too); what a restarted agent's NodeDevices waits for (each restored
resource's plugin back, a resource deleted after its grace period no longer waited for, at most the startup wait) and
/readyz saying what is waited for; what an admission's wait is told, and that each change wakes every waiter.
(End to end: tests/e2e/test_nodedevices_lifecycle.py, tests/integration/test_restored_during_startup_wait.py.)"""

from __future__ import annotations

import asyncio

from deviceplane.agent.kube.node_devices import NodeDevicesPublisher
from deviceplane.agent.plugins.contracts import DeviceEvent, DeviceEventKind
from deviceplane.agent.plugins.startup_wait import StartupPluginWait
from deviceplane.api.models import AgentView, DevicesStatus
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions

GPU, NIC = "example.com/gpu", "example.com/nic"
OPTS = PluginOptions()


def test_a_plugin_is_listed_once_its_first_list_came_even_an_empty_one() -> None:
    registry = DeviceRegistry(grace_period=300)
    registry.restore([GPU, NIC], now=0)
    assert not registry.plugin_listed(GPU)  # the checkpoint's placeholder
    registry.plugin_connected(GPU, "/gpu.sock", OPTS, now=1)
    registry.plugin_connected(NIC, "/nic.sock", OPTS, now=1)
    assert not registry.plugin_listed(GPU)  # registered, nothing listed yet: it shows 0 devices
    registry.apply_snapshot(GPU, "/gpu.sock", [Device("g0", "Healthy")])
    registry.apply_snapshot(NIC, "/nic.sock", [])
    assert registry.plugin_listed(GPU) and registry.plugin_listed(NIC)
    registry.plugin_reconnected(GPU, "/gpu.sock", OPTS, now=2)  # a restart in place keeps the list shown
    assert registry.plugin_listed(GPU)
    registry.plugin_disconnected(GPU, "/gpu.sock", now=3)
    assert not registry.plugin_listed(GPU)


def test_the_wait_ends_when_every_restored_plugin_is_back_or_deleted() -> None:
    async def scenario() -> None:
        registry = DeviceRegistry(grace_period=300)
        registry.restore([GPU, NIC], now=0)
        restored = StartupPluginWait(registry, 30)
        restored.restored([GPU, NIC])
        restored.start()
        waiting = asyncio.create_task(restored.wait_restored())
        await asyncio.sleep(0.01)
        assert restored.restored_problem() == f"waiting up to 30s after start for device plugins: {GPU}, {NIC}"
        registry.plugin_connected(GPU, "/gpu.sock", OPTS, now=1)
        registry.apply_snapshot(GPU, "/gpu.sock", [Device("g0", "Healthy")])
        restored(DeviceEvent(GPU, DeviceEventKind.SNAPSHOT))
        await asyncio.sleep(0.01)
        assert not waiting.done() and restored.restored_pending() == [NIC]
        restored(DeviceEvent(NIC, DeviceEventKind.DELETED))  # its grace period ended first
        await asyncio.wait_for(waiting, 1)
        assert restored.restored_problem() is None

    asyncio.run(scenario())


def test_a_plugin_that_does_not_come_back_is_waited_for_only_the_startup_wait() -> None:
    async def scenario() -> float:
        registry = DeviceRegistry(grace_period=300)
        registry.restore([NIC], now=0)
        restored = StartupPluginWait(registry, 0.3)
        restored.restored([NIC])
        loop = asyncio.get_running_loop()
        restored.start()
        started = loop.time()
        await asyncio.wait_for(restored.wait_restored(), 2)
        assert (
            restored.restored_pending() == [NIC] and restored.restored_problem() is None
        )  # over: nothing is waited for any more
        return loop.time() - started

    assert 0.3 <= asyncio.run(scenario()) < 1.0


def test_nodedevices_is_not_written_while_it_waits_and_readyz_says_what_for() -> None:
    """The API is never reached while the publisher waits (None would raise at the first request)."""

    def status(_limit: int) -> DevicesStatus:
        return DevicesStatus(resources=[], agent=AgentView(version="0", node="n", lastHeartbeatTime="t"))

    async def scenario() -> None:
        registry = DeviceRegistry(grace_period=300)
        registry.restore([NIC], now=0)
        restored = StartupPluginWait(registry, 30)
        restored.restored([NIC])
        publisher = NodeDevicesPublisher(None, "n", status, plugins_back=restored)  # type: ignore[arg-type]
        assert publisher.ready() == "NodeDevices not published yet"
        restored.start()
        task = asyncio.create_task(publisher.run())
        await asyncio.sleep(0.05)
        try:
            assert not task.done() and publisher.writes == 0
            assert publisher.ready() == (
                f"NodeDevices not published yet: waiting up to 30s after start for device plugins: {NIC}"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_an_admission_is_told_what_it_waits_for_and_an_empty_list_is_an_answer() -> None:
    """An empty first list ends the wait: the plugin is back and has no device (the pod then fails as it would
    later); a disconnected or silent plugin is waited for."""

    async def scenario() -> None:
        registry = DeviceRegistry(grace_period=300)
        wait = StartupPluginWait(registry, 30)
        wait.start()
        told: list[list[str]] = []
        waiting = asyncio.create_task(wait.wait_for([GPU, NIC], told.append))
        await asyncio.sleep(0.01)
        assert told == [[GPU, NIC]]
        registry.plugin_connected(NIC, "/nic.sock", OPTS, now=1)
        wait(DeviceEvent(NIC, DeviceEventKind.SNAPSHOT))  # registered, no list yet: still missing, not told again
        await asyncio.sleep(0.01)
        assert told == [[GPU, NIC]] and not waiting.done()
        registry.apply_snapshot(NIC, "/nic.sock", [])
        wait(DeviceEvent(NIC, DeviceEventKind.SNAPSHOT))
        await asyncio.sleep(0.01)
        assert told == [[GPU, NIC], [GPU]] and not waiting.done()
        registry.plugin_connected(GPU, "/gpu.sock", OPTS, now=2)
        registry.apply_snapshot(GPU, "/gpu.sock", [])
        wait(DeviceEvent(GPU, DeviceEventKind.SNAPSHOT))
        assert await asyncio.wait_for(waiting, 1) == []
        assert wait.reason([GPU]) == f"waiting up to 30s after start for device plugins: {GPU}"

    asyncio.run(scenario())


def test_a_change_right_after_one_waiters_look_wakes_every_waiter() -> None:
    """Two admissions wait for different plugins, and both come back before either waiter runs again: each change
    wakes whoever waits at that moment (a waker that only swapped the event, or set it only for the first, would
    leave one waiting out its 30 s)."""

    async def scenario() -> None:
        registry = DeviceRegistry(grace_period=300)
        wait = StartupPluginWait(registry, 30)
        wait.start()
        gpu_waiter = asyncio.create_task(wait.wait_for([GPU]))
        nic_waiter = asyncio.create_task(wait.wait_for([NIC]))
        await asyncio.sleep(0.01)
        registry.plugin_connected(GPU, "/gpu.sock", OPTS, now=1)
        registry.apply_snapshot(GPU, "/gpu.sock", [Device("g0", "Healthy")])
        wait(DeviceEvent(GPU, DeviceEventKind.SNAPSHOT))
        registry.plugin_connected(NIC, "/nic.sock", OPTS, now=1)
        registry.apply_snapshot(NIC, "/nic.sock", [Device("n0", "Healthy")])
        wait(DeviceEvent(NIC, DeviceEventKind.SNAPSHOT))  # before either waiter has run again
        assert await asyncio.wait_for(asyncio.gather(gpu_waiter, nic_waiter), 1) == [[], []]

    asyncio.run(scenario())
