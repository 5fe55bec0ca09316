"""Every CLI command documents every option in --help, and bad input gives a clear error."""
from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from flows.cli import app

COMMANDS = ["train", "replay", "eval", "inspect", "serve", "check", "verify", "repair"]
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


def test_data_check_is_a_documented_subcommand():
    group = typer.main.get_command(app).commands["data"]
    command = group.commands["check"]
    assert "Exits 1 when there are problems" in " ".join((command.help or "").split())
    assert [p.name for p in command.params if not (getattr(p, "help", None) or "").strip()] == []
    out = runner.invoke(app, ["data", "check", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert out.exit_code == 0 and all(o in _plain(out.output) for o in ("--config", "--set", "--examples", "PATH"))


def test_data_check_prints_the_report_and_exits_1_on_problems(tmp_path, tiny_model):
    import json

    from rft_core.models.loading import load_tokenizer

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"}],
             "solution": str(i + 1)} for i in range(5)]
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    # math_verify: these rows carry no reasoning-gym label, which the default grader (dataset) needs, as rft train says
    check = ["data", "check", str(good), "--set", f"policy.path={tiny_model}", "--set", "reward.grader=math_verify"]
    out = runner.invoke(app, check, env=env)
    text = _plain(out.output)
    assert out.exit_code == 0, text
    assert "format:   jsonl" in text and "layout:   trl_conversational" in text
    assert "columns:  prompt <- prompt, answer <- solution" in text and "rows:     5" in text
    tok = load_tokenizer(tiny_model)
    for i in (0, 1):  # the first two prompts exactly as the policy sees them (chat template applied)
        rendered = tok.apply_chat_template(rows[i]["prompt"], add_generation_prompt=True, tokenize=False)
        assert f"{'-' * 72}\n{rendered}\n{'-' * 72}" in text
    assert "What is 2 + 1?" not in text  # two examples by default and text.rstrip().endswith("OK")
    # one blank answer and a mapping of the config: every problem listed, exit code 1
    rows[3]["solution"] = ""
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = runner.invoke(app, check, env=env)
    assert out.exit_code == 1 and f"{good} line 4 (row 3): no answer (column 'solution'" in _plain(out.output)
    assert "FAILED: 1 bad row(s), 1 problem(s)" in _plain(out.output)
    out = runner.invoke(app, [*check, "--set",
                              "data.source=files", "--set", "data.path=x", "--set", "data.columns.answer=label"], env=env)
    assert out.exit_code == 1 and "data.columns.answer names column 'label', which is not in the file" in _plain(out.output)


def test_train_on_a_user_file_with_the_demo_config_fails_before_the_flow_naming_both_keys(tmp_path):
    """Issue 30: the demo config (reward.grader=dataset) with data.source=files on a file of one's
    own stops in seconds, before any Prefect flow or stage, with the keys and the fix."""
    import time

    p = tmp_path / "mine.jsonl"
    p.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(4)))
    t0 = time.perf_counter()
    result = runner.invoke(app, ["train", "-c", "configs/grpo_demo.yaml", "--set", "data.source=files", "--set",
                                 f"data.path={p}", "--run-root", str(tmp_path / "run")])
    assert time.perf_counter() - t0 < 60
    assert result.exit_code == 2, result.output
    assert "reward.grader=dataset" in result.output and "data.source=files" in result.output
    assert "set reward.grader=math_verify" in result.output
    assert not list((tmp_path / "run").rglob("_MANIFEST.json"))
