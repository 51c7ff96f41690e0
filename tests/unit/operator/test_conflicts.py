"""Who keeps a node two configs of one resource both want: node eligibility (labels, taints) and the age order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.api.dpc import Toleration
from deviceplane.operator.conflicts import Candidate, NodeInfo, Taint, eligible, resolve, tolerates
from deviceplane.operator.names import ConfigKey


def cand(
    name: str, created: str, selector: dict[str, str] | None = None, tolerations=(), resource="example.com/x", runs=True
):
    idle = "" if runs else "refused"
    return Candidate(ConfigKey("ns", name), resource, created, selector or {}, list(tolerations), idle_cause=idle)


def test_toleration_semantics() -> None:
    taint = Taint("gpu", "NoSchedule", "a100")
    assert tolerates(Toleration(key="gpu", operator="Exists"), taint)
    assert tolerates(Toleration(key="gpu", operator="Equal", value="a100", effect="NoSchedule"), taint)
    assert tolerates(Toleration(key="gpu", value="a100"), taint)  # operator defaults to Equal
    assert not tolerates(Toleration(key="gpu", value="h100"), taint)
    assert not tolerates(Toleration(key="gpu", operator="Exists", effect="NoExecute"), taint)
    assert tolerates(Toleration(operator="Exists"), taint)  # empty key + Exists: everything
    assert not tolerates(Toleration(key="other", operator="Exists"), taint)


def test_eligibility_by_labels_and_taints() -> None:
    node = NodeInfo("n", {"pool": "gpu"}, (Taint("gpu", "NoSchedule"), Taint("soft", "PreferNoSchedule")))
    assert not eligible(node, {"pool": "gpu"}, [])  # untolerated NoSchedule
    assert eligible(node, {"pool": "gpu"}, [Toleration(key="gpu", operator="Exists")])  # PreferNoSchedule is fine
    assert not eligible(node, {"pool": "cpu"}, [Toleration(operator="Exists")])
    # The DaemonSet controller's own tolerations: cordoned and not-ready (NoExecute) nodes still run daemons.
    cordoned = NodeInfo("c", {}, (Taint("node.kubernetes.io/unschedulable", "NoSchedule"),))
    assert eligible(cordoned, {}, [])
    assert not eligible(NodeInfo("r", {}, (Taint("node.kubernetes.io/not-ready", "NoSchedule"),)), {}, [])


def test_older_keeps_shared_nodes_both_report() -> None:
    nodes = [NodeInfo("a", {"z": "1"}), NodeInfo("b", {"z": "1", "y": "1"}), NodeInfo("c", {"y": "1"})]
    old = cand("old", "2026-01-01T00:00:00Z", {"z": "1"})
    new = cand("new", "2026-01-02T00:00:00Z", {"y": "1"})
    result = resolve([new, old], nodes)
    assert result[old.key].excluded == frozenset()
    assert result[new.key].excluded == {"b"}
    (c_old,) = result[old.key].conflicts
    (c_new,) = result[new.key].conflicts
    assert (c_old.other, c_old.owner, c_old.nodes) == (new.key, True, ("b",))
    assert (c_new.other, c_new.owner, c_new.nodes) == (old.key, False, ("b",))


def test_same_timestamp_orders_by_namespace_then_name_and_other_resources_do_not_conflict() -> None:
    nodes = [NodeInfo("a")]
    t = "2026-01-01T00:00:00Z"
    b, a = cand("b", t), cand("a", t)
    other = cand("c", t, resource="example.com/other")
    result = resolve([b, a, other], nodes)
    assert result[a.key].excluded == frozenset() and result[b.key].excluded == {"a"}
    assert result[other.key].conflicts == ()


def test_deleting_the_older_hands_the_nodes_over() -> None:
    nodes = [NodeInfo("a")]
    old, new = cand("old", "2026-01-01T00:00:00Z"), cand("new", "2026-01-02T00:00:00Z")
    assert resolve([old, new], nodes)[new.key].excluded == {"a"}
    assert resolve([new], nodes)[new.key] == resolve([new], nodes)[new.key]
    assert resolve([new], nodes)[new.key].excluded == frozenset()


def test_an_older_config_that_runs_nowhere_keeps_no_node_from_one_that_runs() -> None:
    """Its DaemonSet refused (or a DaemonSet of its name not ours): had it kept the shared nodes, no plugin would
    serve them. Both report why the newer one keeps them."""
    nodes = [NodeInfo("a", {"z": "1"}), NodeInfo("b", {"z": "1", "y": "1"})]
    old = cand("old", "2026-01-01T00:00:00Z", {"z": "1"}, runs=False)
    new = cand("new", "2026-01-02T00:00:00Z", {"y": "1"})
    result = resolve([old, new], nodes)
    assert result[new.key].excluded == frozenset()
    assert result[old.key].excluded == {"b"}, "once it can be created, its first DaemonSet leaves b to new"
    (c_old,) = result[old.key].conflicts
    (c_new,) = result[new.key].conflicts
    assert (c_old.owner, c_old.idle, c_old.idle_cause, c_old.nodes) == (False, "this", "refused", ("b",))
    assert (c_new.owner, c_new.idle, c_new.idle_cause, c_new.nodes) == (True, "other", "refused", ("b",))


def test_an_older_config_paused_without_a_daemonset_keeps_no_node_and_says_it_is_paused() -> None:
    nodes = [NodeInfo("a")]
    paused = Candidate(ConfigKey("ns", "old"), "example.com/x", "2026-01-01T00:00:00Z", {}, [], idle_cause="paused")
    new = cand("new", "2026-01-02T00:00:00Z")
    result = resolve([paused, new], nodes)
    assert result[new.key].excluded == frozenset() and result[paused.key].excluded == {"a"}
    assert [(c.owner, c.idle, c.idle_cause) for c in result[new.key].conflicts] == [(True, "other", "paused")]


def test_a_newer_config_that_runs_nowhere_changes_nothing_and_two_idle_ones_go_by_age() -> None:
    nodes = [NodeInfo("a")]
    old, new = cand("old", "2026-01-01T00:00:00Z"), cand("new", "2026-01-02T00:00:00Z", runs=False)
    result = resolve([old, new], nodes)
    assert result[old.key].excluded == frozenset() and result[new.key].excluded == {"a"}
    assert [c.idle for c in result[old.key].conflicts] == [""], "age decided it: nothing to explain"
    idle_old = cand("old", "2026-01-01T00:00:00Z", runs=False)
    result = resolve([idle_old, new], nodes)
    assert result[idle_old.key].excluded == frozenset() and result[new.key].excluded == {"a"}


labels = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(["1", "2"]), max_size=2)


@settings(max_examples=200, deadline=None)
@given(
    node_labels=st.lists(labels, min_size=1, max_size=6),
    selectors=st.lists(st.tuples(labels, st.integers(0, 3), st.booleans()), min_size=1, max_size=5),
)
def test_every_node_runs_at_most_one_plugin_per_resource_and_none_is_lost(node_labels, selectors) -> None:
    """Exactly one config keeps each wanted node: the oldest that runs, or the oldest when none runs."""
    nodes = [NodeInfo(f"n{i}", lab) for i, lab in enumerate(node_labels)]
    cands = [
        cand(f"c{i}", f"2026-01-0{day + 1}T00:00:00Z", sel, runs=runs) for i, (sel, day, runs) in enumerate(selectors)
    ]
    result = resolve(cands, nodes)
    for node in nodes:
        wanting = [c for c in cands if eligible(node, c.node_selector, c.tolerations)]
        keeping = [c for c in wanting if node.name not in result[c.key].excluded]
        assert len(keeping) == (1 if wanting else 0)
        if wanting:
            running = [c for c in wanting if c.runs] or wanting
            assert keeping[0] == min(running, key=lambda c: c.age_order)
