"""Flows call stage tasks with keywords only: checked on the source of every flow (a positional
argument to a stage task, directly, through ``tasks.tagged(...)`` or ``.submit``, fails this
test), and enforced at run time by the tasks' keyword-only signatures."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tasks

FLOWS = Path(__file__).resolve().parents[2] / "flows"
STAGE_TASK_NAMES = {t.fn.__name__ for t in tasks.STAGE_TASKS}


def _stage_task_of(node: ast.expr) -> str | None:
    """The stage task a call's callee is: ``tasks.X``, ``tasks.tagged(tasks.X, ...)``, or their
    ``.submit``; None for anything else."""
    if isinstance(node, ast.Attribute) and node.attr == "submit":
        return _stage_task_of(node.value)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tasks" \
            and node.attr in STAGE_TASK_NAMES:
        return node.attr
    if isinstance(node, ast.Call) and _is_tagged(node.func) and node.args:
        return _stage_task_of(node.args[0])
    return None


def _is_tagged(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "tagged" and isinstance(func.value, ast.Name) \
        and func.value.id == "tasks"


def positional_stage_calls(source: str, filename: str = "<flow>") -> list[str]:
    """``file:line task`` of every call of a stage task with a positional argument."""
    bad = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Call) and not _is_tagged(node.func):
            name = _stage_task_of(node.func)
            if name is not None and node.args:
                bad.append(f"{filename}:{node.lineno} {name}")
    return bad


def test_flows_call_stage_tasks_with_keywords_only():
    calls = 0
    bad: list[str] = []
    for path in sorted(FLOWS.glob("*.py")):
        source = path.read_text()
        bad += positional_stage_calls(source, path.name)
        calls += sum(isinstance(n, ast.Call) and _stage_task_of(n.func) is not None and not _is_tagged(n.func)
                     for n in ast.walk(ast.parse(source)))
    assert not bad, f"stage tasks called with positional arguments: {bad}"
    assert calls >= 15  # the checker does see the flows' stage calls


def test_the_checker_catches_positional_arguments():
    src = ("tasks.rewards(inp=x)\n"
           "tasks.tagged(tasks.rollout, tags)(x)\n"
           "tasks.tagged(tasks.ppo_update, tags).submit(x, runner=r)\n"
           "tasks.advantages(x)\n"
           "other(x)\n")
    assert positional_stage_calls(src) == ["<flow>:2 rollout", "<flow>:3 ppo_update", "<flow>:4 advantages"]


@pytest.mark.parametrize("task", tasks.STAGE_TASKS, ids=lambda t: t.name)
def test_stage_tasks_take_keywords_only(task):
    with pytest.raises(TypeError):
        task.fn(object())
