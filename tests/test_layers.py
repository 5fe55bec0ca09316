"""Layer rules of docs/architecture.md, checked on the source (every import, at module top or
inside a function):

- ``schemas`` imports nothing of the project but itself;
- ``rft_core`` never imports prefect, ``tasks`` or ``flows``;
- ``tasks`` and ``flows`` import from ``rft_core`` only its public surface, ``rft_core.api``
  and ``rft_core.config``; ``tasks`` never imports ``flows``;
- inside ``rft_core``, a package imports only its own floor and the floors below it
  (``RFT_CORE_FLOORS``: the workers above the stages, the weight sync below the engines), except
  the upward imports listed in ``UPWARD_IMPORTS`` and in docs/architecture.md (at most 2; none now);
- no import cycle between the project's modules, counting the package ``__init__`` modules an
  import runs;
- no import of the project's own modules inside a function in ``rft_core`` that only dodges a
  cycle: each one says why it is lazy in a ``# lazy:`` comment on its line (an optional heavy
  package).
"""
from __future__ import annotations

import ast
import re
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


# rft_core's floors, bottom to top (docs/architecture.md, "Layers"): a subpackage or top-level
# module of rft_core imports its own floor and the floors below, never one above
RFT_CORE_FLOORS: tuple[tuple[str, ...], ...] = (
    ("registry", "environments", "counters", "storage", "progress", "metrics", "evaluation", "network", "heap"),  # leaves
    ("algorithms",),
    ("models", "data"),
    ("config",),
    ("training", "rewards"),
    ("weightsync",),  # the transport library: below the engines and the workers that use it
    ("engines",),
    ("agents",),
    ("stages",),
    ("workers",),  # the Ray runtime: runs the stages, which never import it
    ("inspect", "observe", "replay", "api"),  # the surface for flows and tasks, and its helpers
)
# the imports that run back up the floors (importer, imported module), each listed in
# docs/architecture.md; at most 2
UPWARD_IMPORTS: set[tuple[str, str]] = set()


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


def _floor(module: str) -> int | None:
    """The floor of an rft_core module (None: not in rft_core, or ``rft_core`` itself)."""
    parts = module.split(".")
    if parts[0] != "rft_core" or len(parts) < 2:
        return None
    for i, names in enumerate(RFT_CORE_FLOORS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: rft_core.{parts[1]} has no floor: add it to RFT_CORE_FLOORS (tests/test_layers.py) "
                         "and to docs/architecture.md")


def _upward(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported module) of every rft_core import, at module top or inside a
    function, whose target sits on a higher floor than its importer."""
    out = set()
    for name, path in mods.items():
        low = _floor(name)
        if low is None:
            continue
        for imp in _imported_modules(path):
            target = _resolve(imp, mods)
            high = _floor(target) if target is not None else None
            if high is not None and high > low:
                out.add((name, target))
    return out


def test_rft_core_floors():
    """The workers sit above the stages and the weight sync below the engines: no import runs
    back up the floors except the documented ones (at most 2)."""
    mods = _project_modules()
    assert len(UPWARD_IMPORTS) <= 2
    docs = (ROOT / "docs" / "architecture.md").read_text()
    undocumented = [f"{a} -> {b}" for a, b in sorted(UPWARD_IMPORTS) if f"`{a}` -> `{b}`" not in docs]
    assert not undocumented, f"upward imports not listed in docs/architecture.md: {undocumented}"
    extra = _upward(mods) - UPWARD_IMPORTS
    assert not extra, f"imports that run back up rft_core's floors (RFT_CORE_FLOORS): {sorted(extra)}"


def test_floor_checker_sees_an_upward_import(tmp_path):
    """A stage module importing the workers, a weight-sync module importing an engine: both found."""
    up, down = tmp_path / "up.py", tmp_path / "down.py"
    up.write_text("def f():\n    from rft_core.workers.pool import run_resident\n")
    down.write_text("from rft_core.stages.sources import version_key\n")
    (tmp_path / "sync.py").write_text("import rft_core.engines.vllm\n")
    (tmp_path / "leaf.py").write_text("import torch\n")
    mods = {"rft_core.stages.rollout": up, "rft_core.workers.pool": down, "rft_core.stages.sources": tmp_path / "leaf.py",
            "rft_core.weightsync.engine": tmp_path / "sync.py", "rft_core.engines.vllm": tmp_path / "leaf.py"}
    assert _upward(mods) == {("rft_core.stages.rollout", "rft_core.workers.pool"),
                             ("rft_core.weightsync.engine", "rft_core.engines.vllm")}
    with pytest.raises(AssertionError, match="has no floor"):
        _floor("rft_core.newpackage.x")


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


def _packages_run_by(importer: str, target: str, mods: dict[str, Path]) -> set[str]:
    """The project packages whose ``__init__`` importing ``target`` from ``importer`` runs
    besides ``target`` itself: Python imports every parent package of a module first, except
    those the importer sits in (already imported by the time it runs)."""
    parts = target.split(".")
    out = set()
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package in mods and not (importer == package or importer.startswith(package + ".")):
            out.add(package)
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules importing it runs: what it imports (at module top or
    inside a function) and the parent packages of those (their ``__init__`` runs first)."""
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {_resolve(imp, mods) for imp in _imported_modules(path)} - {None}
        targets |= {p for t in targets for p in _packages_run_by(name, t, mods)}
        edges[name] = {t for t in targets if t != name}
    return edges


