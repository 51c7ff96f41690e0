"""Run options merged across a container's resources (spec §4.10, §6.3 TestDeviceRunContainerOptions)."""

from __future__ import annotations

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.run_options import DeviceOption, MountOption, merge_run_options


def test_empty_response_gives_empty_options() -> None:
    options = merge_run_options([("r", pb.ContainerAllocateResponse())])
    assert options.to_json() == {"envs": {}, "mounts": [], "devices": [], "annotations": {}, "cdiDevices": []}


def test_cdi_devices_pass_through_concatenate_and_dedupe() -> None:
    a = pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name="vendor.com/a=1"), pb.CDIDevice(name="x=1")])
    b = pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name="vendor.com/b=2"), pb.CDIDevice(name="x=1")])
    assert merge_run_options([("a", a)]).cdi_devices == ["vendor.com/a=1", "x=1"]
    assert merge_run_options([("a", a), ("b", b)]).cdi_devices == ["vendor.com/a=1", "x=1", "vendor.com/b=2"]


def test_first_wins_and_conflicts_are_reported_not_raised() -> None:
    first = pb.ContainerAllocateResponse(
        envs={"A": "1", "SAME": "s"},
        mounts=[pb.Mount(container_path="/m", host_path="/h1", read_only=True)],
        devices=[pb.DeviceSpec(container_path="/dev/x", host_path="/dev/x0", permissions="rw")],
        annotations={"k": "v1"},
    )
    second = pb.ContainerAllocateResponse(
        envs={"A": "2", "SAME": "s", "B": "b"},
        mounts=[pb.Mount(container_path="/m", host_path="/h2"), pb.Mount(container_path="/n", host_path="/hn")],
        devices=[pb.DeviceSpec(container_path="/dev/x", host_path="/dev/x1", permissions="r")],
        annotations={"k": "v2", "other": "o"},
    )
    options = merge_run_options([("r1", first), ("r2", second)])
    assert options.envs == {"A": "1", "SAME": "s", "B": "b"}
    assert options.mounts == [MountOption("/m", "/h1", True), MountOption("/n", "/hn", False)]
    assert options.devices == [DeviceOption("/dev/x", "/dev/x0", "rw")]
    assert options.annotations == {"k": "v1", "other": "o"}
    assert len(options.conflicts) == 4
    assert any("Environment variable A has conflicting setting" in c for c in options.conflicts)
