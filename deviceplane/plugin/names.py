"""Resource-name validation and the plugin's socket file name.

The resource-name rule is the kubelet's `IsExtendedResourceName` (spec §4.2): checking it in the plugin turns a typo
into an error at start instead of a registration the agent rejects over and over.
"""

from __future__ import annotations

import os
import re
import secrets

# The same rule the agent applies on Register: one implementation, so plugin and agent can never disagree.
from deviceplane.core.names import is_extended_resource_name
from deviceplane.unix_sockets import MAX_SOCKET_PATH

__all__ = ["MAX_SOCKET_PATH", "check_resource_name", "is_extended_resource_name", "socket_file_name"]


def check_resource_name(name: str) -> None:
    """Raise ValueError, worded for a human, unless `name` is a valid extended resource name."""
    if not isinstance(name, str) or not is_extended_resource_name(name):
        raise ValueError(
            f"invalid resource name {name!r}: must look like 'vendor.example.com/name' "
            "(a DNS subdomain, '/', then up to 63 letters, digits, '-', '_' or '.'; not in kubernetes.io)"
        )


def socket_file_name(resource: str, token: str | None = None) -> str:
    """`<sanitised resource>-<pid>-<token>.sock`: readable in `ls`, never a path separator, and unique per plugin
    instance - the pid alone is not: in containers plugins are usually pid 1, and two of them (a DaemonSet surge
    rollout) would take each other's socket. `token` defaults to a fresh random one."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", resource)
    return f"{safe}-{os.getpid()}-{token or secrets.token_hex(4)}.sock"
