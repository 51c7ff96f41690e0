from __future__ import annotations

import os
import re

import pytest

from deviceplane.plugin.names import (
    check_resource_name,
    is_extended_resource_name,
    socket_file_name,
    socket_name_pattern,
)


@pytest.mark.parametrize(
    "name",
    ["example.com/gpu", "nvidia.com/gpu", "a/b", "vendor.io/x_y.z-1", "x.y/" + "a" * 63, "a" * 240 + ".com/x"],
)
def test_valid(name):
    assert is_extended_resource_name(name)
    check_resource_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "gpu",
        "kubernetes.io/gpu",
        "sub.kubernetes.io/gpu",
        "requests.example.com/gpu",
        "example.com/",
        "/gpu",
        "example.com/a/b",
        "Example.com/gpu",
        "exa_mple.com/gpu",
        "example.com/-gpu",
        "example.com/gpu-",
        "example.com/" + "a" * 64,
        "a" * 241 + ".com/x",  # "requests." + prefix exceeds 253
    ],
)
def test_invalid(name):
    assert not is_extended_resource_name(name)
    with pytest.raises(ValueError, match="invalid resource name"):
        check_resource_name(name)


def test_socket_file_name_is_a_safe_single_component():
    assert socket_file_name("a/b", "7") == f"a_b-{os.getpid()}-7.sock"
    name = socket_file_name("example.com/gpu")
    assert re.fullmatch(rf"example\.com_gpu-{os.getpid()}-[0-9a-f]{{8}}\.sock", name), name


def test_socket_file_name_is_unique_per_instance_not_per_pid():
    """In containers plugins are usually pid 1: two of them (a DaemonSet surge rollout) shared a name and deleted
    each other's socket. A random token tells instances apart; the `<resource>-<pid>-` prefix stays readable."""
    assert len({socket_file_name("example.com/gpu") for _ in range(100)}) == 100


# The longest valid resource name (308 characters: "requests." + name must be a qualified name, so the DNS prefix is
# at most 253 - 9 = 244; the name part 63).
LONGEST = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 52]) + "/" + "x" * 63
KUBELET_DIR = "/var/lib/kubelet/device-plugins"  # 32 bytes with its slash


@pytest.mark.parametrize("pid", [1, 4_194_304])  # pid_max is at most 2**22
@pytest.mark.parametrize("resource", [LONGEST, "example.com/" + "g" * 63, "a" * 240 + ".com/x", "e.co/" + "x" * 48])
def test_every_valid_name_fits_in_the_kubelets_directory(monkeypatch, resource, pid):
    """A name of `<resource>-<pid>-<token>.sock` overflowed sun_path from ~54 characters on: a valid 57-character
    name could not be served in /var/lib/kubelet/device-plugins/."""
    assert is_extended_resource_name(resource)
    monkeypatch.setattr(os, "getpid", lambda: pid)
    name = socket_file_name(resource)
    assert len(os.fsencode(f"{KUBELET_DIR}/{name}")) <= 107, name
    assert socket_name_pattern(resource).fullmatch(name)
    assert name.startswith(resource.replace("/", "_")[:40])  # still readable in `ls`


def test_shortened_names_stay_apart():
    one, two = LONGEST, LONGEST[:-1] + "y"  # the same first 300 characters
    assert socket_file_name(one, "0") != socket_file_name(two, "0")
    assert not socket_name_pattern(two).fullmatch(socket_file_name(one))
    assert len(LONGEST) == 308 and not is_extended_resource_name(LONGEST.replace("d" * 52, "d" * 53))  # the limit


@pytest.mark.parametrize(
    ("resource", "other"),
    [
        ("example.com/gpu", "example.com/gpu-1"),  # a name that starts the same
        ("example.com/gpu-1", "example.com/gpu"),
        ("example.com/gpu", "example.com/gpu1"),
        ("a.com/b_c", "a.com/b"),
        (LONGEST, LONGEST[:-1] + "y"),
    ],
)
def test_socket_name_pattern_matches_no_other_resource(resource, other):
    """What a starting plugin removes, when nobody serves it, must be its own resource's socket only."""
    for pid in (1, 22, 4_194_304):
        for token in ("00000000", "12345678", "deadbeef"):
            theirs = socket_file_name(other, token).replace(f"-{os.getpid()}-", f"-{pid}-")
            assert not socket_name_pattern(resource).fullmatch(theirs), (resource, theirs)
    assert socket_name_pattern(resource).fullmatch(socket_file_name(resource))
