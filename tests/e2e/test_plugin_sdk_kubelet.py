"""The plugin SDK against the kubelet's own device manager (tests/k8s/kubelet-harness, v1.36), wherever what the
kubelet does is the point."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tests.support.procs import free_port

from .cluster import REPO, http_json
from .procs import Proc, Procs, wait_for
from .test_kubelet_harness import pod


def counts(h, resource: str) -> tuple[int | None, int | None]:
    cap = h.capacity()
    return cap["capacity"].get(resource), cap["allocatable"].get(resource)


def start_script(procs: Procs, name: str, source: str, plugin_dir: Path, workdir: Path) -> Proc:
    """A plugin written the way users write them, as a process of its own."""
    script = workdir / f"{name}.py"
    script.write_text(textwrap.dedent(source))
    env = {"DEVICEPLANE_PLUGIN_DIR": str(plugin_dir), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return procs.start(name, [sys.executable, str(script)], env=env, cwd=REPO)


def start_plugin(procs: Procs, name: str, *args: str) -> Proc:
    return procs.start(name, [sys.executable, "-m", "deviceplane", "plugin", *args], cwd=REPO)


def log_of(proc: Proc) -> str:
    return proc.log.read_text(errors="replace")


HOOKS_PLUGIN = """
import asyncio, logging, sys
from deviceplane.plugin import Allocation, Device, DevicePlugin

logging.basicConfig(level=logging.INFO, stream=sys.stderr)

def sys_exit(ids):  # plain hooks run in a thread of their own
    sys.exit(3)

def interrupt(ids):
    raise KeyboardInterrupt

async def async_exit(ids):  # async hooks run on the loop
    raise SystemExit(4)

async def cancelled(ids):
    helper = asyncio.create_task(asyncio.sleep(10))
    helper.cancel()  # someone cancelled a task the hook waits for: CancelledError, yet the call was not cancelled
    await helper

async def hang(ids):
    try:
        await asyncio.Event().wait()
    finally:
        print("hang: cancelled with its call", flush=True)

def ok(ids):
    return Allocation(envs={"OK": ",".join(ids)})

HOOKS = {"sys-exit": sys_exit, "interrupt": interrupt, "async-exit": async_exit, "cancelled": cancelled,
         "hang": hang, "ok": ok}

async def main():
    plugins = [DevicePlugin(f"example.com/{n}", [Device(f"{n}-0")], allocate=h) for n, h in HOOKS.items()]
    await asyncio.gather(*(p.serve() for p in plugins))

asyncio.run(main())
"""


def test_a_hook_that_raises_anything_fails_only_that_admission(kubelet_harness, procs, short_tmp) -> None:
    """SystemExit and KeyboardInterrupt from a hook killed the plugin (SIGSEGV, stale socket); a CancelledError from
    a hook whose call nobody cancelled left the Allocate unanswered, and the kubelet waits for it for good. Each
    must fail that admission, with the hook's name and the exception, and nothing else."""
    h = kubelet_harness(short_tmp("kh"))
    plugin = start_script(procs, "hooks-plugin", HOOKS_PLUGIN, h.socket_dir, short_tmp("hooks"))
    names = ["sys-exit", "interrupt", "async-exit", "cancelled", "hang", "ok"]
    wait_for(
        "every hook's resource in the kubelet",
        lambda: all(counts(h, f"example.com/{n}") == (1, 1) for n in names),
        procs=[h.proc, plugin],
    )
    expected = {
        "cancelled": "allocate: CancelledError (the call itself was not cancelled)",
        "sys-exit": "allocate: SystemExit: 3",
        "interrupt": "allocate: KeyboardInterrupt",
        "async-exit": "allocate: SystemExit: 4",
    }
    for name, message in expected.items():
        # http_json's 10 s timeout: the kubelet's own Allocate call has none.
        res = h.admit(pod(name, app={f"example.com/{name}": 1}))
        assert not res["admitted"], res
        assert message in res["message"], res
        plugin.check_alive()

    res = h.admit(pod("fine", app={"example.com/ok": 1}))
    assert res["admitted"], res
    assert res["containers"][0]["runOptions"]["envs"] == [{"name": "OK", "value": "ok-0"}]
    assert all(counts(h, f"example.com/{n}")[0] == 1 for n in names)  # every plugin still registered
    log = log_of(plugin)
    assert log.count("Traceback") >= len(expected), log
    for hook in ("sys_exit", "interrupt", "async_exit", "cancelled"):
        assert f", in {hook}\n" in log, f"no traceback through {hook}: {log}"

    # A call that is cancelled (here by its deadline; the kubelet's Allocate has none) still cancels the hook, and is
    # not reported as the hook's failure.
    reported = "allocate hook raised CancelledError"
    assert log.count(reported) == 1, log  # the "cancelled" hook's
    (socket,) = h.socket_dir.glob("example.com_hang-*.sock")
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["hang-0"])])
        try:
            pb_grpc.DevicePluginStub(channel).Allocate(request, timeout=0.5)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        else:
            raise AssertionError("the hanging hook answered")
    wait_for("the hook cancelled", lambda: "hang: cancelled with its call" in log_of(plugin), timeout=5)
    assert log_of(plugin).count(reported) == 1, log_of(plugin)
    plugin.check_alive()


