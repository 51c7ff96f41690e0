"""Resource-name validation and the kubelet's registration error strings (spec §3.3, §4.2 steps 2-3)."""

from __future__ import annotations

import ast
import gc
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplane.core.names import (
    go_quote,
    invalid_plugin_name_error,
    invalid_resource_name_error,
    is_extended_resource_name,
    plugin_versions_unsupported_error,
    unsupported_version_error,
    validate_endpoint_name,
    validate_watcher_plugin,
)


def dns_subdomain(length: int) -> str:
    """A valid DNS-1123 subdomain of exactly `length` characters (labels of at most 63)."""
    labels, remaining = [], length
    while remaining > 0:
        size = min(63, remaining)
        if remaining - size == 1:  # a trailing "." plus nothing is not a label; shorten this one
            size -= 1
        labels.append("a" * size)
        remaining -= size + 1
    name = ".".join(labels)
    assert len(name) == length
    return name


# "requests." (9 characters) is prepended before the prefix is checked against its 253-character limit.
LONGEST_PREFIX = dns_subdomain(253 - len("requests."))
TOO_LONG_PREFIX = dns_subdomain(254 - len("requests."))


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("vendor.com/gpu", True),
        ("1.2.3.4/gpu", True),
        ("vendor.com/GPU_1.x-y", True),  # the name part allows upper case, "_" and "."
        ("vendor.com/" + "x" * 63, True),
        ("vendor.com/" + "x" * 64, False),
        (LONGEST_PREFIX + "/gpu", True),
        (LONGEST_PREFIX + "/" + "g" * 63, True),  # the longest valid name: 308 characters
        (LONGEST_PREFIX + "/" + "g" * 64, False),
        (TOO_LONG_PREFIX + "/gpu", False),
        ("gpu", False),  # no "/": a native resource
        ("kubernetes.io/gpu", False),
        ("example.kubernetes.io/gpu", False),
        ("vendor.com/kubernetes.io/", False),
        ("requests.vendor.com/gpu", False),
        ("/gpu", False),  # prefix would be "requests.", ending in a dot
        ("vendor.com/", False),
        ("Vendor.com/gpu", False),  # the prefix is lower case only
        ("-vendor.com/gpu", False),
        ("vendor..com/gpu", False),
        ("vendor.com/_gpu", False),
        ("vendor.com/gpu-", False),
        ("vendor.com/gp u", False),
        ("a/b/c", False),
        ("vendör.com/gpu", False),
        ("vendor.com/gpü", False),
        ("vendor.com/gpu\n", False),  # a "$" anchor would wrongly accept this
        ("vendor.com\n/gpu", False),
        ("", False),
    ],
)
def test_is_extended_resource_name(name: str, valid: bool) -> None:
    assert is_extended_resource_name(name) is valid


def test_rejected_long_names_are_not_kept_alive() -> None:
    """The validation's cache must not pin what hostile clients send: a Register's resource name can be megabytes
    (gRPC's default message limit is 4 MB), and the cache holds 4,096 names."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            assert not is_extended_resource_name(f"vendor{i}.com/" + "g" * 1_000_000)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained < 5_000_000, f"{retained / 1e6:.0f} MB kept after 40 rejected names of 1 MB"


def test_dns_subdomain_helper_limits_are_the_validation_limits() -> None:
    # Guards the two length cases above: they differ only by one character, on either side of 253.
    assert len("requests." + LONGEST_PREFIX) == 253
    assert len("requests." + TOO_LONG_PREFIX) == 254


def test_registration_error_strings_are_upstream() -> None:
    assert unsupported_version_error("v1alpha") == (
        'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'
    )
    assert invalid_resource_name_error("gpu") == 'the ResourceName "gpu" is invalid'
    assert plugin_versions_unsupported_error(["v1beta2", "v1"]) == (
        "manager version, v1beta1, is not among plugin supported versions [v1beta2 v1]"
    )
    no_versions = "manager version, v1beta1, is not among plugin supported versions []"
    assert plugin_versions_unsupported_error([]) == no_versions
    assert invalid_plugin_name_error("gpu") == 'invalid name of device plugin socket: the ResourceName "gpu" is invalid'


def test_error_strings_quote_like_go() -> None:
    # %q escapes; %v (the watcher's version list) prints elements raw.
    assert unsupported_version_error("v1 \n") == (
        'requested API version "v1 \\n" is not supported by kubelet. Supported version is ["v1beta1"]'
    )
    assert invalid_resource_name_error('a"b') == 'the ResourceName "a\\"b" is invalid'
    assert plugin_versions_unsupported_error(["a b", '"c"']) == (
        'manager version, v1beta1, is not among plugin supported versions [a b "c"]'
    )


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("v1beta1", '"v1beta1"'),
        ('say "hi" \\', r'"say \"hi\" \\"'),
        ("\a\b\f\n\r\t\v", r'"\a\b\f\n\r\t\v"'),
        ("\x00\x1b\x7f", r'"\x00\x1b\x7f"'),
        ("\u00a0\u00ad", r'"\u00a0\u00ad"'),  # no-break space, soft hyphen: not printable in Go
        ("\u2028\ufeff", r'"\u2028\ufeff"'),
        ("\U000e0001", r'"\U000e0001"'),  # a format character outside the BMP
        ("é😀 ", '"é😀 "'),  # printable non-ASCII stays as it is
        ("\U00031350\u0cf3", '"\U00031350\u0cf3"'),  # printable since Unicode 15, which Go's tables have
        ("\u0378", r'"\u0378"'),  # unassigned
    ],
)
def test_go_quote(text: str, quoted: str) -> None:
    assert go_quote(text) == quoted


@given(st.text())
def test_go_quote_is_an_unambiguous_literal(text: str) -> None:
    # Go's escapes are all valid Python escapes, so the quoted form must read back as the original.
    quoted = go_quote(text)
    assert ast.literal_eval(quoted) == text
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F or c in "\u2028\u2029" for c in quoted)


@pytest.mark.parametrize("endpoint", ["dp.sock", "dp.1700000000", "nvidia-gpu.sock", ".hidden", "x" * 255, "é.sock"])
def test_plain_socket_file_names_are_valid_endpoints(endpoint: str) -> None:
    assert validate_endpoint_name(endpoint) is None


@pytest.mark.parametrize(
    "endpoint",
    ["", ".", "..", "../kubelet.sock", "/var/run/dp.sock", "sub/dp.sock", "dp.sock/", "dp\0.sock", "x" * 256],
)
def test_endpoints_that_leave_the_directory_are_rejected(endpoint: str) -> None:
    problem = validate_endpoint_name(endpoint)
    assert problem == f"invalid endpoint {go_quote(endpoint)}: must be a socket file name inside the plugin directory"


def test_watcher_validation_checks_versions_then_name() -> None:
    assert validate_watcher_plugin("vendor.com/gpu", ["v1beta1"]) is None
    assert validate_watcher_plugin("vendor.com/gpu", ["v1alpha", "v1beta1"]) is None
    assert validate_watcher_plugin("gpu", ["v1"]) == plugin_versions_unsupported_error(["v1"])
    assert validate_watcher_plugin("gpu", ["v1beta1"]) == invalid_plugin_name_error("gpu")
    assert validate_watcher_plugin("vendor.com/gpu", []) == plugin_versions_unsupported_error([])
