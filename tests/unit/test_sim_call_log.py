"""The sim plugin's call log keeps exact counts but only the latest entries per RPC: a long-running sim (a demo, a
fleet test) answering GetPreferredAllocation with every available ID in each request must not grow without bound."""

from __future__ import annotations

from deviceplane.plugin.sim import CALLS_KEPT, RPCS, CallLog, SimPlugin


def test_counts_stay_exact_while_entries_are_bounded() -> None:
    log = CallLog(kept=3)
    for i in range(5):
        log.add("Allocate", {"devices_ids": [f"sim-{i}"]})
    log.add("PreStartContainer", {"devices_ids": ["sim-0"]})
    assert log.counts() == {"Allocate": 5, "GetPreferredAllocation": 0, "PreStartContainer": 1}
    entries = log.entries()
    assert [e["devices_ids"] for e in entries["Allocate"]] == [["sim-2"], ["sim-3"], ["sim-4"]]  # latest, in order
    assert set(entries) == set(RPCS)
    log.clear()
    assert log.counts() == dict.fromkeys(RPCS, 0) and all(not e for e in log.entries().values())


async def test_the_sim_records_through_a_bounded_log() -> None:
    sim = SimPlugin("example.com/sim", 4, 1)
    for _ in range(CALLS_KEPT + 5):
        await sim.allocate(["sim-0"])
    assert sim.calls.counts()["Allocate"] == CALLS_KEPT + 5
    assert len(sim.calls.entries()["Allocate"]) == CALLS_KEPT
