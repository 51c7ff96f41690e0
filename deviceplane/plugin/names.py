"""Resource-name validation and the plugin's socket file name.

The resource-name rule is the kubelet's `IsExtendedResourceName` (spec §4.2): checking it in the plugin turns a typo
into an error at start instead of a registration the agent rejects over and over.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets

# The same rule the agent applies on Register: one implementation, so plugin and agent can never disagree.
from deviceplane.core.constants import DEVICE_PLUGIN_PATH
from deviceplane.core.names import is_extended_resource_name
from deviceplane.unix_sockets import MAX_SOCKET_PATH

__all__ = [
    "MAX_SOCKET_PATH",
    "check_resource_name",
    "is_extended_resource_name",
    "socket_file_name",
    "socket_name_pattern",
]

_TOKEN_BYTES = 4


def check_resource_name(name: str) -> None:
    """Raise ValueError, worded for a human, unless `name` is a valid extended resource name."""
    if not isinstance(name, str) or not is_extended_resource_name(name):
        raise ValueError(
            f"invalid resource name {name!r}: must look like 'vendor.example.com/name' "
            "(a DNS subdomain, '/', then up to 63 letters, digits, '-', '_' or '.'; not in kubernetes.io)"
        )


# The kubelet's directory, "/var/lib/kubelet/device-plugins/" (32 bytes), leaves a socket name 75 bytes of sun_path.
# The name ends in "-<pid>-<8 hex>.sock": 22 bytes at most (pid_max is at most 2**22, 7 digits). A longer resource
# part - valid names reach 308 characters - keeps its first 44 characters and adds "~" and 8 hex of the resource's
# SHA-256: still readable in `ls`, still one name per resource ("~" occurs in no resource name, so a shortened name
# cannot equal another resource's full one), and it fits.
KUBELET_DIR_BYTES = len(DEVICE_PLUGIN_PATH.rstrip("/") + "/")
_SUFFIX_MAX_BYTES = len(f"-{2**22}-") + 2 * _TOKEN_BYTES + len(".sock")  # "-<pid>-<token hex>.sock"
MAX_RESOURCE_PART = MAX_SOCKET_PATH - KUBELET_DIR_BYTES - _SUFFIX_MAX_BYTES
_DIGEST_CHARS = 8


def socket_name_prefix(resource: str) -> str:
    """The part of this resource's socket names before `-<pid>-<token>.sock`."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", resource)
    if len(safe) <= MAX_RESOURCE_PART:
        return safe
    digest = hashlib.sha256(resource.encode()).hexdigest()[:_DIGEST_CHARS]
    return f"{safe[: MAX_RESOURCE_PART - 1 - _DIGEST_CHARS]}~{digest}"


def socket_name_pattern(resource: str) -> re.Pattern[str]:
    """Matches the socket names socket_file_name gives this resource, and no other resource's."""
    return re.compile(rf"{re.escape(socket_name_prefix(resource))}-[0-9]+-[0-9a-f]{{{_TOKEN_BYTES * 2}}}\.sock")


def socket_file_name(resource: str, token: str | None = None) -> str:
    """`<sanitised resource>-<pid>-<token>.sock`: readable in `ls`, never a path separator, and unique per plugin
    instance - the pid alone is not: in containers plugins are usually pid 1, and two of them (a DaemonSet surge
    rollout) would take each other's socket. `token` defaults to a fresh random one. Fits in the kubelet's directory
    for any valid resource name."""
    return f"{socket_name_prefix(resource)}-{os.getpid()}-{token or secrets.token_hex(_TOKEN_BYTES)}.sock"
