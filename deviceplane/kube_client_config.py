"""The Kubernetes client configuration deviceplane's programs start from: the official client with urllib3's own
retries off.

urllib3 retried each failed request 3 times, each with a WARNING of its own, and against a server that drops
packets waited 4 timeouts before the caller's own retry started. Each program has that retry already, with a backoff
(the agent's kube backoff, the operator's per-config reconcile backoff): it is the one retry. When a failed request
drops the client's connection pool: deviceplane/kube_pool.py. Needs the `cluster` or `operator` extra (the kubernetes
package).
"""

from __future__ import annotations

from kubernetes import client


def client_configuration() -> client.Configuration:
    """A fresh Configuration whose connection pool retries nothing. Hand it to the config loader
    (`client_configuration=`) before the ApiClient is made: the pool reads `retries` when it is created."""
    configuration = client.Configuration()
    configuration.retries = False
    return configuration
