"""Objects use each other's methods, never each other's private state (issue 8): a check over the AST of every module
of the agent, of core and of the package's top level. It fails on
- reading or writing another object's underscore attribute (`other._x`; `self._x` and `cls._x` are the object's own),
- reaching into the containers the agent's objects keep (`table.records`, `registry.resources`, `allocator.pod_devices`,
  `manager.observers`, ...), even if someone makes them public again,
- assigning an attribute of another object (`manager.pod_entries = ...`): dependencies go through constructors.
A module may update the records it defines itself (fields of its own classes); calls are methods, always fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = [ROOT / "deviceplane" / "agent", ROOT / "deviceplane" / "core"]
# Containers and collaborators objects hold; other objects ask through methods instead.
CONTAINER_ATTRIBUTES = frozenset(
    {"records", "by_key", "by_name", "errors_by_key", "resources", "pod_devices", "registry", "manager", "observers",
     "listeners", "pod_entries", "endpoints", "clients", "tasks", "journal", "store", "allocator"}
)  # fmt: skip
# `self`/`cls` is the object itself; `parts` is the bundle of collaborators a constructor is given (AdmissionParts).
OWN = frozenset({"self", "cls", "parts"})
# A library's settings object configured where it is made, through the attributes that are its only API (the
# kubernetes client's Configuration: v30, which pyproject allows, takes none of them in its constructor).
LIBRARY_SETTINGS = frozenset({"configuration.retries"})


def _owner(node: ast.Attribute) -> str | None:
    return node.value.id if isinstance(node.value, ast.Name) else None


def _own_record_fields(tree: ast.Module) -> set[str]:
    """Fields of the classes this module defines: a module may build and update its own record types (the
    registry its ResourceState, the checkpoint parser its parse state)."""
    fields: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _owner(node) == "self":
                fields.add(node.attr)
    return fields


def violations(source: str, filename: str = "<test>") -> list[str]:
    tree = ast.parse(source, filename)
    own_fields = _own_record_fields(tree)
    methods = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or _owner(node) in OWN:
            continue
        where = f"{filename}:{node.lineno}: {ast.unparse(node)}"
        if node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{where}: another object's private attribute")
        elif node.attr in own_fields or id(node) in methods:
            continue  # this module's own record type, or a method call
        elif isinstance(node.ctx, ast.Store | ast.Del) and ast.unparse(node) not in LIBRARY_SETTINGS:
            found.append(f"{where}: sets another object's attribute")
        elif node.attr in CONTAINER_ATTRIBUTES:
            found.append(f"{where}: another object's container")
    return found


def test_the_check_catches_each_kind() -> None:
    assert len(violations("controller.records[uid]")) == 1
    assert len(violations("x = manager.registry.resources.get(name)")) == 2
    assert len(violations("allocator._reserved")) == 1
    assert len(violations("manager.pod_entries = store.entries")) == 1
    assert len(violations("manager.observers.append(listener)")) == 1
    assert len(violations("record.state = 'failed'")) == 1
    assert violations("self._x = 1\nself.records = {}\ncls._y\nobj.method()\nrecord.pod.uid\ntable.records()") == []
    own = "class R:\n    state: str\ndef f(r: R) -> None:\n    r.state = 'x'\n"
    assert violations(own) == []  # the module's own record type


# The package's own top-level modules too (the loop watchdog and the fault hooks that agent and operator share).
SHARED = sorted((ROOT / "deviceplane").glob("*.py"))


@pytest.mark.parametrize(
    "path", sorted(p for d in CHECKED for p in d.rglob("*.py")) + SHARED, ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_module_reaches_into_another_object(path: Path) -> None:
    assert violations(path.read_text(), str(path.relative_to(ROOT))) == []