def test_surge_rollout_the_new_instance_registers_again(kubelet_harness, procs, short_tmp) -> None:
    """Two instances of one resource (a DaemonSet surge rollout): when the old one stops, the v1.36 kubelet also ends
    the new one's stream (kubernetes#121994) and leaves the resource at allocatable 0 - for good, unless the plugin
    notices its stream ended and registers again."""
    h = kubelet_harness(short_tmp("kh"))
    resource = "example.com/dup"
    sim = ["sim", "--plugin-dir", str(h.socket_dir), "--resource", resource, "--count", "2", "--numa", "0"]
    old = start_plugin(procs, "sim-old", *sim)
    wait_for("the old instance's devices", lambda: counts(h, resource) == (2, 2), procs=[h.proc, old])
    port = free_port()
    new = start_plugin(procs, "sim-new", *sim, "--control", f"127.0.0.1:{port}")

    def registrations() -> int:
        return int(http_json(f"http://127.0.0.1:{port}/devices")["registrations"])

    wait_for("the new instance registered", lambda: registrations() == 1, procs=[h.proc, new])
    wait_for("the new instance's devices", lambda: counts(h, resource) == (2, 2), procs=[h.proc, new])

    procs.stop(old)
    stopped = time.monotonic()
    wait_for("the new instance registered again", lambda: registrations() == 2, timeout=10, procs=[h.proc, new])
    wait_for("allocatable 2 again", lambda: counts(h, resource) == (2, 2), timeout=10, procs=[h.proc, new])
    assert time.monotonic() - stopped < 10
    assert "ListAndWatch ended unexpectedly" in log_of(h.proc)  # the kubelet did end the new instance's stream
    assert "registering again" in log_of(new)
    res = h.admit(pod("after-surge", app={resource: 2}))
    assert res["admitted"], res


def test_files_plugin_keeps_the_last_list_that_fits_in_a_message(kubelet_harness, procs, short_tmp) -> None:
    """20,000 files with 236-character names make a 5 MB ListAndWatch message: the kubelet dropped the stream (its
    gRPC client takes 4 MiB) and kept 20,002 devices, all unhealthy, while the plugin logged nothing. The plugin must
    not send it, say so, and keep the devices that fit."""
    h = kubelet_harness(short_tmp("kh"))
    cola = short_tmp("cola")
    for name in ("dev-a", "dev-b"):
        (cola / name).touch()
    files = start_plugin(procs, "files", "files", "--plugin-dir", str(h.socket_dir), "--dir", str(cola))
    resource = "example.com/cola"
    wait_for("2 devices", lambda: counts(h, resource) == (2, 2), procs=[h.proc, files])

    for i in range(20_000):
        (cola / (f"{i:06d}-" + "x" * 229)).touch()
    wait_for("the plugin's error", lambda: "over the kubelet's limit of 4194304 bytes" in log_of(files), timeout=60)
    # The directory is re-listed while the files are being created: the last list that fit may hold some of them.
    (kept,) = re.findall(r"ERROR .* still offering the (\d+) devices of the last list that fit", log_of(files))
    time.sleep(1)  # had it been sent, the kubelet would have dropped the stream by now
    assert counts(h, resource) == (int(kept), int(kept))
    assert "ResourceExhausted" not in log_of(h.proc)

    for path in cola.glob("0*"):
        path.unlink()
    (cola / "dev-c").touch()
    wait_for("the directory's devices again", lambda: counts(h, resource) == (3, 3), timeout=60, procs=[files])
    assert "the device list fits in a message again" in log_of(files)  # at some count, while the files go


