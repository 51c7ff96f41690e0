"""`pip install deviceplane` without extras serves a plugin author: in a fresh venv (no kopf, no kubernetes, no rich)
the base package imports `deviceplane.plugin`, runs the agent, and runs examples/slot_plugin.py against it.

The venv is cached under ~/.cache/deviceplane, keyed by the base dependency list, and the package itself is
reinstalled from this checkout on every run (built from a copy, so the checkout gets no build/ or egg-info)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.support.procs import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DEVICEPLANE_CACHE", Path.home() / ".cache" / "deviceplane"))
EXTRA_ONLY = ("kopf", "kubernetes", "rich")


def base_dependencies() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH pointing at the checkout: only what the venv has installed is importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | extra


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True, env=clean_env())


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = hashlib.sha256(json.dumps([sys.version, base_dependencies()]).encode()).hexdigest()[:16]
    venv = CACHE / f"venv-base-{key}"
    source = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "deviceplane", source / "deviceplane", ignore=shutil.ignore_patterns("__pycache__"))
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip(venv, str(source))  # the base package and exactly its declared dependencies
    else:
        pip(venv, "--no-deps", "--force-reinstall", str(source))
    return venv


def run_python(venv: Path, code: str, cwd: Path) -> str:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=cwd, env=clean_env()
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_base_install_has_no_extras_and_imports_the_sdk(venv: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.util, deviceplane, deviceplane.plugin, deviceplane.agent.app\n"
        "print(deviceplane.__file__)\n"
        f"print([m for m in {EXTRA_ONLY!r} if importlib.util.find_spec(m) is not None])"
    )
    where, missing = run_python(venv, code, tmp_path).splitlines()
    assert where.startswith(str(venv)), where  # the installed package, not the checkout
    assert missing == "[]"
    demo = subprocess.run(
        [str(venv / "bin" / "deviceplane"), "demo"], capture_output=True, text=True, cwd=tmp_path, env=clean_env()
    )
    assert demo.returncode != 0 and "pip install 'deviceplane[demo]'" in demo.stderr


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_slot_plugin_example_runs_against_the_base_agent(venv: Path, short_tmp: Path) -> None:
    plugin_dir, state = short_tmp / "dp", short_tmp / "state"
    state.mkdir()
    port = free_port()
    agent = subprocess.Popen(
        [str(venv / "bin" / "deviceplane"), "agent", "--plugin-dir", str(plugin_dir),
         "--pod-resources-socket", str(short_tmp / "pr" / "kubelet.sock"), "--http-addr", f"127.0.0.1:{port}",
         "--standalone", "--log-format", "text"],
        cwd=short_tmp, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    example = None
    try:
        wait_for(lambda: (plugin_dir / "kubelet.sock").exists(), timeout=20, what="agent serving")
        example = subprocess.Popen(
            [str(venv / "bin" / "python"), str(ROOT / "examples" / "slot_plugin.py")],
            cwd=short_tmp,
            env=clean_env(DEVICEPLANE_PLUGIN_DIR=str(plugin_dir), SLOT_STATE_DIR=str(state)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def slots() -> list[object] | None:
            status = get_json(f"http://127.0.0.1:{port}/api/v1/devices?resource=example.com/slot")
            assert isinstance(status, dict)
            resources = status["resources"]
            return resources[0]["devices"] if resources and resources[0]["healthy"] == 4 else None

        devices = wait_for(slots, timeout=20, what="example.com/slot registered with 4 healthy slots")
        assert [d["numaNodes"] for d in devices] == [[0], [0], [1], [1]]  # type: ignore[index]
        example.send_signal(signal.SIGTERM)
        assert example.wait(10) == 0
    finally:
        for proc in (example, agent):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