def test_no_import_cycles():
    mods = _project_modules()
    cycles = _cycles(_edges(mods))
    assert not cycles, f"import cycles between project modules (package __init__ imports count): {cycles}"


def test_checkers_see_violations(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from prefect import flow\nimport tasks.stages\nfrom rft_core.stages import runner\n")
    assert _imported_modules(f) == {"prefect", "prefect.flow", "tasks.stages", "rft_core.stages", "rft_core.stages.runner"}
    mods = {"flows.a": f, "rft_core.stages.runner": f, "rft_core.stages": f, "tasks.stages": f}
    assert _violations("flows", mods) == {"flows.a": ["rft_core.stages", "rft_core.stages.runner"]}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # p.a imports q.b; q's __init__ imports q.c, which imports p.a: a cycle only through q's
    # __init__, which Python runs before q.b (the config -> agents cycle of issue 37)
    leaf, init, back = tmp_path / "leaf.py", tmp_path / "init.py", tmp_path / "back.py"
    leaf.write_text("import torch\n")
    init.write_text("from q.c import thing\n")
    back.write_text("def f():\n    from p.a import thing\n")
    (tmp_path / "pa.py").write_text("from q.b import thing\n")
    pkg_mods = {"p": leaf, "p.a": tmp_path / "pa.py", "q": init, "q.b": leaf, "q.c": back}
    assert _edges(pkg_mods)["p.a"] == {"q", "q.b"}
    assert _edges(pkg_mods)["q.c"] == {"p", "p.a"}
    assert _edges({"q": init, "q.b": leaf, "q.c": tmp_path / "pa.py"})["q.c"] == {"q.b"}  # q: q.c's own package
    assert _cycles(_edges(pkg_mods)) == [["p.a", "q", "q.c"]]


LAZY_COMMENT = re.compile(r"#\s*lazy:")


def _unmarked_local_imports(path: Path) -> list[int]:
    """Line of each import of the project's own modules (``PACKAGES``, or relative) that is not
    at module top (inside a function, method or class, or under ``if TYPE_CHECKING:`` / ``try:``)
    with no ``# lazy:`` comment on any line of the import statement."""
    source = path.read_text()
    lines = source.splitlines()
    out: list[int] = []

    def own(node: ast.Import | ast.ImportFrom) -> bool:
        if isinstance(node, ast.ImportFrom):
            return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
        return any(a.name.split(".")[0] in PACKAGES for a in node.names)

    tree = ast.parse(source, filename=str(path))
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Import, ast.ImportFrom)) and node not in tree.body and own(node)
                and not any(LAZY_COMMENT.search(lines[i - 1]) for i in range(node.lineno, node.end_lineno + 1))):
            out.append(node.lineno)
    return sorted(out)


def test_function_local_imports_say_why():
    """An import of the project's own modules inside a function in rft_core (rft_core/workers/
    included), or under ``if TYPE_CHECKING:``, only dodging a cycle means the code is in the wrong place (issue 37, item 2): it
    goes to module top, or the code moves; one that stays says why on its line (``# lazy:``)."""
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "rft_core").rglob("*.py"))
           for line in _unmarked_local_imports(path)]
    assert not bad, f"function-local imports of the project's modules without a '# lazy: <why>' comment: {bad}"


def test_local_import_checker_sees_violations(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from rft_core.config import load_config\n"           # 1 module top: fine
                 "def f():\n"
                 "    import torch\n"                                   # 3 not the project's: fine
                 "    from rft_core.models.hub import torch_dtype\n"   # 4
                 "    from rft_core.engines.vllm import (  # lazy: vllm\n"
                 "        get_vllm_engine)\n"                           # 5-6 marked: fine
                 "class C:\n"
                 "    def m(self):\n"
                 "        def inner():\n"
                 "            import schemas.columns\n"                 # 10
                 "        from . import sibling\n"                      # 11
                 "        from rft_core import x  # not lazy: no marker\n"  # 12
                 "        import rft_core.agents  # lazy: optional package\n"  # 13 marked: fine
                 "if TYPE_CHECKING:\n"
                 "    from rft_core.stages.contracts import PPOUpdateInput\n")  # 15 not at module top
    assert _unmarked_local_imports(f) == [4, 10, 11, 12, 15]


def test_orchestration_functions_are_short():
    """Flows and tasks stay readable on one screen: no function longer than 60 lines."""
    long = []
    for package in ("flows", "tasks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
