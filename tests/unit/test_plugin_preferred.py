from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.core.ordering import natural_key
from deviceplane.plugin.preferred import NumaLayout, pack_on_numa
from deviceplane.plugin.sim import numa_layout
from tests.unit.preferred_oracle import sorting_everything_best_fit

NUMA = numa_layout(8, 2)  # sim-0..3 on node 0, sim-4..7 on node 1


def test_layout_blocks():
    assert numa_layout(8, 2) == {f"sim-{i}": (i // 4,) for i in range(8)}
    assert numa_layout(5, 2) == {"sim-0": (0,), "sim-1": (0,), "sim-2": (0,), "sim-3": (1,), "sim-4": (1,)}
    assert numa_layout(3, 0) == {"sim-0": (), "sim-1": (), "sim-2": ()}
    assert numa_layout(0, 4) == {}


def test_packs_on_a_node_that_holds_the_request():
    assert pack_on_numa(["sim-0", "sim-4", "sim-5", "sim-6"], [], 2, NUMA) == ["sim-4", "sim-5"]


def test_best_fit_leaves_the_fuller_node_whole():
    # Node 0 has exactly 2 free, node 1 has 4: taking node 1's (the first version did) would leave 2 + 2, and a
    # later 4-device single-node request could not fit.
    available = ["sim-2", "sim-3", "sim-4", "sim-5", "sim-6", "sim-7"]
    assert pack_on_numa(available, [], 2, NUMA) == ["sim-2", "sim-3"]
    assert pack_on_numa(available, [], 3, NUMA) == ["sim-4", "sim-5", "sim-6"]  # only node 1 holds 3


def test_fills_the_must_include_node_first():
    # An app container reusing its init container's sim-0 (node 0): the first version added sim-4, from node 1 -
    # which had the most free devices - although sim-1..3 on node 0 were free.
    available = ["sim-0", "sim-1", "sim-2", "sim-4", "sim-5", "sim-6", "sim-7"]
    assert pack_on_numa(available, ["sim-0"], 2, NUMA) == ["sim-0", "sim-1"]
    assert pack_on_numa(available, ["sim-0"], 4, NUMA) == ["sim-0", "sim-1", "sim-2", "sim-4"]
    # Must-include devices on both nodes: the node holding more of them first.
    layout = numa_layout(12, 2)  # sim-0..5 node 0, sim-6..11 node 1
    got = pack_on_numa([f"sim-{i}" for i in range(12)], ["sim-0", "sim-6", "sim-7"], 5, layout)
    assert got == ["sim-0", "sim-6", "sim-7", "sim-8", "sim-9"]
    # A must-include device without topology says nothing about where the container is: best fit as usual.
    layout = {"a": (), "b": (), "c": (1,), "d": (1,)}
    assert pack_on_numa(["a", "b", "c", "d"], ["a"], 3, layout) == ["a", "c", "d"]


def test_ties_go_to_lowest_node_and_ids_in_natural_order():
    layout = numa_layout(24, 2)
    assert pack_on_numa(["sim-13", "sim-2", "sim-12", "sim-10"], [], 2, layout) == ["sim-2", "sim-10"]


def test_must_include_first_even_across_nodes():
    assert pack_on_numa(["sim-0", "sim-1", "sim-5"], ["sim-5"], 3, NUMA) == ["sim-5", "sim-0", "sim-1"]


def test_spills_to_next_node_when_one_is_not_enough():
    assert pack_on_numa(["sim-0", "sim-4", "sim-5"], [], 3, NUMA) == ["sim-4", "sim-5", "sim-0"]


def test_size_not_above_must_include():
    assert pack_on_numa(["sim-0", "sim-1"], ["sim-1", "sim-0"], 1, NUMA) == ["sim-1", "sim-0"]


def test_natural_key():
    assert sorted(["sim-10", "sim-2", "sim-1"], key=natural_key) == ["sim-1", "sim-2", "sim-10"]


ids = st.lists(st.sampled_from(sorted(NUMA)), unique=True)


@given(available=ids, data=st.data())
def test_properties(available, data):
    must = data.draw(st.lists(st.sampled_from(available), unique=True) if available else st.just([]))
    size = data.draw(st.integers(min_value=len(must), max_value=len(available)))
    result = pack_on_numa(available, must, size, NUMA)
    assert len(result) == size and len(set(result)) == size
    assert result[: len(must)] == must
    assert set(result) <= set(available)
    assert result == pack_on_numa(list(reversed(available)), must, size, NUMA)  # order of input does not matter
    rest = result[len(must) :]
    free = {node: [d for d in available if d not in must and NUMA[d][0] == node] for node in (0, 1)}
    must_nodes = {NUMA[d][0] for d in must}
    on_must_nodes = sum(len(free[n]) for n in must_nodes)
    # As many of the rest as they hold come from the must_include devices' nodes, and they come first.
    assert [NUMA[d][0] in must_nodes for d in rest] == sorted((NUMA[d][0] in must_nodes for d in rest), reverse=True)
    assert sum(NUMA[d][0] in must_nodes for d in rest) == min(len(rest), on_must_nodes)
    if rest and not must and any(len(v) >= len(rest) for v in free.values()):
        (node,) = {NUMA[d][0] for d in rest}  # packed on one node whenever one node can hold it
        assert len(free[node]) == min(len(v) for v in free.values() if len(v) >= len(rest))  # the best fit


# IDs whose natural keys tie ("d1", "d01"), several NUMA nodes per device, devices without topology.
odd_ids = st.lists(st.from_regex(r"\Ad[0-9]{1,3}(-[a-c])?\Z"), unique=True, max_size=40)


@given(available=odd_ids, data=st.data())
def test_same_answer_as_sorting_everything(available, data):
    """Against the rule written plainly (tests/unit/preferred_oracle.py), sorting every device of a node."""
    # Some IDs the plugin does not know (no topology), some it knows but nobody asks about.
    known = data.draw(st.lists(st.sampled_from(available), unique=True) if available else st.just([]))
    extra = data.draw(st.lists(st.from_regex(r"\Ae[0-9]{1,2}\Z"), unique=True, max_size=3))
    numa_of = {d: data.draw(st.lists(st.integers(0, 3), max_size=3), label=d) for d in [*known, *extra]}
    must = data.draw(st.lists(st.sampled_from(available), max_size=5) if available else st.just([]))
    size = data.draw(st.integers(min_value=0, max_value=len(available) + 2))
    expected = sorting_everything_best_fit(available, must, size, numa_of)
    assert pack_on_numa(available, must, size, numa_of) == expected
    assert pack_on_numa(available, must, size, NumaLayout(numa_of)) == expected
