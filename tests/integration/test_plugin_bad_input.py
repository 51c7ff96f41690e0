"""Bad input to the reference plugins: a clear one-line error and exit status 2, or correct handling."""

from __future__ import annotations

import socket

import pytest

from tests.support.plugins import FakeKubelet, PluginProcess, run_plugin_cli, wait_until


def assert_usage_error(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_files_missing_dir(short_tmp):
    result = run_plugin_cli("files", "--plugin-dir", str(short_tmp / "dp"), "--dir", str(short_tmp / "nope"))
    assert_usage_error(result, f"deviceplane plugin files: error: --dir {short_tmp / 'nope'}: no such directory")
    assert not (short_tmp / "dp").exists()  # refused before touching anything


def test_files_dir_is_a_file(short_tmp):
    (short_tmp / "f").write_text("")
    result = run_plugin_cli("files", "--plugin-dir", str(short_tmp / "dp"), "--dir", str(short_tmp / "f"))
    assert_usage_error(result, "not a directory")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mount-dir", "relative"], "--mount-dir 'relative': must be an absolute path in the container"),
        (["--mount-dir", ""], "--mount-dir '': must be an absolute path in the container"),
        (["--env", ""], "--env '': not an environment variable name"),
        (["--env", "A=B"], "--env 'A=B': not an environment variable name"),
        (["--env", "1ST"], "--env '1ST': not an environment variable name"),
    ],
)
def test_files_bad_allocation_settings(short_tmp, args, message):
    """Each was accepted, to give containers mounts at a relative path or an env var that cannot exist."""
    result = run_plugin_cli("files", "--plugin-dir", str(short_tmp / "dp"), "--dir", str(short_tmp), *args)
    assert_usage_error(result, f"deviceplane plugin files: error: {message}")


def test_files_requires_dir(short_tmp):
    assert_usage_error(run_plugin_cli("files", "--plugin-dir", str(short_tmp)), "--dir")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--count", "-1"], "argument --count: must be >= 0, got -1"),
        (["--count", "many"], "argument --count: not an integer: 'many'"),
        (["--count", "233017"], "argument --count: must be <= 233016 (a 4 MiB ListAndWatch message)"),
        # The SDK's own check, with every device unhealthy (the longest form): 150,000 would fit only when healthy.
        (["--count", "150000", "--numa", "1"], "--count 150000 --numa 1: 150000 devices make a 4238890-byte"),
        (["--numa", "-2"], "argument --numa: must be >= 0"),
        (["--flap-rate", "-1"], "argument --flap-rate: must be a finite number >= 0"),
        (["--flap-rate", "nan"], "argument --flap-rate: must be a finite number >= 0"),
        (["--flap-rate", "1e9"], "argument --flap-rate: must be <= 1000 flips per second, got 1e9"),
        (["--control", "nowhere"], "argument --control: expected HOST:PORT"),
        (["--control", "127.0.0.1:99999"], "argument --control: expected HOST:PORT"),
    ],
)
def test_sim_bad_numbers(short_tmp, args, message):
    assert_usage_error(run_plugin_cli("sim", "--plugin-dir", str(short_tmp), *args), message)


@pytest.mark.parametrize(
    "resource",
    [
        "gpu",  # no domain
        "kubernetes.io/gpu",  # reserved
        "requests.example.com/gpu",  # quota prefix
        "example.com/a/b",
        "Example.com/gpu",  # DNS prefix is lowercase
        "example.com/" + "x" * 64,
        "example.com/-gpu",
        "",
    ],
)
@pytest.mark.parametrize("kind", ["sim", "files"])
def test_invalid_resource_names(short_tmp, kind, resource):
    extra = ["--dir", str(short_tmp)] if kind == "files" else []
    result = run_plugin_cli(kind, "--plugin-dir", str(short_tmp / "dp"), *extra, "--resource", resource)
    assert_usage_error(result, f"error: invalid resource name {resource!r}")
    assert not (short_tmp / "dp").exists()


def test_plugin_dir_is_a_file(short_tmp):
    (short_tmp / "file").write_text("")
    assert_usage_error(
        run_plugin_cli("sim", "--plugin-dir", str(short_tmp / "file")), f"{short_tmp / 'file'} is not a directory"
    )


def test_socket_path_too_long(short_tmp):
    deep = short_tmp / ("d" * 100)
    assert_usage_error(run_plugin_cli("sim", "--plugin-dir", str(deep)), "is longer than 107 bytes")


def test_control_address_in_use(short_tmp):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_plugin_cli("sim", "--plugin-dir", str(short_tmp / "dp"), "--control", f"127.0.0.1:{port}")
    assert_usage_error(result, f"cannot serve the control endpoint on 127.0.0.1:{port}")
    assert not (short_tmp / "dp").exists() or list((short_tmp / "dp").iterdir()) == []  # nothing left behind


def test_missing_plugin_name():
    result = run_plugin_cli()
    assert result.returncode == 2 and "PLUGIN" in result.stderr and "Traceback" not in result.stderr


async def test_sim_count_zero_registers_no_devices(short_tmp):
    kubelet = await FakeKubelet(short_tmp / "dp").start()
    proc = PluginProcess(short_tmp, "sim", "--plugin-dir", str(short_tmp / "dp"), "--count", "0", "--numa", "2",
                         "--control", "127.0.0.1:0")  # fmt: skip
    try:
        connection = await wait_until(lambda: kubelet.latest("example.com/sim"), within=15, what="registration")
        await wait_until(lambda: connection.snapshots, what="first snapshot")
        assert connection.snapshots == [{}]
        assert proc.control("GET", "/devices")["devices"] == []
        assert proc.stop() == 0
    finally:
        proc.kill()
        await kubelet.stop()
