"""Reading static pod files: one document, YAML or JSON, bounded, with clear errors."""

from __future__ import annotations

import pytest

from deviceplane.agent.pod_source import MAX_MANIFEST_BYTES, load_manifest
from deviceplane.core.pods import PodError


def test_yaml_and_json() -> None:
    assert load_manifest(b"kind: Pod\nmetadata: {name: a}\n", "a.yaml") == {"kind": "Pod", "metadata": {"name": "a"}}
    assert load_manifest(b'{"kind": "Pod"}', "a.json") == {"kind": "Pod"}


@pytest.mark.parametrize(
    ("raw", "name", "message"),
    [
        (b"kind: Pod\n---\nkind: Pod\n", "a.yaml", "expected exactly one Pod per file, found 2 documents"),
        (b"", "a.yaml", "found 0 documents"),
        (b"metadata: {name: x\n", "a.yaml", "invalid YAML"),
        (b"{nope", "a.json", "invalid JSON"),
        (b"\xff\xfe", "a.yaml", "not UTF-8 text"),
        (b" " * (MAX_MANIFEST_BYTES + 1), "a.yaml", "larger than"),
    ],
)
def test_bad_files(raw: bytes, name: str, message: str) -> None:
    with pytest.raises(PodError) as err:
        load_manifest(raw, name)
    assert message in str(err.value)


def test_alias_bomb_is_refused() -> None:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    previous = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
        previous = name
    with pytest.raises(PodError, match="expands to more than"):
        load_manifest("\n".join(lines).encode(), "bomb.yaml")
