"""Every CLI command documents every option in --help, and bad input gives a clear error."""
from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from flows.cli import app

COMMANDS = ["train", "replay", "eval", "inspect", "serve"]
runner = CliRunner()


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_every_command_is_registered():
    group = typer.main.get_command(app)
    assert set(COMMANDS) <= set(group.commands)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_and_argument_has_help(name):
    command = typer.main.get_command(app).commands[name]
    assert command.help and len(command.help) > 20
    missing = [p.name for p in command.params if not (getattr(p, "help", None) or "").strip()]
    assert missing == [], f"{name}: no help for {missing}"
    out = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    text = _plain(out.output)
    for p in command.params:
        for opt in p.opts if p.param_type_name == "option" else [p.name]:
            assert opt in text, f"{name} --help does not show {opt}"


def test_wrong_option_and_wrong_value_are_named():
    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    out = runner.invoke(app, ["serve", "--bogus"], env=env)
    assert out.exit_code == 2 and "No such option: --bogus" in _plain(out.output)
    out = runner.invoke(app, ["serve", "--port", "0"], env=env)
    assert out.exit_code == 2 and "Invalid value for '--port'" in _plain(out.output)
    assert "greater than or equal to 1" in _plain(out.output)
    out = runner.invoke(app, ["train", "--set", "rollout.temprature=0.7"], env=env)
    assert out.exit_code == 2 and "rollout.temprature" in _plain(out.output)
