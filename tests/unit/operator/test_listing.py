"""The gate that holds the first reconciliation until the watches have shown every node and plugin pod listed, and
the pod problems kept by config.

The list is a stub: the tests need objects shown by the watch before, during and after the list, and one deleted
between our list and the watch's, orders a real API server does not produce on demand (the real lists and watches
are covered by tests/e2e/test_operator.py and the startup test, tests/e2e/test_operator_scale.py)."""

from __future__ import annotations

import asyncio

import pytest

from deviceplane.operator.listing import ListingGate, PodProblems
from deviceplane.operator.names import ConfigKey
from deviceplane.operator.status import PodProblem


def test_the_gate_opens_once_every_listed_object_was_shown_before_or_after_the_list() -> None:
    async def scenario() -> None:
        gate: ListingGate

        async def list_uids() -> set[str]:
            gate.shown("during")  # the watch shows one while the list is under way
            return {"before", "during", "after"}

        gate = ListingGate("things", list_uids, recheck_seconds=60)
        gate.shown("before")
        waiting = asyncio.create_task(gate.wait())
        await asyncio.sleep(0.01)
        assert not waiting.done(), "open before 'after' was shown"
        gate.shown("unlisted")  # created after our list: not waited for
        gate.shown("after")
        await asyncio.wait_for(waiting, 1)

    asyncio.run(scenario())


def test_an_object_deleted_before_the_watch_listed_it_is_no_longer_waited_for_after_a_new_list() -> None:
    async def scenario() -> None:
        lists = [{"kept", "deleted"}, {"kept"}]

        async def list_uids() -> set[str]:
            return lists.pop(0) if len(lists) > 1 else lists[0]

        gate = ListingGate("things", list_uids, recheck_seconds=0.05)
        gate.shown("kept")
        await asyncio.wait_for(gate.wait(), 1)

    asyncio.run(scenario())


def test_a_failing_list_is_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        answers: list[set[str] | Exception] = [ConnectionError("refused"), set()]

        async def list_uids() -> set[str]:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        await asyncio.wait_for(ListingGate("things", list_uids, recheck_seconds=0.01).wait(), 1)

    asyncio.run(scenario())
    assert "listing things failed: refused" in caplog.text


def test_pod_problems_follow_a_pod_relabelled_to_another_config_and_deleted() -> None:
    a, b = ConfigKey("ns", "a"), ConfigKey("ns", "b")
    crash = PodProblem(name="p1", node="n1", reason="CrashLoopBackOff", message="back-off")
    pods = PodProblems()
    pods.observed("u1", a, crash)
    pods.observed("u2", a, None)
    assert list(pods.of(a)) == [crash]
    pods.observed("u1", b, crash)  # its config label edited by hand
    assert list(pods.of(a)) == [] and list(pods.of(b)) == [crash]
    pods.observed("u1", None, None)  # deleted
    pods.observed("u2", None, None)
    assert list(pods.of(b)) == [] and len(pods) == 0
