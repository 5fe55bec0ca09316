"""The type check of the orchestration and shard layers: mypy (configured in pyproject.toml,
installed by the Makefile's dev extra) runs clean over flows/, tasks/ and schemas/, so the stage
calls of every flow are checked against the stage input models."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One mypy cache for both checks: the second reuses what the first analysed (prefect,
    pydantic, torch, the project), instead of analysing it all again."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_mypy_is_clean_over_flows_tasks_and_schemas(cache):
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout


def test_mypy_catches_a_wrong_stage_input(tmp_path, cache):
    """The check is not vacuous: a flow building a stage input with a misspelt field, or calling a
    stage task with a positional argument, fails it."""
    pytest.importorskip("mypy")
    bad = tmp_path / "bad_flow.py"
    bad.write_text("import tasks\nfrom rft_core.api import RewardsInput\n\n\n"
                   "def f(x, r, cfg) -> None:\n"
                   "    tasks.rewards(inp=RewardsInput(rolout=x, prompts=x, reward=cfg, out='o'))\n"
                   "    tasks.rewards(r)\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert 'bad_flow.py:6: error: Unexpected keyword argument "rolout"' in proc.stdout, proc.stdout
    assert 'bad_flow.py:7: error: No overload variant of "__call__" of "Task"' in proc.stdout, proc.stdout