def test_sim_preferred_allocation_reuses_the_init_containers_numa_node(kubelet_harness, procs, short_tmp) -> None:
    """The kubelet asks GetPreferredAllocation for an app container with its init container's device in
    must_include: the sim answered sim-0 + sim-4, two NUMA nodes while sim-1..3 on sim-0's node were free. And it
    picked the node with the most free devices, splitting the one that a later 4-device pod needed whole."""
    h = kubelet_harness(short_tmp("kh"), numa_nodes=2)  # topology policy none, the kubelet's default
    port = free_port()
    sim = start_plugin(procs, "sim", "sim", "--plugin-dir", str(h.socket_dir), "--count", "8", "--numa", "2",
                       "--control", f"127.0.0.1:{port}")  # fmt: skip
    resource = "example.com/sim"
    wait_for("8 devices", lambda: counts(h, resource) == (8, 8), procs=[h.proc, sim])
    numa = {d["id"]: d["numaNodes"][0] for d in h.capacity()["devices"][resource]}

    def admit(name: str, init: int, app: int) -> dict[str, list[str]]:
        res = h.admit(pod(name, init={resource: init} if init else None, app={resource: app}))
        assert res["admitted"], res
        return {c["name"]: c["devices"][resource] for c in res["containers"]}

    first = admit("first", 1, 2)
    assert set(first["init"]) <= set(first["app"])
    assert len({numa[i] for i in first["app"]}) == 1, first  # where the init container's device is
    calls = http_json(f"http://127.0.0.1:{port}/calls")["GetPreferredAllocation"]
    assert [c["must_include_deviceIDs"] for c in calls] == [[], first["init"]]

    second = admit("second", 0, 2)  # best fit: the 2 left on the first pod's node, not 2 of the other's 4
    assert {numa[i] for i in second["app"]} == {numa[first["app"][0]]}, (first, second)
    third = admit("third", 0, 4)
    assert len({numa[i] for i in third["app"]}) == 1, third


# The longest valid resource name: "requests." + name must be a qualified name, so the DNS prefix takes 244
# characters at most (253 - len("requests.")), and the name part 63.
LONGEST_RESOURCE = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 52]) + "/" + "x" * 63


def dir_of_length(n: int) -> Callable[[], Path]:
    def make() -> Path:
        prefix = "dp-long-"
        base = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        path = Path(base + "x" * (n - len(base)))
        os.rename(base, path)
        return path

    return make


def test_the_longest_resource_name_is_served_in_a_directory_as_long_as_the_kubelets(kubelet_harness, procs) -> None:
    """/var/lib/kubelet/device-plugins/ is 32 bytes with its slash, which leaves a socket name 75 bytes: a name of
    `<resource>-<pid>-<token>.sock` did not fit for resources over ~53 characters, and the plugin refused to start."""
    assert len(LONGEST_RESOURCE) == 308
    directory = dir_of_length(31)()
    started: list[Proc] = []  # stopped at the end: the package's Procs also runs the shared control plane
    try:
        assert len(str(directory) + "/") == len("/var/lib/kubelet/device-plugins/") == 32
        h = kubelet_harness(directory)
        started.append(h.proc)
        sim = start_plugin(procs, "sim-long", "sim", "--plugin-dir", str(directory), "--resource", LONGEST_RESOURCE,
                           "--count", "2", "--numa", "0")  # fmt: skip
        started.append(sim)
        wait_for("the long-named resource", lambda: counts(h, LONGEST_RESOURCE) == (2, 2), procs=[h.proc, sim])
        (socket,) = [p for p in directory.iterdir() if p.name != "kubelet.sock" and p.is_socket()]
        assert len(os.fsencode(socket)) <= 107 and socket.name.startswith("a" * 40)
        res = h.admit(pod("long", app={LONGEST_RESOURCE: 2}))
        assert res["admitted"], res
    finally:
        for p in reversed(started):  # the plugin, then the harness (its directory is removed next)
            procs.stop(p)
        shutil.rmtree(directory, ignore_errors=True)
