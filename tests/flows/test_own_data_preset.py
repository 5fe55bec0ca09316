"""Issue 38, the first hour with one's own data: `rft train -c configs/grpo_my_data.yaml --set
data.path=<your file>` trains where the example files are not (the preset's eval.path, which
training never reads, used to stop it as `data.path 'examples/data/arith_test.jsonl': no such
file or folder`), and `rft data check` reports a bad file with the column checks and texts of
`rft train`."""
from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from flows.cli import app
from schemas import read_manifest, read_shard
from tests.weights import iteration_policy_folder

ROOT = Path(__file__).resolve().parents[2]
PRESET = str(ROOT / "configs" / "grpo_my_data.yaml")
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
runner = CliRunner()


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _mine(path: Path, n: int = 6) -> list[dict]:
    """Rows in the preset's own layout (TRL conversational: prompt messages, solution)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 2}?"}], "solution": str(2 * i + 2)}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_grpo_my_data_trains_on_ones_own_file_without_the_example_files(prefect_harness, tiny_model, tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)  # the preset's relative paths (examples/data/...) resolve to nothing here
    assert not Path("examples/data/arith_test.jsonl").exists() and not Path("examples/data/arith_trl.jsonl").exists()
    mine = tmp_path / "mine.jsonl"
    rows = _mine(mine)
    run = tmp_path / "run"
    out = runner.invoke(app, ["train", "-c", PRESET, "--set", f"data.path={mine}", "--set", f"policy.path={tiny_model}",
                              "--set", "iterations=1", "--set", "data.prompts_per_iteration=2",
                              "--set", "rollout.n_samples_per_prompt=2", "--set", "rollout.max_new_tokens=4",
                              "--set", "rollout.batch_size=4", "--set", "update.micro_batch_size=2",
                              "--run-root", str(run)], env=ENV)
    text = _plain(out.output)
    assert out.exit_code == 0, text + repr(out.exception)
    assert f"data.path '{mine}': all 6 rows valid" in text and "arith_test" not in text
    summary = read_manifest(f"{run}/iter=000001/prompts")[0].summary
    prompts = read_shard(f"{run}/iter=000001/prompts", stage="prompts").to_pylist()
    assert [(p["question"], p["answer"]) for p in prompts] == [
        (rows[i]["prompt"][0]["content"], rows[i]["solution"]) for i in summary["dataset_indices"]]
    folder = iteration_policy_folder(run, 1)  # written in the background (checkpoint.async_weights): ppo_update-policy
    assert len(prompts) == 2 and (folder / "model.safetensors").exists() and f"(final: {folder})" in text


def test_data_check_of_a_bad_file_gives_the_column_checks_of_rft_train(tiny_model, tmp_path):
    """A row without a prompt and a label without a reward recipe: the same lines as rft train's
    validation error, exit code 1."""
    mine = tmp_path / "mine.jsonl"
    rows = _mine(mine, 4)
    rows[1]["prompt"] = [{"role": "user", "content": "   "}]
    rows[2]["data_source"] = "gsm8k"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # no default recipe: every row needs a label with a recipe (the preset's one recipe: arithmetic)
    args = ["-c", PRESET, "--set", f"data.path={mine}", "--set", f"policy.path={tiny_model}",
            "--set", "reward.default_recipe=null"]
    out = runner.invoke(app, ["data", "check", *args], env=ENV)
    text = _plain(out.output)
    assert out.exit_code == 1, text
    train = runner.invoke(app, ["train", *args, "--run-root", str(tmp_path / "run")], env=ENV)  # stops before any flow
    refused = _plain(train.output)
    assert train.exit_code == 2 and "data validation failed before any stage ran" in refused, refused
    want = [f"{mine} line 1 (row 0) column 'data_source': a label without a reward recipe",  # labelled 'mine', its file's name
            f"{mine} line 2 (row 1) column 'prompt': empty prompt",
            f"{mine} line 3 (row 2) column 'data_source': a label without a reward recipe"]
    for line in want:
        assert f"  - {line}" in text and f"  - {line}" in refused, (line, text, refused)
    assert "FAILED: 4 bad row(s), 4 problem(s)" in text
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("iter=*"))
