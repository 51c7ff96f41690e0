"""Facts read from the host the agent runs on."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

SYS_NODES = Path("/sys/devices/system/node")


def detect_numa_nodes(sys_nodes: Path = SYS_NODES) -> list[int]:
    """NUMA node ids from sysfs (node0, node1, ...); [0] when sysfs says nothing."""
    try:
        found = sorted(int(m.group(1)) for e in os.listdir(sys_nodes) if (m := re.fullmatch(r"node(\d+)", e)))
    except OSError:
        found = []
    return found or [0]


def default_node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()
