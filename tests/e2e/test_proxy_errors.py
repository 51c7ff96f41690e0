"""A plugin's failure as the kubelet reads it, through the proxy and directly: the sim plugin (a grpc.aio server)
behind the agent with one kubelet harness, and registered with another directly, the same fault in both; the
harness's admission result carries the kubelet's own error text (docs/proxy.md, Errors)."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from .cluster import http_json
from .conftest import Harness
from .procs import Proc, wait_for
from .test_kubelet_harness import pod
from .test_proxy import SIM, counts, kubelet_side, start_proxy, start_sim


@dataclass
class Sides:
    harnesses: tuple[Harness, Harness]  # (direct, proxied)
    plugins: tuple[Proc, Proc]
    controls: tuple[str, str]  # the sim plugins' control URLs

    def fault(self, rpc: str, **fault: Any) -> None:
        for control in self.controls:
            http_json(f"{control}/faults/{rpc}", method="PUT", body=fault)

    def admit(self, name: str) -> list[dict[str, Any]]:
        """Admit a 1-device pod on both harnesses at once; their results, direct first."""
        results: list[dict[str, Any]] = [{}, {}]

        def admit(i: int) -> None:
            body = pod(name, app={SIM: 1})
            results[i] = dict(http_json(self.harnesses[i].url + "/admit", method="POST", body=body, timeout=60))

        threads = [threading.Thread(target=admit, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(70)
        return results


def both_sides(kubelet_harness, deviceplane_agent, procs, short_tmp) -> Sides:
    direct = kubelet_harness(short_tmp("kha"))
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    proxied = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    (p1, c1), (p2, c2) = start_sim(procs, direct.socket_dir), start_sim(procs, agent.plugin_dir)
    sides = Sides((direct, proxied), (p1, p2), (c1, c2))
    wait_for(
        "both up",
        lambda: counts(direct, SIM) == counts(proxied, SIM) == (4, 4),
        procs=[direct.proc, proxied.proc, agent.proc, p1, p2],
    )
    return sides


def test_a_prestart_that_hangs_reads_as_the_plugins_own_deadline_answer(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """The kubelet gives PreStartContainer 30 s. Directly, the plugin's own copy of that deadline answers (grpc.aio:
    "Deadline Exceeded"); through the proxy it read "context deadline exceeded" (the proxy's own timer won)."""
    sides = both_sides(kubelet_harness, deviceplane_agent, procs, short_tmp)
    sides.fault("PreStartContainer", mode="hang")
    direct, proxied = sides.admit("hangs")
    (direct_error,) = [c["error"] for c in direct["containers"]]
    (proxied_error,) = [c["error"] for c in proxied["containers"]]
    assert direct_error == "device plugin PreStartContainer rpc failed with err: rpc error: code = DeadlineExceeded " \
        "desc = Deadline Exceeded"  # fmt: skip
    assert proxied_error == direct_error


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_plugin_that_dies_mid_allocate_reads_unavailable_as_directly(
    kubelet_harness, deviceplane_agent, procs, short_tmp, sig: signal.Signals
) -> None:
    """Directly the kubelet's Allocate fails with UNAVAILABLE: the connection's end reaches it, or the kubelet's
    closing of its client when the plugin's ListAndWatch ends (grpc-go's transport close). Through the proxy a plugin
    that stops (grpc's graceful stop: its ListAndWatch ends before its connection) read `Canceled: grpc: the client
    connection is closing`: the agent closed the connection as the stream ended, and its client failed the call in
    flight with CANCELLED. Which text follows the code depends on which comes first, both ways (directly grpc-go's
    names the connection), so only the code is compared; killed, the connection just ends: the same words too."""
    sides = both_sides(kubelet_harness, deviceplane_agent, procs, short_tmp)
    sides.fault("Allocate", mode="hang")
    results: list[dict[str, Any]] = []
    admitting = threading.Thread(target=lambda: results.extend(sides.admit("dies")), daemon=True)
    admitting.start()
    time.sleep(1.5)  # both Allocate calls are at the plugins
    for plugin in sides.plugins:
        os.killpg(plugin.pgid, sig)
    admitting.join(30)
    direct, proxied = results
    assert not direct["admitted"] and not proxied["admitted"]
    assert "Allocate failed due to rpc error: code = Unavailable desc = " in direct["message"], direct
    assert "Allocate failed due to rpc error: code = Unavailable desc = " in proxied["message"], proxied
    if sig == signal.SIGKILL:  # the connection just ends: the same words too
        assert proxied["message"] == direct["message"]
