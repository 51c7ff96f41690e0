"""Every manifest runs the image the build makes (found in review: the agent DaemonSets named `deviceplane:0.1.0`
while scripts/build-image.sh tags `localhost/deviceplane:<version>`, so the agent's pods could not find it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def built_image() -> str:
    """The tag scripts/build-image.sh gives when called without one."""
    script = (ROOT / "scripts" / "build-image.sh").read_text()
    default = re.search(r"^TAG=\$\{1:-(.+)\}$", script, re.MULTILINE)
    assert default is not None, "build-image.sh: no default TAG line"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return default.group(1).replace("$VERSION", version)


def images(node: object) -> list[str]:
    """Every `image:` value in a parsed YAML document, at any depth."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k == "image" and isinstance(v, str)]
        return found + [image for v in node.values() for image in images(v)]
    if isinstance(node, list):
        return [image for v in node for image in images(v)]
    return []


def test_every_deviceplane_image_is_the_one_the_build_tags() -> None:
    wanted = built_image()
    named = {
        f"{path.relative_to(ROOT)}: {image}"
        for path in sorted((ROOT / "manifests").rglob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        for image in images(document)
        if "deviceplane" in image
    }
    assert named, "no manifest names a deviceplane image"
    assert all(entry.endswith(f": {wanted}") for entry in named), sorted(named)
