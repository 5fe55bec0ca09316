"""The eval flow on a tiny random model: held-out shards committed and disjoint from the training
data, numbers consistent with the per-sample rows, reuse on rerun, a trained checkpoint found
from its run root, the preset entry point and the CLI command."""
from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import yaml

from rft_core.data.prompts import load_task
from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg

EVAL_SET = {"eval.num_prompts": 6, "eval.max_new_tokens": 5, "eval.batch_size": 4}


def _files(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_eval_base_model_heldout_shards(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.eval import evaluate

    cfg = flow_cfg(tiny_model, tmp_path / "run", **EVAL_SET)
    out = tmp_path / "ev"
    res = evaluate(cfg, None, str(out))
    assert res.policy == tiny_model and res.out_root == str(out)
    rows = read_shard(f"{out}/eval", stage="eval").to_pylist()
    assert len(rows) == res.num_prompts == 6
    assert all(r["prompt_id"].startswith("heldout-basic_arithmetic-") and r["sample_id"] == r["prompt_id"] + "#0" for r in rows)
    # disjoint from every question of the training dataset (size 50, seed 1234)
    train = load_task(cfg.data.task, size=cfg.data.size, seed=cfg.data.seed, task_config=cfg.data.task_config)
    assert not {r["question"] for r in rows} & {train[i]["question"] for i in range(cfg.data.size)}
    # each row carries its own response's grade (the fake grader: crc32 parity of the text), and
    # the headline numbers are the means of the rows
    assert [r["correct"] for r in rows] == [zlib.crc32(r["response_text"].encode()) % 2 == 1 for r in rows]
    assert res.accuracy == sum(r["correct"] for r in rows) / 6
    assert abs(res.reward_mean - sum(r["rewards"] for r in rows) / 6) < 1e-6
    assert all(1 <= r["response_length"] <= 5 for r in rows)
    rollout = read_shard(f"{out}/rollout", stage="rollout")
    assert rollout.column("response_text").to_pylist() == [r["response_text"] for r in rows]
    assert read_manifest(f"{out}/rollout")[0].summary["decoding"] == "greedy"
    # a rerun reuses every committed stage: same manifest, no file touched
    before = _files(out)
    again = evaluate(cfg, None, str(out))
    assert again.shard == res.shard and _files(out) == before


def test_eval_trained_checkpoint_from_run_root(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.eval import evaluate
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **EVAL_SET)
    trained = train(cfg).final_policy
    res = evaluate(cfg, cfg.run_root)  # the run root: its last committed checkpoint
    assert res.policy == f"{trained.uri}/policy"
    assert res.out_root.startswith(f"{cfg.run_root}/eval/iter=000001-")
    base = evaluate(cfg, None, str(tmp_path / "base"))
    # same held-out prompts for both checkpoints
    q = lambda r: read_shard(f"{r.out_root}/eval").column("question").to_pylist()  # noqa: E731
    assert q(res) == q(base)


def test_eval_from_preset_and_cli(prefect_harness, tiny_model, tmp_path, fake_rewards, monkeypatch):
    from typer.testing import CliRunner

    from flows.cli import app
    from flows.eval import eval_from_preset

    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump({"name": "ev", "policy": {"path": tiny_model}, "data": {"size": 50},
                                      "eval": {"num_prompts": 4, "max_new_tokens": 4}}))
    monkeypatch.chdir(tmp_path)  # the default root of a model path is runs/eval/ under the working directory
    res = eval_from_preset(str(preset), None, {"eval.num_prompts": 3, "eval.batch_size": 2})
    assert res.num_prompts == 3 and res.policy == tiny_model
    assert res.out_root.startswith(f"{tmp_path}/runs/eval/model-")

    out = tmp_path / "cli"
    r = CliRunner().invoke(app, ["eval", "-c", str(preset), "--set", "eval.num_prompts=2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "accuracy:" in r.output and "(2 held-out prompts, greedy)" in r.output
    assert read_shard(f"{out}/eval").num_rows == 2
    # a folder that is no checkpoint: a clear error naming the stage, exit 2
    r = CliRunner().invoke(app, ["eval", f"{out}/prompts", "-c", str(preset), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "committed 'prompts' stage" in r.output
    r = CliRunner().invoke(app, ["eval", "-c", str(preset), "--set", "eval.num_prompts=0"])
    assert r.exit_code == 2 and "eval.num_prompts" in r.output
