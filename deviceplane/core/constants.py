"""Upstream constants of the device-plugin API and the kubelet device manager (spec §1.3, §3, §4.1)."""

from __future__ import annotations

from typing import Final

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
VERSION: Final = "v1beta1"
SUPPORTED_VERSIONS: Final = ("v1beta1",)
KUBELET_SOCKET_NAME: Final = "kubelet.sock"
CHECKPOINT_NAME: Final = "kubelet_internal_checkpoint"
NODE_WITHOUT_TOPOLOGY: Final = -1
ENDPOINT_STOP_GRACE_PERIOD_SECONDS: Final = 300.0
DIAL_TIMEOUT_SECONDS: Final = 10.0
PRE_START_TIMEOUT_SECONDS: Final = 30.0
GET_INFO_TIMEOUT_SECONDS: Final = 1.0
NOTIFY_TIMEOUT_SECONDS: Final = 5.0
PLUGIN_TYPE_DEVICE_PLUGIN: Final = "DevicePlugin"
