"""Layer rules of ARCHITECTURE.md, checked on the source: rft_core and schemas never import prefect;
schemas imports nothing of rft_core, tasks or flows; rft_core imports no tasks or flows."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "rft_core": {"prefect", "tasks", "flows"},
    "schemas": {"prefect", "tasks", "flows", "rft_core"},
    "tasks": {"flows"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no python files under {package}"
    bad = {str(f.relative_to(ROOT)): sorted(_imports(f) & FORBIDDEN[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"layer rule broken: {bad}"


def test_checker_sees_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from prefect import flow\nimport tasks.stages\n")
    assert _imports(f) == {"prefect", "tasks"}
