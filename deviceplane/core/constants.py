"""Upstream constants of the device-plugin API and the kubelet device manager (spec §1.3, §3, §4.1), and the few of
deviceplane's own that sit beside them."""

from __future__ import annotations

from typing import Final

# deviceplugin/v1beta1 constants.go
HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
VERSION: Final = "v1beta1"
SUPPORTED_VERSIONS: Final = ("v1beta1",)
DEVICE_PLUGIN_PATH: Final = "/var/lib/kubelet/device-plugins/"  # hard-coded upstream, trailing slash included
KUBELET_SOCKET_NAME: Final = "kubelet.sock"
# podresources/v1: where the kubelet serves PodResourcesLister
KUBELET_POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
PRE_START_TIMEOUT_SECONDS: Final = 30.0

# pkg/kubelet/cm/devicemanager
CHECKPOINT_NAME: Final = "kubelet_internal_checkpoint"
CHECKPOINT_TEMP_PREFIX: Final = "."  # checkpoint-store temp files; entries with it are not checkpoints
NODE_WITHOUT_TOPOLOGY: Final = -1
ENDPOINT_STOP_GRACE_PERIOD_SECONDS: Final = 300.0
DIAL_TIMEOUT_SECONDS: Final = 10.0

# pkg/kubelet/pluginmanager (plugin watcher) and pluginregistration/v1
GET_INFO_TIMEOUT_SECONDS: Final = 1.0
NOTIFY_TIMEOUT_SECONDS: Final = 5.0
PLUGIN_TYPE_DEVICE_PLUGIN: Final = "DevicePlugin"
PLUGIN_TYPE_CSI: Final = "CSIPlugin"
PLUGIN_TYPE_DRA: Final = "DRAPlugin"

# Go's int64: checkpoint NUMA ids and pod quantities must fit it.
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

# deviceplane's own, no upstream value: the kubelet gives Allocate and GetPreferredAllocation no deadline
# (`--allocate-timeout`).
ALLOCATE_TIMEOUT_SECONDS: Final = 10.0
