"""benchmarks/distill.py end to end at a tiny size (the tiny model, 1 iteration, 1 seed): it trains
a teacher with GRPO, runs both arms from the same start, scores everything on held-out prompts,
writes the raw JSON and its section into the doc (keeping the doc's other text), and a second
run with the same --out reuses every finished part."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def distill_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    for name in ("distill", "learning", "learning_trl", "_env"):
        sys.modules.pop(name, None)
    import distill

    return distill


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_the_benchmark_end_to_end_at_a_tiny_size(prefect_harness, tiny_model, tmp_path, distill_bench):
    doc = tmp_path / "learning.md"
    doc.write_text("# Learning\n\nthe GRPO report\n")
    raw = tmp_path / "distill.json"
    argv = ["--seeds", "0", "--iterations", "1", "--teacher-iterations", "1", "--eval-prompts", "4",
            "--out", str(tmp_path / "out"), "--doc", str(doc), "--json", str(raw)]
    for o in (f"policy.path={tiny_model}", "data.size=60", "data.prompts_per_iteration=2", "rollout.n_samples_per_prompt=2",
              "rollout.max_new_tokens=5", "rollout.batch_size=8", "update.train_batch_size=4", "update.micro_batch_size=4",
              "eval.max_new_tokens=5", "eval.batch_size=4"):
        argv += ["--set", o]
    record = distill_bench.main(argv)

    teacher = record["teacher"]["path"]
    assert teacher.endswith("/teacher/iter=000001/ppo_update-policy/policy") and Path(teacher, "config.json").exists()
    assert set(record["results"]) == {"distill", "grpo"}
    distill_row = record["results"]["distill"][0]["metrics"][0]
    grpo_row = record["results"]["grpo"][0]["metrics"][0]
    assert "distill_reverse_kl" in distill_row and "seconds/teacher_logprobs" in distill_row
    assert "distill_reverse_kl" not in grpo_row and "seconds/teacher_logprobs" not in grpo_row
    before = record["before"]["accuracy"]
    for arm in ("distill", "grpo"):
        gain = record["results"][arm][0]["after"]["accuracy"] - before
        assert record["summary"]["per_seed"][arm] == [gain] and record["summary"]["gains"][arm]["mean"] == gain
    assert record["summary"]["distill_minus_grpo"]["verdict"] == "unknown"  # one seed: no spread to compare against
    assert json.loads(raw.read_text())["summary"] == record["summary"]
    text = doc.read_text()
    assert text.startswith("# Learning\n\nthe GRPO report\n") and text.count(distill_bench.BEGIN) == 1
    assert "| distill | 0 |" in text and "| grpo | 0 |" in text and "--iterations 1" in text

    # the same --out again: the teacher and both arms are reused, the section replaced (not appended)
    again = distill_bench.main(argv)
    assert again["results"] == record["results"] and again["teacher"]["path"] == teacher
    assert doc.read_text().count(distill_bench.BEGIN) == 1


def test_sections_and_overrides(distill_bench):
    assert distill_bench.arm_overrides("distill", "t") == ["teacher.path=t", "teacher.use_task_rewards=false"]
    assert distill_bench.arm_overrides("grpo", "t") == []
    s = f"{distill_bench.BEGIN}\nnew\n{distill_bench.END}"
    assert distill_bench.replace_section("a\n", s) == f"a\n\n{s}\n"
    assert distill_bench.replace_section(f"a\n{distill_bench.BEGIN}\nold\n{distill_bench.END}\nb\n", s) == f"a\n{s}\nb\n"
