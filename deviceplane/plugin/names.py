"""Resource-name validation and the plugin's socket file name.

The resource-name rule is the kubelet's `IsExtendedResourceName` (spec §4.2): checking it here turns a typo into an
error at start instead of a registration the agent rejects over and over.
"""

from __future__ import annotations

import os
import re

# TODO(issue 3): switch to deviceplane.core.names.is_extended_resource_name once it lands (same rule).
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """True when the kubelet would accept `name` as a device plugin's resource (e.g. "example.com/gpu")."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, short = ("requests." + name).partition("/")
    if "/" in short or not short or len(short) > 63 or not _QUALIFIED_NAME.match(short):
        return False
    return len(prefix) <= 253 and _DNS1123_SUBDOMAIN.match(prefix) is not None


def check_resource_name(name: str) -> None:
    """Raise ValueError, worded for a human, unless `name` is a valid extended resource name."""
    if not isinstance(name, str) or not is_extended_resource_name(name):
        raise ValueError(
            f"invalid resource name {name!r}: must look like 'vendor.example.com/name' "
            "(a DNS subdomain, '/', then up to 63 letters, digits, '-', '_' or '.'; not in kubernetes.io)"
        )


# Unix socket paths are limited by sockaddr_un.sun_path (108 bytes on Linux, including the terminating NUL).
MAX_SOCKET_PATH = 107


def socket_file_name(resource: str, suffix: str | None = None) -> str:
    """`<sanitised resource>-<pid>.sock`: readable in `ls`, unique per process, never a path separator."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", resource)
    return f"{safe}-{suffix or os.getpid()}.sock"
