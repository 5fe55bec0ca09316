"""On-policy distillation through the training flow on the tiny model: the teacher (another tiny
model with the same tokenizer) scores every iteration's rollout in the teacher_logprobs stage, the
advantages are exactly teacher.coef * (log nu - log pi_old) on the action tokens (distillation
alone), the policy moves; a teacher with another tokenizer stops the run before any stage."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rft_core.metrics import format_metrics_line
from rft_core.stages.teacher import TeacherTokenizerError
from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg
from tests.tiny import build_tiny_model

COEF = 0.5


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1)


def test_two_iterations_of_distillation_alone(prefect_harness, tiny_model, teacher, tmp_path, fake_rewards):
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", **{"teacher.path": teacher, "teacher.coef": COEF,
                                                   "teacher.use_task_rewards": False})
    result = train(cfg)
    for it in (1, 2):
        stage = f"{cfg.run_root}/iter={it:06d}"
        manifest, sha = read_manifest(f"{stage}/teacher_logprobs")
        assert manifest.contract == "teacher_logprobs v1"
        teacher_lp = dict(zip(*read_shard(f"{stage}/teacher_logprobs").to_pydict().values()))
        old = {r["sample_id"]: r["old_logprobs"] for r in read_shard(f"{stage}/actor_logprobs").to_pylist()}
        masks = {r["sample_id"]: r["action_mask"] for r in read_shard(f"{stage}/rollout").to_pylist()}
        adv_manifest, _ = read_manifest(f"{stage}/advantages")
        assert adv_manifest.inputs["teacher_logprobs"] == sha
        rows = read_shard(f"{stage}/advantages").to_pylist()
        assert len(rows) == 12 and sum(len(r["advantages"]) for r in rows) > 12
        gaps = []
        for r in rows:
            sid = r["sample_id"]
            expect = [COEF * (t - o) if m else 0.0 for t, o, m in zip(teacher_lp[sid], old[sid], masks[sid])]
            assert r["advantages"] == pytest.approx(expect, abs=1e-6)
            gaps += [abs(t - o) for t, o in zip(teacher_lp[sid], old[sid])]
        assert max(gaps) > 0.05  # the teacher is another model: the signal is not zero
        assert adv_manifest.summary["distill_reverse_kl"] == pytest.approx(result.metrics[it - 1]["distill_reverse_kl"])
    lines = [json.loads(x) for x in Path(cfg.run_root, "metrics.jsonl").read_text().splitlines()]
    assert all("seconds/teacher_logprobs" in m and "distill_reverse_kl" in m for m in lines)
    assert f"distill_kl {lines[0]['distill_reverse_kl']:.3f}" in format_metrics_line(lines[0])
    assert read_manifest(f"{cfg.run_root}/iter=000002/ppo_update")[0].summary["optimizer_steps"] >= 1


def test_a_teacher_with_another_tokenizer_stops_the_run_before_any_stage(prefect_harness, tiny_model, teacher, tmp_path,
                                                                         fake_rewards):
    from flows.train import train

    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{"teacher.path": str(other)})
    with pytest.raises(TeacherTokenizerError, match=f"teacher.path '{other}' has another tokenizer than policy.path"):
        train(cfg)
    assert not list(Path(cfg.run_root).glob("iter=*"))  # nothing of any stage was written
