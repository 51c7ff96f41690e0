"""`deviceplane status`: the local agent's conditions, resources, devices, health, NUMA nodes and owners, and its pods.

Reads the agent's `/api/v1/devices` and `/api/v1/pods`; prints tables, or both documents as JSON or YAML.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import yaml

DEFAULT_URL = "http://127.0.0.1:9450"
TIMEOUT_SECONDS = 5.0
# Every device of a large node makes an unreadable table, and its JSON holds the agent's event loop (~0.2 s for 100,000
# devices, benchmarks/reads.py): the same bound as NodeDevices unless asked for more.
DEFAULT_MAX_DEVICES = 128
# The largest `limit` /api/v1/devices takes (nine digits): more devices than any node has.
MAX_DEVICES_BOUND = 999_999_999


class Unreachable(Exception):
    pass


class Refused(Exception):
    """The agent answered, with an error."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the agent's URL, or its --http-addr (HOST:PORT) [{DEFAULT_URL}]"
    )
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    parser.add_argument(
        "--max-devices",
        type=max_devices,
        default=DEFAULT_MAX_DEVICES,
        metavar="N|all",
        help=f"devices listed per resource; counts stay exact [{DEFAULT_MAX_DEVICES}, as NodeDevices]",
    )


def max_devices(text: str) -> int | None:
    """A count of devices, or `all` (None: no limit)."""
    if text == "all":
        return None
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of devices or 'all', got {text!r}")
    count = int(text)
    if count > MAX_DEVICES_BOUND:
        raise argparse.ArgumentTypeError(f"at most {MAX_DEVICES_BOUND} devices, or 'all', got {text}")
    return count


def base_url(url: str) -> str:
    """`--url` as given: a URL, or the agent's `--http-addr` as is (HOST:PORT, no scheme), read as http://HOST:PORT."""
    return (url if "://" in url else f"http://{url}").rstrip("/")


def fetch(url: str, path: str) -> Any:
    try:
        with urllib.request.urlopen(base_url(url) + path, timeout=TIMEOUT_SECONDS) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise Refused(f"{path} answered {err.code} {err.reason}{error_detail(err)}") from err
    except urllib.error.URLError as err:
        raise Unreachable(str(getattr(err.reason, "strerror", None) or err.reason)) from err
    except (OSError, ValueError) as err:
        raise Unreachable(str(err)) from err


def error_detail(err: urllib.error.HTTPError) -> str:
    """`: message` from the agent's `{"error": message}` body, or nothing."""
    try:
        message = json.loads(err.read()).get("error")
    except (OSError, ValueError, AttributeError, RecursionError):  # not the agent's JSON: the status line says enough
        return ""
    return f": {message}" if isinstance(message, str) and message else ""


def owner(device: dict[str, Any]) -> str:
    held = device.get("allocatedTo")
    if not held:
        return "-"
    return f"{held['namespace']}/{held['pod']}/{held['container']}"


