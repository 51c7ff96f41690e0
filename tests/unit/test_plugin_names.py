from __future__ import annotations

import os
import re

import pytest

from deviceplane.plugin.names import check_resource_name, is_extended_resource_name, socket_file_name


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
