"""The real default model (SmolLM2-135M-Instruct) through one iteration of the train flow on the
example JSON Lines file of examples/make_datasets.py, with configs/grpo_my_data.yaml as a user
would run it: the file's rows in the prompts shard, rendered with their own system turn, graded by
math-verify against the file's answers; then the held-out evaluation from eval.path."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rft_core.config import load_config
from schemas import read_manifest, read_shard

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _make_examples(out: Path) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("make_datasets", ROOT / "examples" / "make_datasets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_all(out, rows=200, test_rows=50, seed=0)


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_one_smollm2_iteration_on_the_example_jsonl(prefect_harness, tmp_path):
    from flows.eval import evaluate
    from flows.train import train

    made = _make_examples(tmp_path / "data")
    cfg = load_config(ROOT / "configs" / "grpo_my_data.yaml", [
        f"data.path={made['trl']}", f"eval.path={made['test']}", f"run_root={tmp_path / 'run'}", "iterations=1",
        "data.prompts_per_iteration=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=32",
        "eval.num_prompts=3", "eval.max_new_tokens=16"])
    result = train(cfg)
    assert [m["iteration"] for m in result.metrics] == [1]

    lines = [json.loads(x) for x in made["trl"].read_text().splitlines()]
    prompts = read_shard(f"{cfg.run_root}/iter=000001/prompts", stage="prompts").to_pylist()
    summary = read_manifest(f"{cfg.run_root}/iter=000001/prompts")[0].summary
    assert len(prompts) == 2 and summary["rows"] == [f"{made['trl']} line {i + 1} (row {i})"  # no blank lines
                                                  for i in summary["dataset_indices"]]
    for row, i in zip(prompts, summary["dataset_indices"]):
        system, user = lines[i]["prompt"]
        assert (row["question"], row["answer"], row["data_source"]) == (user["content"], lines[i]["solution"], "arith_trl")
        assert row["prompt_text"].startswith(f"<|im_start|>system\n{system['content']}<|im_end|>\n<|im_start|>user\n"
                                             f"{user['content']}<|im_end|>\n<|im_start|>assistant\n")
    rewards = read_shard(f"{cfg.run_root}/iter=000001/rewards", stage="rewards").to_pylist()
    # recipe "arithmetic": 1.0 x math_verify correctness + 0.1 x format
    assert len(rewards) == 4
    assert all(min(abs(r["rewards"] - v) for v in (0.0, 0.1, 1.0, 1.1)) < 1e-6 for r in rewards)
    assert all(r["correct"] == (r["rewards"] > 0.5) for r in rewards)
    assert (Path(result.final_policy_folder) / "model.safetensors").exists()

    res = evaluate(cfg, cfg.run_root)
    rows = read_shard(f"{res.out_root}/eval", stage="eval").to_pylist()
    test = [json.loads(x) for x in made["test"].read_text().splitlines()][:3]
    assert [(r["question"], r["answer"]) for r in rows] == [(t["prompt"][1]["content"], t["solution"]) for t in test]
