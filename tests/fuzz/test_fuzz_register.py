"""Fuzzing Register requests against a real agent over its real socket: names, endpoints (arbitrary text, and every
kind of file a plugin directory can hold: dead sockets, regular files, directories, FIFOs, symlinks in, out, looping
and dangling), versions and options. Each gets gRPC Unknown with one of the documented messages; nothing is
registered (no endpoint serves); the counter's labels stay bounded; the agent stays live."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.core.names import is_extended_resource_name
from tests.fuzz.conftest import assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess

DOCUMENTED = (
    "requested API version ",
    "the ResourceName ",
    "invalid endpoint ",
    "failed to dial device plugin",
    "failed to get device plugin options",
    "device plugin already connecting",
)
NAMES = st.one_of(
    st.sampled_from(["example.com/fz-a", "example.com/fz-b", "fz", "kubernetes.io/x", "requests.a/b", "a/b/c", ""]),
    st.text(max_size=20),
    st.from_regex(r"[a-z0-9.]{1,10}/[A-Za-z0-9_.-]{1,10}", fullmatch=True),
)
ENTRIES = ["dead.sock", "file.sock", "dir.sock", "fifo.sock", "in.sock", "out.sock", "loop.sock", "dangling.sock"]
ENDPOINTS = st.one_of(
    st.sampled_from([*ENTRIES, "missing.sock", "../x", "/abs", "a/b", ".", "..", "", "kubelet.sock", "x" * 300]),
    st.text(max_size=30),
)


@pytest.fixture(scope="module")
def plugin_dir_entries(fuzz_agent: AgentProcess, fuzz_root: Path) -> Iterator[Path]:
    d = fuzz_agent.plugin_dir
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(d / "dead.sock"))
    dead.close()  # a socket file nobody listens on
    (d / "file.sock").write_text("x")
    (d / "dir.sock").mkdir()
    os.mkfifo(d / "fifo.sock")
    os.symlink("dead.sock", d / "in.sock")
    outside = socket.socket(socket.AF_UNIX)
    outside.bind(str(fuzz_root / "outside.sock"))
    os.symlink(fuzz_root / "outside.sock", d / "out.sock")
    os.symlink("loop.sock", d / "loop.sock")
    os.symlink("nothing-here", d / "dangling.sock")
    yield d
    outside.close()


@fuzz_settings(bounded=200, long=20_000)
@given(
    NAMES,
    ENDPOINTS,
    st.sampled_from(["v1beta1", "v1beta1", "v1alpha", "", "v1beta1 "]) | st.text(max_size=8),
    st.booleans(),
    st.booleans(),
)
def test_fuzz_register_requests(
    fuzz_agent: AgentProcess,
    plugin_dir_entries: Path,
    name: str,
    endpoint: str,
    version: str,
    pre_start: bool,
    preferred: bool,
) -> None:
    request = pb.RegisterRequest(
        version=version,
        endpoint=endpoint,
        resource_name=name,
        options=pb.DevicePluginOptions(pre_start_required=pre_start, get_preferred_allocation_available=preferred),
    )
    with grpc.insecure_channel(f"unix://{plugin_dir_entries / 'kubelet.sock'}") as channel:
        try:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=20)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNKNOWN, (err.code(), err.details())
            assert str(err.details()).startswith(DOCUMENTED), err.details()
        else:
            raise AssertionError(f"registered {name!r} at {endpoint!r}: nothing serves there")
    assert fuzz_agent.resources() == {}
    labels = set()
    for line in fuzz_agent.get_text("/metrics").splitlines():
        if line.startswith("deviceplane_device_plugin_registration_total{"):
            labels.add(line.split('resource_name="', 1)[1].rsplit('"', 1)[0])
    assert all(label == "<invalid>" or is_extended_resource_name(label) for label in labels), labels
    assert_live(fuzz_agent)
