"""What the docs cite of the repository is there: files and directories (`tests/e2e/test_proxy.py`,
`agent/heap.py`, `manifests/extras/monitoring/`), tests by name (`test_x.py::test_y`, or a bare `test_y`), and
`module.function` citations (`core/ordering.cached_natural_key`). A file moved or a test renamed without its doc
fails here."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = (
    "README.md",
    "docs/agent.md",
    "docs/operator.md",
    "docs/proxy.md",
    "docs/architecture.md",
    "benchmarks/README.md",
    "tests/k8s/README.md",
)
TOP = r"(?:deviceplane|tests|benchmarks|scripts|manifests|crds|docs|examples|proto)"
# Paths the docs write relative to deviceplane/ or deviceplane/agent/ (`core/view.py`, `kube/client.py`).
PACKAGE = r"(?:agent|core|kube|serving|proxy|plugins|state|admission|operator|plugin|lean_grpc|cli)"
CITED = re.compile(rf"(?<![\w./-])((?:{TOP}|{PACKAGE})/[\w./*{{}},-]*)")
NOT_PATHS = {"core/v1"}  # the Kubernetes API group


def candidates(doc: str, path: str) -> list[str]:
    in_package = [] if re.match(rf"{TOP}/", path) else [f"deviceplane/{path}", f"deviceplane/agent/{path}"]
    return [path, *in_package, str(Path(doc).parent / path)]


def expand(path: str) -> list[str]:
    """`results/compare.{md,png}` -> both; other paths as they are."""
    head, brace, rest = path.partition("{")
    if not brace:
        return [path]
    return [head + alternative for alternative in rest.rstrip("}").split(",")]


def exists(doc: str, path: str) -> bool:
    module, dot, name = path.rpartition(".")
    if dot and not name.isalnum() and "/" in module:  # `core/ordering.cached_natural_key`
        return any(name in defined(REPO / f"{c}.py") for c in candidates(doc, module) if (REPO / f"{c}.py").is_file())
    return any(any(REPO.glob(c)) if "*" in c else (REPO / c).exists() for c in candidates(doc, path))


@cache
def functions(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


@cache
def defined(path: Path) -> frozenset[str]:
    """Functions anywhere in a module, and its module-level names (`cached_natural_key = lru_cache(...)(...)`)."""
    tree = ast.parse(path.read_text())
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return functions(path) | assigned


@cache
def all_test_functions() -> frozenset[str]:
    return frozenset().union(*(functions(path) for path in (REPO / "tests").rglob("*.py")))


@pytest.mark.parametrize("doc", DOCS)
def test_cited_paths_exist(doc: str) -> None:
    text = (REPO / doc).read_text()
    cited = {m.group(1).rstrip(".,)") for m in CITED.finditer(text)} - NOT_PATHS
    missing = sorted(p for c in cited for p in expand(c) if not exists(doc, p))
    assert missing == [], f"{doc} cites what the repository does not have"


@pytest.mark.parametrize("doc", DOCS)
def test_cited_tests_exist(doc: str) -> None:
    text = (REPO / doc).read_text()
    missing = []
    in_file = re.findall(r"([\w/]+\.py)::(\w+)", text)
    for file_name, test in in_file:
        files = [p for p in (REPO / "tests").rglob(Path(file_name).name) if p.as_posix().endswith(file_name)]
        if not any(test in functions(p) for p in files):
            missing.append(f"{file_name}::{test}")
    for test in set(re.findall(r"(?<![\w/])(test_\w+)(?![\w.])", text)) - {test for _file, test in in_file}:
        if test not in all_test_functions() and not any((REPO / "tests").rglob(f"{test}.py")):
            missing.append(test)
    assert missing == [], f"{doc} names tests that do not exist"


# docs/architecture.md names the agent's objects as the code does: every CamelCase name in it is a class, function or
# module-level name of deviceplane/, and every `Class.member` a member of that class. These are not code.
NOT_CODE = {"BufferedProtocol", "NodeDevices", "PodResources", "PreStart"}


@cache
def code_names() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """(every class, function and module-level name in deviceplane/, {class: its methods and attributes})."""
    names: set[str] = set()
    members: dict[str, frozenset[str]] = {}
    for path in (REPO / "deviceplane").rglob("*.py"):
        names |= defined(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                found = {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                found |= {
                    n.target.id
                    for n in ast.walk(node)
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
                found |= {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                }
                members[node.name] = members.get(node.name, frozenset()) | found
    return frozenset(names), members


def test_architecture_names_the_codes_objects() -> None:
    text = (REPO / "docs/architecture.md").read_text()
    names, members = code_names()
    unknown = sorted(set(re.findall(r"\b[A-Z][a-z0-9]+[A-Z]\w*\b", text)) - names - NOT_CODE)
    assert unknown == [], "docs/architecture.md names what deviceplane/ does not define"
    cited = set(re.findall(r"\b([A-Z][A-Za-z0-9]+)\.([a-z_]\w*)\b", text))
    assert sorted(f"{c}.{m}" for c, m in cited if c in members and m not in members[c]) == []
