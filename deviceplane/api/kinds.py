"""The project's two custom resources, described for the CRD generator (`make crds` writes crds/ from these)."""

from __future__ import annotations

from pydantic import Field

from deviceplane.api import dpc
from deviceplane.api.crd import CrdSpec, PrinterColumn
from deviceplane.api.dpc import CrdModel
from deviceplane.api.models import DevicesStatus

GROUP = dpc.GROUP
VERSION = dpc.VERSION
LABELS = {"app.kubernetes.io/part-of": "deviceplane"}


class NodeDevicesSpec(CrdModel):
    """Which node this object describes."""

    nodeName: str = Field(min_length=1, max_length=253, description="The node (also this object's name).")


NODE_DEVICES = CrdSpec(
    group=GROUP,
    version=VERSION,
    kind="NodeDevices",
    plural="nodedevices",
    scope="Cluster",
    spec_model=NodeDevicesSpec,
    status_model=DevicesStatus,
    description="The devices of one node as its deviceplane agent sees them: resources, per-device health and "
    "owners. Named after the node, owned by it, written by the node's agent.",
    short_names=("nd",),
    # The node's agent may write only its own object's status (manifests/30-agent-policy.yaml checks spec.nodeName),
    # and may not patch the spec: an edit to it would stop every later status write, and nothing could repair it.
    root_validations=(
        {
            "rule": "self.spec.nodeName == self.metadata.name",
            "message": "spec.nodeName must be the object's name: the node it describes",
        },
    ),
    categories=("deviceplane",),
    printer_columns=(
        PrinterColumn("Resources", ".status.resourceCount", "integer", "Resources served on the node."),
        PrinterColumn("Devices", ".status.deviceCount", "integer", "Devices over all resources."),
        PrinterColumn("Healthy", ".status.healthyCount", "integer", "Healthy devices."),
        PrinterColumn("Allocated", ".status.allocatedCount", "integer", "Devices allocated to containers."),
        # A stopped agent's counts stay as they were: only the heartbeat's age tells it from a live one.
        PrinterColumn(
            "Heartbeat",
            ".status.agent.lastHeartbeatTime",
            "date",
            "When the node's agent last wrote (every minute while it runs).",
        ),
        PrinterColumn(
            "Plugins",
            '.status.conditions[?(@.type=="PluginsConnected")].status',
            "string",
            "PluginsConnected: every resource's plugin connected.",
            priority=1,
        ),
        PrinterColumn(
            "Devices-Healthy",
            '.status.conditions[?(@.type=="DevicesHealthy")].status',
            "string",
            "DevicesHealthy: every device healthy.",
            priority=1,
        ),
        # Empty in agent mode, where the condition is absent (the agent allocates: its owners are always current).
        PrinterColumn(
            "Owners-Current",
            '.status.conditions[?(@.type=="OwnersCurrent")].status',
            "string",
            "OwnersCurrent (proxy mode): the devices' owners are the kubelet's latest.",
            priority=1,
        ),
    ),
    labels=LABELS,
)

DEVICE_PLUGIN_CONFIG = CrdSpec(
    group=GROUP,
    version=VERSION,
    kind=dpc.KIND,
    plural=dpc.PLURAL,
    scope="Namespaced",
    spec_model=dpc.DevicePluginConfigSpec,
    status_model=dpc.DevicePluginConfigStatus,
    description="A device plugin to run as a DaemonSet in this namespace; deviceplane's operator renders it, "
    "reports the rollout and resolves two configs serving one resource on the same node.",
    short_names=("dpc",),
    name_validations=(
        {
            "rule": f"self.size() <= {dpc.MAX_NAME_LENGTH}",
            "message": f"a DevicePluginConfig name must be at most {dpc.MAX_NAME_LENGTH} characters "
            "(its DaemonSet is <name>-plugin)",
        },
    ),
    categories=("deviceplane",),
    printer_columns=(
        PrinterColumn("Resource", ".spec.resourceName", "string", "The extended resource served."),
        PrinterColumn("Desired", ".status.desiredNumberScheduled", "integer", "Nodes that should run the plugin."),
        PrinterColumn("Ready", ".status.numberReady", "integer", "Nodes whose plugin pod is ready."),
        PrinterColumn("Up-to-date", ".status.updatedNumberScheduled", "integer", "Nodes on the current template."),
        PrinterColumn(
            "Conflict",
            '.status.conditions[?(@.type=="Conflict")].status',
            "string",
            "Shares nodes with another config.",
        ),
        # The counts are the DaemonSet's: a refused or paused change leaves them all "healthy" while the DaemonSet
        # runs an older spec. The Ready and Degraded conditions' reasons say what the counts cannot.
        PrinterColumn(
            "Status",
            '.status.conditions[?(@.type=="Ready")].reason',
            "string",
            "Why the config is (not) Ready: Available, NoNodes, RollingOut, Pending, DaemonSetMissing, "
            "DaemonSetOutdated (the DaemonSet does not run the current spec), WaitingForPodDeletion (OnDelete), "
            "Paused, RequestRefused (Unknown: a request was refused before the DaemonSet could be checked).",
        ),
        PrinterColumn(
            "Degraded",
            '.status.conditions[?(@.type=="Degraded")].reason',
            "string",
            "What is failing (AsExpected: nothing): PodsFailing, PodsNotCreated, DaemonSetRejected, "
            "DaemonSetWriteFailed, DaemonSetNotOurs, ConfigMapMissing, RequestRefused (the API server refused "
            "another request, e.g. 403), InvalidSpec.",
        ),
    ),
    labels=LABELS,
)

ALL = (NODE_DEVICES, DEVICE_PLUGIN_CONFIG)
