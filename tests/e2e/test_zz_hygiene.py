"""Nothing we start listens beyond 127.0.0.1, and stopping a process group leaves nothing behind.

(Named zz so it runs last in the directory, when the package's cluster has been up longest. The check that no
process is left, once the e2e package is done, lives in the `procs` fixture's teardown, in conftest.py.)
"""

from __future__ import annotations

import subprocess
import time

from .procs import Procs, is_loopback, listening_tcp, processes_in_groups, wait_for


def test_every_listener_is_loopback(
    cluster, procs: Procs, kubelet_harness, sample_device_plugin, generic_device_plugin, deviceplane_agent, short_tmp
) -> None:
    # Bring up one of everything we run, next to the session's control plane.
    h = kubelet_harness(short_tmp("kh"))
    sample_device_plugin(h.socket_dir)
    generic_device_plugin(h.socket_dir)
    deviceplane_agent()
    wait_for(
        "the sample plugin to register with the harness", lambda: "example.com/resource" in h.capacity()["capacity"]
    )
    time.sleep(1)  # let late listeners (scheduler, kwok) settle

    listeners = listening_tcp(procs.pids())
    by_name = {p.pid: p.name for p in procs.procs}
    described = [(by_name.get(pid, pid), addr) for pid, addr in listeners]
    assert listeners, "found no listening socket at all: the check itself is broken"
    # The apiserver's port is among them, bound to loopback.
    assert any(addr.endswith(f"127.0.0.1:{cluster.apiserver_port}") for _, addr in listeners), described
    offending = [(n, a) for n, a in described if not is_loopback(a)]
    assert not offending, f"listening beyond 127.0.0.1: {offending}"

    # Cross-check with ss: no listener of ours on a wildcard or external address.
    ss = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True, check=False)
    if ss.returncode == 0:
        ours = {str(pid) for pid in procs.pids()}
        for line in ss.stdout.splitlines():
            if any(f"pid={pid}," in line for pid in ours):
                local = line.split()[4]
                host = local.rsplit(":", 1)[0].strip("[]")
                assert host.startswith("127.") or host == "::1", line


def test_stopping_a_process_group_kills_its_children(procs: Procs) -> None:
    # A leader that forks children (as `unshare ... sh -c` and plugins do): stop() must take the whole group.
    p = procs.start("forker", ["sh", "-c", "sleep 300 & sleep 300 & wait"])
    wait_for("the children to start", lambda: len(processes_in_groups({p.pgid})) >= 3, timeout=10)
    procs.stop(p)
    assert processes_in_groups({p.pgid}) == []
    assert not p.alive()
