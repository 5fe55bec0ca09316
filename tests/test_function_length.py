"""Size rules of issue 37 ("the update reads as a recipe"), checked on the source:

- ``ppo_update`` takes the update's settings object (``UpdateSettings``: the ``update`` and ``kl``
  config sections as they are, issue 46), not one argument per config field: at most 8
  parameters; ``critic_update`` takes the ``critic`` section the same way;
- no function (nested ones included) in ``rft_core/stages``, ``rft_core/training`` or
  ``rft_core/workers`` is longer than 80 lines (``end_lineno - lineno + 1`` of every
  ``def`` / ``async def``, decorators not counted, the docstring counted).
"""
from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
MAX_PPO_UPDATE_PARAMETERS = 8
PACKAGES = ("rft_core/stages", "rft_core/training", "rft_core/workers")


def function_lengths(folder: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method below ``folder`` (paths relative
    to it), nested ones included."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(folder)}:{node.lineno} {node.name}"))
    return out


def test_function_lengths_counts_nested_functions_and_methods(tmp_path):
    (tmp_path / "m.py").write_text("def outer():\n    def inner():\n        return 1\n\n    return inner\n\n\n"
                                   "class C:\n    async def method(self):\n        pass\n")
    assert sorted(function_lengths(tmp_path)) == [(2, "m.py:2 inner"), (2, "m.py:9 method"), (5, "m.py:1 outer")]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_longer_than_80_lines(package):
    lengths = function_lengths(ROOT / package)
    assert lengths, f"no function found under {package}"
    long = sorted(((n, where) for n, where in lengths if n > MAX_LINES), reverse=True)
    assert not long, (f"functions longer than {MAX_LINES} lines under {package} (split them where a reader would, "
                      f"by responsibility): " + "; ".join(f"{where} ({n} lines)" for n, where in long))


def test_the_updates_take_the_config_sections_not_their_fields():
    from rft_core.config import CriticConfig, KLConfig, UpdateConfig
    from rft_core.training.critic import critic_update
    from rft_core.training.update import UpdateSettings, ppo_update

    params = inspect.signature(ppo_update).parameters
    assert len(params) <= MAX_PPO_UPDATE_PARAMETERS, list(params)
    assert "settings" in params and params["settings"].annotation in ("UpdateSettings", UpdateSettings)
    # the sections themselves, plus the two values the stage adds (no copy of a config field)
    hints = typing.get_type_hints(UpdateSettings)
    assert hints == {"update": UpdateConfig, "kl": KLConfig, "temperature": float, "policy_version": int}
    params = inspect.signature(critic_update).parameters
    assert len(params) <= MAX_PPO_UPDATE_PARAMETERS, list(params)
    assert params["cfg"].annotation in ("CriticConfig", CriticConfig)
