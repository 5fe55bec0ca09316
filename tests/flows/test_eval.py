"""The eval flow on a tiny random model: held-out shards committed and disjoint from the training
data, numbers consistent with the per-sample rows, reuse on rerun, a trained checkpoint found
from its run root, the preset entry point and the CLI command."""
from __future__ import annotations

import hashlib
import re
import zlib
from pathlib import Path

import pytest
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
    # greedy writes what it wrote before sampled evaluation existed: no sampled columns, the same summary
    from schemas.columns import EVAL

    assert read_shard(f"{out}/eval").schema.names == EVAL.schema.names
    assert sorted(read_manifest(f"{out}/eval")[0].summary) == [
        "accuracy", "accuracy_stderr", "generate_seconds", "num_prompts", "policy", "response_length_mean",
        "reward_mean", "reward_stderr", "tokens_per_second", "truncated_fraction"]
    # a rerun reuses every committed stage: same manifest, no file touched
    before = _files(out)
    again = evaluate(cfg, None, str(out))
    assert again.shard == res.shard and _files(out) == before


def test_greedy_eval_root_name_leaves_the_sampling_fields_out(tiny_model, tmp_path):
    """The default eval folder's hash of a greedy evaluation is computed from the eval settings
    as they were before eval.n_samples / temperature / top_p / sampling_seed existed."""
    from flows.eval import _fingerprint
    from schemas import config_hash

    cfg = flow_cfg(tiny_model, tmp_path / "run", **EVAL_SET)
    old = cfg.eval.model_dump(mode="json")
    for name in ("n_samples", "temperature", "top_p", "sampling_seed"):
        del old[name]
    assert _fingerprint(cfg, tiny_model, 5) == config_hash("eval-root", cfg.data, old, cfg.reward, tiny_model,
                                                           cfg.policy.dtype)[:10]
    sampled = flow_cfg(tiny_model, tmp_path / "run", **EVAL_SET, **{"eval.n_samples": 4})
    assert _fingerprint(sampled, tiny_model, 5) != _fingerprint(cfg, tiny_model, 5)


def test_eval_trained_checkpoint_from_run_root(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.eval import evaluate
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **EVAL_SET)
    trained = train(cfg)
    res = evaluate(cfg, cfg.run_root)  # the run root: its last committed checkpoint
    assert res.policy == trained.final_policy_folder == f"{trained.final_policy.uri}-policy/policy"  # written in the background
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


def _vote_score(text, **kw):
    """A grader for sampled answers that also extracts one: crc32 mod 3 is the 'answer', 0 is right."""
    from rft_core.rewards.math import RewardResult

    a = zlib.crc32(text.encode()) % 3
    return RewardResult(float(a == 0), a == 0, str(a), {"correctness": float(a == 0), "format": 0.0})


def test_cli_sampled_eval_prints_avg_pass_maj_with_standard_errors(prefect_harness, tiny_model, tmp_path, monkeypatch):
    """`rft eval --set eval.n_samples=4`: 4 sampled answers per prompt; the printed avg@4,
    pass@1..4 and maj@4 (± standard errors across prompts) are those of a float64 reference
    loop over the eval shard's rows (pass@k by exact binomials, Chen et al. 2021 eq. 1)."""
    import math
    import statistics

    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setattr("rft_core.rewards.math.score_response", _vote_score)
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump({"name": "ev", "policy": {"path": tiny_model}, "data": {"size": 50},
                                      "rollout": {"temperature": 1.0}, "eval": {"num_prompts": 4, "max_new_tokens": 4}}))
    out = tmp_path / "sampled"
    r = CliRunner().invoke(app, ["eval", "-c", str(preset), "--set", "eval.n_samples=4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = read_shard(f"{out}/eval").to_pylist()
    assert len(rows) == 16 and sorted((x["prompt_id"], x["sample_index"]) for x in rows) == \
        sorted((p, k) for p in {x["prompt_id"] for x in rows} for k in range(4))
    assert all(x["data_source"] == "basic_arithmetic" for x in rows)
    groups: dict[str, list[dict]] = {}
    for x in rows:
        groups.setdefault(x["prompt_id"], []).append(x)
    assert any(len({x["response_text"] for x in g}) > 1 for g in groups.values())  # sampled, not 4 greedy copies
    counts = [sum(x["correct"] for x in g) for g in groups.values()]
    assert 0 < sum(counts) < 16 and len(set(counts)) > 1  # a spread, so pass@k grows with k

    def maj(g):  # the vote: correct answers one class, wrong ones by extracted answer, ties split
        votes: dict[str, int] = {}
        for x in g:
            key = "correct" if x["correct"] else x["extracted_answer"]
            votes[key] = votes.get(key, 0) + 1
        top = [k for k, v in votes.items() if v == max(votes.values())]
        return 1 / len(top) if "correct" in top else 0.0

    ref = {"avg@4": [c / 4 for c in counts], "maj@4": [maj(g) for g in groups.values()]}
    for k in range(1, 5):
        ref[f"pass@{k}"] = [1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts]
    printed = {line.split(":")[0]: line.split(":", 1)[1].split() for line in r.output.splitlines()
               if re.match(r"(avg|pass|maj)@\d+:", line)}
    assert list(printed) == ["avg@4", "pass@1", "pass@2", "pass@3", "pass@4", "maj@4"]
    for name, vals in ref.items():
        mean, se = sum(vals) / len(vals), statistics.stdev(vals) / math.sqrt(len(vals))
        assert printed[name] == [f"{mean:.3f}", "±", f"{se:.3f}"], (name, printed[name], mean, se)
    summary = read_manifest(f"{out}/eval")[0].summary
    assert summary["metrics"]["by_data_source"]["basic_arithmetic"] == summary["metrics"]["overall"]
    assert summary["num_prompts"] == 4 and summary["accuracy"] == pytest.approx(sum(counts) / 16)
    assert read_manifest(f"{out}/rollout")[0].summary["decoding"] == "sampled"
    assert "temperature 1.0, top-p 1.0, seed 0" in r.output
