"""Layer rules of docs/architecture.md, checked on the source (every import, at module top or
inside a function):

- ``schemas`` imports nothing of the project but itself;
- ``rft_core`` never imports prefect, ``tasks`` or ``flows``;
- ``tasks`` and ``flows`` import from ``rft_core`` only its public surface, ``rft_core.api``
  and ``rft_core.config``; ``tasks`` never imports ``flows``;
- no import cycle between the project's modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "rft_core", "schemas")
RFT_CORE_PUBLIC = ("rft_core.api", "rft_core.config")
# package -> (modules it may never import, first-party modules it may import; None: any)
RULES: dict[str, tuple[set[str], tuple[str, ...] | None]] = {
    "schemas": ({"prefect"}, ("schemas",)),
    "rft_core": ({"prefect"}, ("rft_core", "schemas")),
    "tasks": (set(), ("tasks", "schemas", *RFT_CORE_PUBLIC)),
    "flows": (set(), ("flows", "tasks", "schemas", *RFT_CORE_PUBLIC)),
}


def _imported_modules(path: Path) -> set[str]:
    """Absolute module names imported by ``path`` (``from a import b`` gives ``a.b``: b may be a
    submodule; resolved against the project below)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _project_modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to (the longest project-module prefix), or None."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _violations(package: str, mods: dict[str, Path]) -> dict[str, list[str]]:
    never, allowed = RULES[package]
    bad: dict[str, list[str]] = {}
    for name, path in mods.items():
        if name.split(".")[0] != package:
            continue
        for imp in _imported_modules(path):
            top = imp.split(".")[0]
            target = _resolve(imp, mods)
            if top in never:
                bad.setdefault(name, []).append(imp)
            elif target is not None and allowed is not None and not any(
                    target == a or target.startswith(a + ".") for a in allowed):
                bad.setdefault(name, []).append(target)
    return {k: sorted(set(v)) for k, v in bad.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_layer_imports(package):
    mods = _project_modules()
    assert any(n.split(".")[0] == package for n in mods), f"no python files under {package}"
    bad = _violations(package, mods)
    assert not bad, f"layer rule of {package} broken (see tests/test_layers.py): {bad}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {_resolve(imp, mods) for imp in _imported_modules(path)}
        edges[name] = {t for t in targets if t is not None and t != name}
    return edges


def test_no_import_cycles():
    mods = _project_modules()
    assert not _cycles(_edges(mods)), "import cycles between project modules"


def test_checkers_see_violations(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from prefect import flow\nimport tasks.stages\nfrom rft_core.stages import runner\n")
    assert _imported_modules(f) == {"prefect", "prefect.flow", "tasks.stages", "rft_core.stages", "rft_core.stages.runner"}
    mods = {"flows.a": f, "rft_core.stages.runner": f, "rft_core.stages": f, "tasks.stages": f}
    assert _violations("flows", mods) == {"flows.a": ["rft_core.stages", "rft_core.stages.runner"]}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_orchestration_functions_are_short():
    """Flows and tasks stay readable on one screen: no function longer than 60 lines."""
    long = []
    for package in ("flows", "tasks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
