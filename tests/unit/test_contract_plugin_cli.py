"""`deviceplane plugin files|sim` read the SDK's environment the same way for both directories: `--plugin-dir`
defaults to `$DEVICEPLANE_PLUGIN_DIR` (else /var/lib/kubelet/device-plugins), `--registry-dir` to
`$DEVICEPLANE_REGISTRY_DIR`, and a flag given wins over either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deviceplane.cli import main
from deviceplane.plugin.plugin import DevicePlugin


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[DevicePlugin]:
    plugins: list[DevicePlugin] = []

    async def serve(self: DevicePlugin, **_kwargs: Any) -> None:
        plugins.append(self)

    monkeypatch.setattr(DevicePlugin, "serve", serve)
    monkeypatch.delenv("DEVICEPLANE_PLUGIN_DIR", raising=False)
    monkeypatch.delenv("DEVICEPLANE_REGISTRY_DIR", raising=False)
    return plugins


@pytest.mark.parametrize("plugin", ["sim", "files"])
def test_plugin_dir_comes_from_the_environment_as_in_the_sdk(
    plugin: str, served: list[DevicePlugin], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DEVICEPLANE_PLUGIN_DIR", str(tmp_path / "dp"))
    extra = ["--dir", str(tmp_path)] if plugin == "files" else []
    assert main(["plugin", plugin, *extra]) == 0
    (sdk,) = served
    assert sdk.plugin_dir == tmp_path / "dp"
    assert sdk.registry_dir is None


def test_flags_win_over_the_environment(
    served: list[DevicePlugin], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DEVICEPLANE_PLUGIN_DIR", str(tmp_path / "env"))
    assert main(["plugin", "sim", "--plugin-dir", str(tmp_path / "flag")]) == 0
    assert served[0].plugin_dir == tmp_path / "flag"


def test_without_environment_the_kubelets_dir(served: list[DevicePlugin]) -> None:
    assert main(["plugin", "sim"]) == 0
    assert served[0].plugin_dir == Path("/var/lib/kubelet/device-plugins")
