"""Parsing pods (static pod files): the model, stable UIDs, and clear errors for malformed input."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.core.pods import PodError, parse_pod, parse_quantity
from tests.fuzz.pod_strategies import POD


def pod_obj(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [{"name": "c"}], **spec},
    }


def test_parses_containers_limits_and_init_kinds() -> None:
    obj = pod_obj(
        initContainers=[
            {"name": "setup", "resources": {"limits": {"example.com/gpu": 2}}},
            {"name": "side", "restartPolicy": "Always", "resources": {"limits": {"example.com/gpu": "1"}}},
        ],
        containers=[
            {
                "name": "main",
                "resources": {
                    "limits": {"example.com/gpu": "1", "cpu": "500m", "memory": "1Gi"},
                    "requests": {"example.com/gpu": 1, "cpu": "100m"},
                },
            }
        ],
    )
    obj["metadata"]["uid"] = "u-1"
    pod = parse_pod(obj)
    assert (pod.uid, pod.namespace, pod.name, pod.phase) == ("u-1", "ns", "p", "Pending")
    assert [(c.name, c.kind, c.limits) for c in pod.all_containers] == [
        ("setup", "init", (("example.com/gpu", 2),)),
        ("side", "sidecar", (("example.com/gpu", 1),)),
        ("main", "app", (("example.com/gpu", 1),)),
    ]
    assert pod.device_requests() == {"example.com/gpu": 2}


RULES = [{"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}]


@pytest.mark.parametrize("policy", ["Never", "OnFailure", "Always"])
def test_container_restart_policy_only_makes_an_init_container_a_sidecar(policy: str) -> None:
    """v1.36 ContainerRestartRules: any container may set restartPolicy (and restartPolicyRules with it); the
    API server accepts it. As the kubelet's IsRestartableInitContainer, only an init container with `Always` is a
    sidecar; on an app container or any other init container the policy changes nothing the device manager does."""
    gpu = {"limits": {"example.com/gpu": 1}}
    obj = pod_obj(
        initContainers=[{"name": "setup", "restartPolicy": policy, "resources": gpu}],
        containers=[
            {"name": "main", "restartPolicy": policy, "resources": gpu},
            {"name": "ruled", "restartPolicy": policy, "restartPolicyRules": RULES, "resources": gpu},
        ],
    )
    pod = parse_pod(obj)
    assert [(c.name, c.kind, c.limits) for c in pod.all_containers] == [
        ("setup", "sidecar" if policy == "Always" else "init", (("example.com/gpu", 1),)),
        ("main", "app", (("example.com/gpu", 1),)),
        ("ruled", "app", (("example.com/gpu", 1),)),
    ]


def test_uid_without_metadata_uid_is_stable_and_depends_on_node_and_file() -> None:
    a = parse_pod(pod_obj(), node_name="n1", source="a.yaml").uid
    assert a == parse_pod(pod_obj(), node_name="n1", source="a.yaml").uid
    assert a != parse_pod(pod_obj(), node_name="n2", source="a.yaml").uid
    assert a != parse_pod(pod_obj(), node_name="n1", source="b.yaml").uid
    assert a != parse_pod(pod_obj(containers=[{"name": "d"}]), node_name="n1", source="a.yaml").uid


def test_phase_terminal() -> None:
    obj = pod_obj()
    obj["status"] = {"phase": "Succeeded"}
    assert parse_pod(obj).terminal


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.update(kind="Deployment"), "kind: expected Pod"),
        (lambda o: o["metadata"].pop("name"), "metadata.name: Required value"),
        (lambda o: o["metadata"].update(name="Bad_Name"), "metadata.name: Invalid value"),
        (lambda o: o["spec"].update(containers=[]), "spec.containers: Required value"),
        (lambda o: o["spec"].update(containers="nope"), "spec.containers: expected a list"),
        (lambda o: o["spec"].update(containers=[{"name": "c"}, {"name": "c"}]), "Duplicate value: 'c'"),
        (
            lambda o: o["spec"]["containers"][0].update(resources={"limits": {"example.com/gpu": "0.5"}}),
            "extended resources must be whole numbers",
        ),
        (
            lambda o: o["spec"]["containers"][0].update(resources={"limits": {"example.com/gpu": -1}}),
            "must be greater than or equal to 0",
        ),
        (
            lambda o: o["spec"]["containers"][0].update(resources={"requests": {"example.com/gpu": 1}}),
            "Limit must be set for non overcommitable resources",
        ),
        (
            lambda o: o["spec"]["containers"][0].update(
                resources={"limits": {"example.com/gpu": 2}, "requests": {"example.com/gpu": 1}}
            ),
            "must be equal to example.com/gpu limit",
        ),
        (lambda o: o["spec"]["containers"][0].update(restartPolicy="Sometimes"), "restartPolicy: Unsupported value"),
        (lambda o: o["spec"]["containers"][0].update(restartPolicy=["Always"]), "restartPolicy: expected a string"),
        (
            lambda o: o["spec"]["containers"][0].update(restartPolicy="Never", restartPolicyRules="Restart"),
            "restartPolicyRules: expected a list",
        ),
        (
            lambda o: o["spec"]["containers"][0].update(restartPolicyRules=[{"action": "Restart"}]),
            "restartPolicy: Required value: must specify restartPolicy when restart rules are used",
        ),
        (lambda o: o.update(status={"phase": "Exploded"}), "status.phase: Unsupported value"),
        (lambda o: o.update(metadata=["x"]), "metadata: expected an object"),
    ],
)
def test_malformed_pods_give_clear_errors(mutate: Any, message: str) -> None:
    obj = pod_obj()
    mutate(obj)
    with pytest.raises(PodError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_pod(obj)


@pytest.mark.parametrize("value", [None, "text", [1], 3.5, True])
def test_non_objects_and_bad_quantities_never_crash(value: Any) -> None:
    with pytest.raises(PodError):
        parse_pod(value if not isinstance(value, float) else {"spec": value})
    with pytest.raises(PodError):
        parse_quantity(value, "x")


def test_quantity_suffixes() -> None:
    assert parse_quantity("2k", "x") == 2000
    assert parse_quantity("1Ki", "x") == 1024
    assert parse_quantity(3, "x") == 3


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("1000m", 1),  # what the API server accepts for an extended resource is any whole value, in any notation
        ("2.0", 2),
        ("1e3", 1000),
        ("1E3", 1000),
        ("0.5k", 500),
        (".5k", 500),
        ("+2", 2),
        ("1.", 1),
        ("-0", 0),
        ("1000000000n", 1),
        ("1.5e1", 15),
        ("0e400", 0),
        ("0.9999999", 1),  # a thousandth rounded up, as MilliValue: whole, and the count is its Value() (ceiling)
        (" 2 ", 2),
        ("9223372036854775807", 2**63 - 1),
    ],
)
def test_whole_quantities_in_every_notation(text: str, count: int) -> None:
    assert parse_quantity(text, "x") == count


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.5", "whole numbers"),
        ("500m", "whole numbers"),
        ("3n", "whole numbers"),
        ("1e-3", "whole numbers"),
        ("9" * 40 + "e-41", "whole numbers"),  # just under a tenth, not one after rounding the exponent away
        ("-1", "greater than or equal to 0"),
        ("9223372036854775808", "too large"),
        ("8Ei", "too large"),
        ("1e400", "too large"),
        ("1" * 5000, "too many digits"),  # not int() of 5,000 digits, which Python refuses with a ValueError
        (".", "invalid quantity"),
        ("", "invalid quantity"),
        ("e3", "invalid quantity"),
        ("1K", "invalid quantity"),
        ("1 k", "invalid quantity"),
        ("\uff12", "invalid quantity"),  # a full-width 2: a digit to str.isdigit, not to Go
        ("\u00b2", "invalid quantity"),  # superscript 2, likewise
    ],
)
def test_quantities_that_are_not_counts_are_refused(text: str, message: str) -> None:
    with pytest.raises(PodError, match=message) as err:
        parse_quantity(text, "x")
    assert len(str(err.value)) < 200  # long values are shortened in the message


@given(
    count=st.integers(0, 10**12), notation=st.sampled_from(["{}", "{}000m", "{}.0", "{}e0", "{}000e-3", "{}000000000n"])
)
def test_a_count_reads_the_same_in_every_notation(count: int, notation: str) -> None:
    assert parse_quantity(notation.format(count), "x") == count


@given(st.text(alphabet="0123456789.+-eEnumkKMGTPi ", max_size=30) | st.text(max_size=30))
def test_any_text_is_a_count_or_a_pod_error(text: str) -> None:
    try:
        count = parse_quantity(text, "x")
    except PodError:
        return
    assert 0 <= count <= 2**63 - 1


@settings(max_examples=300, deadline=None)
@given(POD)
def test_only_init_containers_with_always_are_ever_sidecars(document: Any) -> None:
    """Over the fuzz strategy's pod shapes (restartPolicy and restartPolicyRules on any container included): a pod is
    parsed or refused with PodError, and a parsed container is restartable exactly when it is an init container with
    restartPolicy Always."""
    try:
        pod = parse_pod(document)
    except PodError:
        return
    spec = document["spec"]
    raw = [*(spec.get("initContainers") or []), *spec["containers"]]
    for container, source in zip(pod.all_containers, raw, strict=True):
        assert container.restartable == (container.init and source.get("restartPolicy") == "Always")
