"""The generated protobuf/gRPC code is current, and carries the upstream wire facts (spec §1-§3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as dp
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from deviceplane.api.pluginregistration.v1 import api_pb2 as reg
from deviceplane.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from deviceplane.api.podresources.v1 import api_pb2 as podres
from deviceplane.api.podresources.v1 import api_pb2_grpc as podres_grpc

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "deviceplane" / "api"
GENERATED_PACKAGES = ("deviceplugin", "podresources", "pluginregistration")


def source_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for package in GENERATED_PACKAGES
        for path in sorted((root / package).rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_checked_in_code_is_what_gen_proto_generates(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True, cwd=ROOT)
    generated, checked_in = source_files(tmp_path), source_files(API)
    assert len(generated) >= 12  # three packages: pb2, pyi, grpc and __init__ files
    assert sorted(checked_in) == sorted(generated), "files differ: run `make proto`"
    stale = [name for name in generated if checked_in[name] != generated[name]]
    assert not stale, f"stale generated code (run `make proto`): {stale}"


# -- services: full gRPC method names ----------------------------------------------------------------------------------


class RecordingChannel:
    """Stands in for grpc.Channel: records the method paths a generated stub binds."""

    def __init__(self) -> None:
        self.methods: dict[str, str] = {}

    def _bind(self, kind: str) -> Any:
        def bind(path: str, *args: object, **kwargs: object) -> str:
            self.methods[path] = kind
            return path

        return bind

    def __getattr__(self, kind: str) -> Any:
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._bind(kind)
        raise AttributeError(kind)


def stub_methods(*stubs: type) -> dict[str, str]:
    channel = RecordingChannel()
    for stub in stubs:
        stub(channel)
    return channel.methods


def descriptor_methods(*modules: ModuleType) -> set[str]:
    return {
        f"/{service.full_name}/{method.name}"
        for module in modules
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }


UPSTREAM_METHODS = {
    "/v1beta1.Registration/Register": "unary_unary",
    "/v1beta1.DevicePlugin/GetDevicePluginOptions": "unary_unary",
    "/v1beta1.DevicePlugin/ListAndWatch": "unary_stream",
    "/v1beta1.DevicePlugin/GetPreferredAllocation": "unary_unary",
    "/v1beta1.DevicePlugin/Allocate": "unary_unary",
    "/v1beta1.DevicePlugin/PreStartContainer": "unary_unary",
    "/v1.PodResourcesLister/List": "unary_unary",
    "/v1.PodResourcesLister/GetAllocatableResources": "unary_unary",
    "/v1.PodResourcesLister/Get": "unary_unary",
    "/pluginregistration.Registration/GetInfo": "unary_unary",
    "/pluginregistration.Registration/NotifyRegistrationStatus": "unary_unary",
}


def test_stubs_call_the_upstream_method_paths() -> None:
    methods = stub_methods(
        dp_grpc.RegistrationStub,
        dp_grpc.DevicePluginStub,
        podres_grpc.PodResourcesListerStub,
        reg_grpc.RegistrationStub,
    )
    assert methods == UPSTREAM_METHODS


def test_descriptors_declare_exactly_the_upstream_services() -> None:
    assert descriptor_methods(dp, podres, reg) == set(UPSTREAM_METHODS)
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert podres.DESCRIPTOR.package == "v1"
    assert reg.DESCRIPTOR.package == "pluginregistration"


# -- messages: field numbers and types ---------------------------------------------------------------------------------

T = FieldDescriptor
# Spec §1.2, every deviceplugin v1beta1 message: field name -> (number, type, repeated).
DEVICE_PLUGIN_MESSAGES: dict[str, dict[str, tuple[int, int, bool]]] = {
    "DevicePluginOptions": {
        "pre_start_required": (1, T.TYPE_BOOL, False),
        "get_preferred_allocation_available": (2, T.TYPE_BOOL, False),
    },
    "RegisterRequest": {
        "version": (1, T.TYPE_STRING, False),
        "endpoint": (2, T.TYPE_STRING, False),
        "resource_name": (3, T.TYPE_STRING, False),
        "options": (4, T.TYPE_MESSAGE, False),
    },
    "Empty": {},
    "ListAndWatchResponse": {"devices": (1, T.TYPE_MESSAGE, True)},
    "TopologyInfo": {"nodes": (1, T.TYPE_MESSAGE, True)},
    "NUMANode": {"ID": (1, T.TYPE_INT64, False)},
    "Device": {
        "ID": (1, T.TYPE_STRING, False),
        "health": (2, T.TYPE_STRING, False),
        "topology": (3, T.TYPE_MESSAGE, False),
    },
    "PreStartContainerRequest": {"devices_ids": (1, T.TYPE_STRING, True)},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": (1, T.TYPE_MESSAGE, True)},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": (1, T.TYPE_STRING, True),
        "must_include_deviceIDs": (2, T.TYPE_STRING, True),
        "allocation_size": (3, T.TYPE_INT32, False),
    },
    "PreferredAllocationResponse": {"container_responses": (1, T.TYPE_MESSAGE, True)},
    "ContainerPreferredAllocationResponse": {"deviceIDs": (1, T.TYPE_STRING, True)},
    "AllocateRequest": {"container_requests": (1, T.TYPE_MESSAGE, True)},
    "ContainerAllocateRequest": {"devices_ids": (1, T.TYPE_STRING, True)},
    "CDIDevice": {"name": (1, T.TYPE_STRING, False)},
    "AllocateResponse": {"container_responses": (1, T.TYPE_MESSAGE, True)},
    "ContainerAllocateResponse": {
        "envs": (1, T.TYPE_MESSAGE, True),  # map<string, string>: a repeated entry message
        "mounts": (2, T.TYPE_MESSAGE, True),
        "devices": (3, T.TYPE_MESSAGE, True),
        "annotations": (4, T.TYPE_MESSAGE, True),
        "cdi_devices": (5, T.TYPE_MESSAGE, True),
    },
    "Mount": {
        "container_path": (1, T.TYPE_STRING, False),
        "host_path": (2, T.TYPE_STRING, False),
        "read_only": (3, T.TYPE_BOOL, False),
    },
    "DeviceSpec": {
        "container_path": (1, T.TYPE_STRING, False),
        "host_path": (2, T.TYPE_STRING, False),
        "permissions": (3, T.TYPE_STRING, False),
    },
}


def fields_of(message: Any) -> dict[str, tuple[int, int, bool]]:
    return {f.name: (f.number, f.type, f.is_repeated) for f in message.DESCRIPTOR.fields}


@pytest.mark.parametrize("name", sorted(DEVICE_PLUGIN_MESSAGES))
def test_device_plugin_message_fields(name: str) -> None:
    assert fields_of(getattr(dp, name)) == DEVICE_PLUGIN_MESSAGES[name]


def test_device_plugin_package_has_no_other_messages() -> None:
    assert set(dp.DESCRIPTOR.message_types_by_name) == set(DEVICE_PLUGIN_MESSAGES)


def test_maps_are_string_to_string() -> None:
    for name in ("envs", "annotations"):
        entry = dp.ContainerAllocateResponse.DESCRIPTOR.fields_by_name[name].message_type
        assert entry.GetOptions().map_entry
        assert fields_of_descriptor(entry) == {"key": (1, T.TYPE_STRING), "value": (2, T.TYPE_STRING)}


def fields_of_descriptor(descriptor: Any) -> dict[str, tuple[int, int]]:
    return {f.name: (f.number, f.type) for f in descriptor.fields}


def test_mixed_case_field_names_serialize_as_upstream() -> None:
    # Field 1, length-delimited, "gpu0": what a Go plugin sends for Device{ID: "gpu0"}.
    assert dp.Device(ID="gpu0").SerializeToString() == b"\x0a\x04gpu0"
    request = dp.ContainerPreferredAllocationRequest(available_deviceIDs=["a"], must_include_deviceIDs=["b"])
    assert request.SerializeToString() == b"\x0a\x01a\x12\x01b"


def test_pod_resources_dynamic_resource_keeps_field_1_reserved() -> None:
    assert 1 not in {f.number for f in podres.DynamicResource.DESCRIPTOR.fields}
    file_proto = descriptor_pb2.FileDescriptorProto()
    podres.DESCRIPTOR.CopyToProto(file_proto)
    (message,) = [m for m in file_proto.message_type if m.name == "DynamicResource"]
    assert [(r.start, r.end) for r in message.reserved_range] == [(1, 2)]  # end is exclusive
    assert fields_of_descriptor(podres.DynamicResource.DESCRIPTOR) == {
        "claim_name": (2, T.TYPE_STRING),
        "claim_namespace": (3, T.TYPE_STRING),
        "claim_resources": (4, T.TYPE_MESSAGE),
    }


def test_pod_resources_claim_resource_share_id_is_proto3_optional() -> None:
    share_id = podres.ClaimResource.DESCRIPTOR.fields_by_name["share_id"]
    assert share_id.number == 5
    assert share_id.has_presence
    assert share_id.containing_oneof is not None and share_id.containing_oneof.name == "_share_id"
    assert not podres.ClaimResource().HasField("share_id")
    assert podres.ClaimResource(share_id="").HasField("share_id")  # presence even for the empty string


def test_pod_resources_fields() -> None:
    assert fields_of_descriptor(podres.ContainerDevices.DESCRIPTOR) == {
        "resource_name": (1, T.TYPE_STRING),
        "device_ids": (2, T.TYPE_STRING),
        "topology": (3, T.TYPE_MESSAGE),
    }
    assert fields_of_descriptor(podres.ContainerResources.DESCRIPTOR)["dynamic_resources"] == (5, T.TYPE_MESSAGE)
    assert fields_of_descriptor(podres.PodResources.DESCRIPTOR)["memory"] == (5, T.TYPE_MESSAGE)
    assert fields_of_descriptor(podres.NUMANode.DESCRIPTOR) == {"ID": (1, T.TYPE_INT64)}
    assert fields_of_descriptor(podres.GetPodResourcesRequest.DESCRIPTOR) == {
        "pod_name": (1, T.TYPE_STRING),
        "pod_namespace": (2, T.TYPE_STRING),
    }


def test_plugin_registration_fields() -> None:
    assert fields_of_descriptor(reg.PluginInfo.DESCRIPTOR) == {
        "type": (1, T.TYPE_STRING),
        "name": (2, T.TYPE_STRING),
        "endpoint": (3, T.TYPE_STRING),
        "supported_versions": (4, T.TYPE_STRING),
    }
    assert reg.PluginInfo.DESCRIPTOR.fields_by_name["supported_versions"].is_repeated
    assert fields_of_descriptor(reg.RegistrationStatus.DESCRIPTOR) == {
        "plugin_registered": (1, T.TYPE_BOOL),
        "error": (2, T.TYPE_STRING),
    }
