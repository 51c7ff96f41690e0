"""`deviceplane status` against a real agent process: table, JSON and YAML views, and a clear error when the agent
cannot be reached."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.support.pods import simple_pod, wait_settled
from tests.support.procs import ROOT, AgentProcess, TestPlugin, child_env, free_port, wait_for
from tests.support.status_table import condition_rows

R = "example.com/gpu"


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deviceplane", "status", *args],
        capture_output=True,
        text=True,
        env={**child_env(), "COLUMNS": "200"},
        cwd=ROOT,
        timeout=60,
    )


def test_status_shows_devices_health_numa_and_owners(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin], short_tmp: Path
) -> None:
    manifests = short_tmp / "manifests"
    agent = agent_factory("--pod-manifest-dir", str(manifests))
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["g0", "Healthy", [0]], ["g1", "Unhealthy", [1]]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (2, 1))
    simple_pod(manifests, "trainer", R, 1, namespace="ml")
    assert wait_settled(agent, "trainer")["state"] == "admitted"

    table = status("--url", agent.url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.strip()}
    assert rows["g0"] == ["g0", "Healthy", "0", "ml/trainer/main"], table.stdout
    assert rows["g1"] == ["g1", "Unhealthy", "1", "-"], table.stdout
    assert any(R in line and "1/2 allocatable" in line and "1 allocated" in line for line in lines), table.stdout
    assert any("ml/trainer" in line and "admitted" in line for line in lines), table.stdout

    as_json = status("--url", agent.url, "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    (resource,) = document["devices"]["resources"]
    assert {d["id"]: (d["health"], d["numaNodes"]) for d in resource["devices"]} == {
        "g0": ("Healthy", [0]),
        "g1": ("Unhealthy", [1]),
    }
    assert resource["devices"][0]["allocatedTo"] == {"namespace": "ml", "pod": "trainer", "container": "main"}
    assert [p["name"] for p in document["pods"]] == ["trainer"]

    as_yaml = status("--url", agent.url, "-o", "yaml")
    assert as_yaml.returncode == 0, as_yaml.stderr
    from_yaml = yaml.safe_load(as_yaml.stdout)
    assert from_yaml["devices"]["resources"] == document["devices"]["resources"]
    assert from_yaml["pods"] == document["pods"]


def test_status_shows_the_conditions_and_says_which_are_not_true(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    """The node's conditions (type, status, reason, since when, message) above the resources, with a line naming
    those that are not True; the exit stays 0 (the agent answered: a status to read, not a check). Agent mode has no
    OwnersCurrent (the agent allocates, its owners are current by construction)."""
    agent = agent_factory()
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["g0", "Healthy", [0]], ["g1", "Unhealthy", [1]]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (2, 1))

    shown = status("--url", agent.url)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1] == "conditions: 1 of 2 NOT True: DevicesHealthy", shown.stdout
    rows = condition_rows(shown.stdout)
    assert set(rows) == {"PluginsConnected", "DevicesHealthy"}, shown.stdout
    conditions = {c["type"]: c for c in agent.get("/api/v1/devices")["conditions"]}
    for kind, (status_, reason, since, _ago, message) in rows.items():
        assert [status_, reason, since, message] == [
            conditions[kind][key] for key in ("status", "reason", "lastTransitionTime", "message")
        ], shown.stdout
    assert rows["DevicesHealthy"][:2] == ["False", "UnhealthyDevices"]
    assert rows["DevicesHealthy"][4] == f"{R}: 1 of 2 unhealthy"
    assert rows["PluginsConnected"][:2] == ["True", "AllConnected"]
    assert rows["DevicesHealthy"][3].endswith("s"), shown.stdout  # an age, by the agent's clock
    assert lines.index("") < next(i for i, line in enumerate(lines) if line.startswith("RESOURCE ")), shown.stdout

    plugin.devices([["g0", "Healthy", [0]], ["g1", "Healthy", [1]]])
    wait_for(lambda: agent.counts(R) == (2, 2))
    healed = status("--url", agent.url)
    assert healed.returncode == 0 and healed.stdout.splitlines()[1] == "conditions: all 2 True", healed.stdout
    assert condition_rows(healed.stdout)["DevicesHealthy"][:2] == ["True", "AllHealthy"]

    plugin.stop()
    wait_for(lambda: (agent.resource(R) or {}).get("plugin", {}).get("connected") is False)
    gone = status("--url", agent.url)
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout.splitlines()[1] == "conditions: 2 of 2 NOT True: PluginsConnected, DevicesHealthy", gone.stdout
    assert condition_rows(gone.stdout)["PluginsConnected"][::4] == ["False", f"not connected: {R}"], gone.stdout


def test_status_lists_128_devices_per_resource_unless_told(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    """Every device of a large node makes an unreadable table and holds the agent's loop while it is written: the
    status lists as many as NodeDevices (128) per resource unless `--max-devices` says otherwise (`all`: every
    one); the counts stay exact, and the table says the list is cut."""
    agent = agent_factory()
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [[f"g{i:03d}", "Healthy"] for i in range(130)])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (130, 130))

    def listed(*args: str) -> tuple[int, bool, int]:
        done = status("--url", agent.url, "-o", "json", *args)
        assert done.returncode == 0, done.stderr
        (resource,) = json.loads(done.stdout)["devices"]["resources"]
        return len(resource["devices"]), resource["devicesTruncated"], resource["capacity"]

    assert listed() == (128, True, 130)
    assert listed("--max-devices", "3") == (3, True, 130)
    assert listed("--max-devices", "all") == (130, False, 130)
    table = status("--url", agent.url, "--max-devices", "2")
    assert table.returncode == 0 and "(device list truncated)" in table.stdout, table.stdout
    assert "g000" in table.stdout and "g002" not in table.stdout
    refused = status("--url", agent.url, "--max-devices", "many")
    assert refused.returncode == 2 and "expected a number of devices or 'all', got 'many'" in refused.stderr
    # Past the API's nine digits: refused here, not sent (the agent would answer 400, once read as "cannot reach").
    too_many = status("--url", agent.url, "--max-devices", "1000000000")
    assert too_many.returncode == 2 and "at most 999999999 devices, or 'all', got 1000000000" in too_many.stderr
    assert listed("--max-devices", "999999999") == (130, False, 130)


def test_status_says_what_the_agent_answered(agent_factory: Callable[..., AgentProcess]) -> None:
    """An agent that answers with an error is reachable: the status says what it answered, with the error its body
    gives, not that it cannot reach it."""
    agent = agent_factory()
    url = agent.url + "/elsewhere"  # a URL whose paths the agent does not serve
    result = status("--url", url)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"deviceplane status: the agent at {url} refused: /api/v1/devices?limit=128 answered 404 Not Found: not found"
    ], result.stderr


def test_status_unreachable_agent_is_one_clear_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for output in ("table", "json", "yaml"):
        result = status("--url", url, "-o", output)
        assert result.returncode == 1
        assert result.stdout == ""
        assert result.stderr.splitlines() == [
            f"deviceplane status: cannot reach the agent at {url}: Connection refused"
        ], result.stderr