def plugin_state(plugin: dict[str, Any]) -> str:
    """The plugin's connection, and in proxy mode whether the kubelet has the agent's endpoint for the resource."""
    state = "plugin connected" if plugin.get("connected") else "plugin disconnected"
    registered = plugin.get("kubeletRegistered")
    if registered is None:  # agent mode: no kubelet in front of which the agent sits
        return state
    return state + (", registered with the kubelet" if registered else ", NOT registered with the kubelet")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns, as kubectl prints them (no extra dependency: `status` works with the base install)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["   ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [headers, *rows]]  # fmt: skip
    return "\n".join(lines)


def parse_time(text: Any) -> datetime | None:
    """An RFC 3339 time as the agent writes them (`...Z`), or None when it is not one."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """A duration as kubectl's ages read: 45s, 5m2s, 3h4m, 2d3h."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m" if s % 3600 // 60 else f"{s // 3600}h"
    return f"{s // 86400}d{s % 86400 // 3600}h" if s % 86400 // 3600 else f"{s // 86400}d"


def since(condition: dict[str, Any], now: datetime | None) -> str:
    """When the condition's status last changed, and how long ago by the agent's own clock (its heartbeat time in
    the same document: no skew between this machine's clock and the agent's)."""
    text = condition.get("lastTransitionTime") or "-"
    changed = parse_time(text)
    if changed is None or now is None:
        return str(text)
    return f"{text} ({human_duration((now - changed).total_seconds())} ago)"


def conditions_table(devices: dict[str, Any]) -> str:
    """The node's conditions, after a line saying which are not True (every one of the agent's is good when True),
    so a bad one is seen without reading the table; empty when the agent gave none."""
    conditions = [c for c in devices.get("conditions") or [] if isinstance(c, dict)]
    if not conditions:
        return ""
    now = parse_time((devices.get("agent") or {}).get("lastHeartbeatTime"))
    bad = [str(c.get("type")) for c in conditions if c.get("status") != "True"]
    if bad:
        summary = f"conditions: {len(bad)} of {len(conditions)} NOT True: {', '.join(bad)}"
    else:
        summary = f"conditions: all {len(conditions)} True"
    rows = [
        [str(c.get(key) or "-") for key in ("type", "status", "reason")] + [since(c, now), str(c.get("message") or "")]
        for c in conditions
    ]
    return summary + "\n" + table(("CONDITION", "STATUS", "REASON", "SINCE", "MESSAGE"), rows)


def shown_health(health: str) -> str:
    """Healthy and Unhealthy as they are; any other string a plugin sent (proxy mode lists it as the kubelet does)
    quoted, so that `""` or `"Healthy "` is not read as blank or Healthy."""
    return health if health in ("Healthy", "Unhealthy") else json.dumps(health, ensure_ascii=False)


def devices_table(devices: dict[str, Any]) -> str:
    agent = devices.get("agent") or {}
    rows: list[list[str]] = []
    for resource in devices.get("resources") or []:
        plugin = resource.get("plugin") or {}
        rows.append(
            [
                resource["name"],
                f"{resource['allocatable']}/{resource['capacity']} allocatable, {resource['allocated']} allocated",
                f"{resource['healthy']} healthy, {resource['unhealthy']} unhealthy",
                "",
                plugin_state(plugin),
            ]
        )
        for device in resource.get("devices") or []:
            numa = ",".join(str(n) for n in device.get("numaNodes") or []) or "-"
            rows.append(["", device["id"], shown_health(device["health"]), numa, owner(device)])
        if resource.get("devicesTruncated"):
            rows.append(["", "...", "", "", "(device list truncated)"])
    title = f"node {agent.get('node', '?')} (agent {agent.get('version', '?')})"
    conditions = conditions_table(devices)
    return "\n".join(
        [
            title,
            *([conditions, ""] if conditions else []),
            table(("RESOURCE", "DEVICE", "HEALTH", "NUMA", "ALLOCATED TO"), rows),
        ]
    )


def pods_table(pods: list[dict[str, Any]]) -> str:
    rows = []
    for pod in pods:
        held = sorted(
            f"{container['name']}: {resource} {','.join(ids)}"
            for container in pod.get("containers") or []
            for resource, ids in (container.get("devices") or {}).items()
            if ids
        )
        name = f"{pod['namespace']}/{pod['name']}" if pod.get("name") else "-"
        rows.append(
            [name, pod.get("source", ""), pod.get("state", ""), "; ".join(held) or "-", pod.get("reason") or ""]
        )
    return table(("POD", "SOURCE", "STATE", "DEVICES", "REASON"), rows)


def run(args: argparse.Namespace) -> int:
    try:
        devices = fetch(
            args.url, "/api/v1/devices" + ("" if args.max_devices is None else f"?limit={args.max_devices}")
        )
        pods = fetch(args.url, "/api/v1/pods")
    except Unreachable as err:
        print(f"deviceplane status: cannot reach the agent at {args.url}: {err}", file=sys.stderr)
        return 1
    except Refused as err:
        print(f"deviceplane status: the agent at {args.url} refused: {err}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"devices": devices, "pods": pods}, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump({"devices": devices, "pods": pods}, sort_keys=False), end="")
    else:
        print(devices_table(devices))
        if pods:
            print()
            print(pods_table(pods))
    return 0
