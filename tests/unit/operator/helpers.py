"""Shared by the operator's unit tests: the examples under manifests/examples and a fixed owner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator.names import ConfigKey
from deviceplane.operator.render import Owner

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
OWNER_UID = "6f1c2d7e-0000-4000-8000-000000000001"


def load_example(path: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DevicePluginConfig"]
    assert len(docs) == 1, path
    return dict(docs[0])


def owner(name: str, namespace: str = "plugins") -> Owner:
    return Owner(ConfigKey(namespace, name), OWNER_UID)


def spec(**fields: Any) -> DevicePluginConfigSpec:
    return DevicePluginConfigSpec.model_validate({"resourceName": "example.com/x", "image": "img:1", **fields})
