"""`deviceplane status`: the local agent's resources, devices, health, NUMA nodes and owners, and its pods.

Reads the agent's `/api/v1/devices` and `/api/v1/pods`; prints tables, or both documents as JSON or YAML.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

DEFAULT_URL = "http://127.0.0.1:9450"
TIMEOUT_SECONDS = 5.0


class Unreachable(Exception):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the agent's HTTP address (--http-addr) [{DEFAULT_URL}]")
    parser.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")


def fetch(url: str, path: str) -> Any:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=TIMEOUT_SECONDS) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise Unreachable(f"{path} answered {err.code} {err.reason}") from err
    except urllib.error.URLError as err:
        raise Unreachable(str(getattr(err.reason, "strerror", None) or err.reason)) from err
    except (OSError, ValueError) as err:
        raise Unreachable(str(err)) from err


def owner(device: dict[str, Any]) -> str:
    held = device.get("allocatedTo")
    if not held:
        return "-"
    return f"{held['namespace']}/{held['pod']}/{held['container']}"


def devices_table(devices: dict[str, Any]) -> Table:
    agent = devices.get("agent") or {}
    table = Table(
        title=f"node {agent.get('node', '?')} (agent {agent.get('version', '?')})", title_justify="left", box=None
    )
    for column in ("RESOURCE", "DEVICE", "HEALTH", "NUMA", "ALLOCATED TO"):
        table.add_column(column)
    for resource in devices.get("resources") or []:
        plugin = resource.get("plugin") or {}
        state = "connected" if plugin.get("connected") else "disconnected"
        table.add_row(
            f"[bold]{resource['name']}[/bold]",
            f"{resource['allocatable']}/{resource['capacity']} allocatable, {resource['allocated']} allocated",
            f"{resource['healthy']} healthy, {resource['unhealthy']} unhealthy",
            "",
            f"plugin {state}",
        )
        for device in resource.get("devices") or []:
            health = device["health"]
            table.add_row(
                "",
                device["id"],
                health if health == "Healthy" else f"[red]{health}[/red]",
                ",".join(str(n) for n in device.get("numaNodes") or []) or "-",
                owner(device),
            )
        if resource.get("devicesTruncated"):
            table.add_row("", "...", "", "", "(device list truncated)")
    return table


def pods_table(pods: list[dict[str, Any]]) -> Table:
    table = Table(title="pods", title_justify="left", box=None)
    for column in ("POD", "SOURCE", "STATE", "DEVICES", "REASON"):
        table.add_column(column)
    for pod in pods:
        name = f"{pod['namespace']}/{pod['name']}" if pod.get("name") else "-"
        held = sorted(
            f"{container['name']}: {resource} {','.join(ids)}"
            for container in pod.get("containers") or []
            for resource, ids in (container.get("devices") or {}).items()
            if ids
        )
        reason = pod.get("reason") or ""
        table.add_row(name, pod.get("source", ""), pod.get("state", ""), "\n".join(held) or "-", reason)
    return table


def run(args: argparse.Namespace) -> int:
    try:
        devices = fetch(args.url, "/api/v1/devices")
        pods = fetch(args.url, "/api/v1/pods")
    except Unreachable as err:
        print(f"deviceplane status: cannot reach the agent at {args.url}: {err}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps({"devices": devices, "pods": pods}, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump({"devices": devices, "pods": pods}, sort_keys=False), end="")
    else:
        console = Console()
        console.print(devices_table(devices))
        if pods:
            console.print(pods_table(pods))
    return 0
