"""Cluster-mode settings the agent's flags need before (and without) importing the Kubernetes client."""

from __future__ import annotations

import os

NODEDEVICES_DEBOUNCE_SECONDS = 1.0
NODEDEVICES_MAX_DEVICES = 128  # per resource, as a DRA ResourceSlice
CLUSTER_EXTRA_HINT = "cluster mode needs the Kubernetes client: pip install 'deviceplane[cluster]'"


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
