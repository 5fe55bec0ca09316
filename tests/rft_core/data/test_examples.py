"""examples/make_datasets.py: three formats with the same correct answers, a disjoint held-out
file, reference answers graded correct by math_answer/math_verify, and the preset's data keys."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from rft_core.data.mixture import open_data

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_datasets", ROOT / "examples" / "make_datasets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_all(tmp_path_factory.mktemp("ex"), rows=200, test_rows=50, seed=0)


def _pairs(path):
    ds = open_data(str(path))
    return ds, [(e["question"], e["answer"]) for _, e in ds.entries(range(len(ds)))]


def _true_answer(question: str) -> int:
    a, op, b = re.fullmatch(r"What is (\d+) ([+*-]) (\d+)\?", question).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_three_formats_hold_the_same_correct_rows(made):
    verl, rows = _pairs(made["verl"])
    trl, rows_trl = _pairs(made["trl"])
    csv_ds, rows_csv = _pairs(made["csv"])
    assert (verl.layout.style, trl.layout.style, csv_ds.layout.style) == ("verl", "trl_conversational", "plain")
    assert len(rows) == 200 and rows == rows_trl == rows_csv and len({q for q, _ in rows}) == 200
    assert all(int(a) == _true_answer(q) for q, a in rows)
    assert {e["data_source"] for _, e in verl.entries(range(200))} == {"arithmetic"}
    _, test_rows = _pairs(made["test"])
    assert len(test_rows) == 50 and not {q for q, _ in test_rows} & {q for q, _ in rows}
    assert all(int(a) == _true_answer(q) for q, a in test_rows)


def test_reference_answers_grade_correct_with_math_verify(made):
    from rft_core.config import MathAnswerSource
    from rft_core.rewards.base import RewardSample
    from rft_core.rewards.math import MathAnswerReward

    _, rows = _pairs(made["trl"])
    _, test_rows = _pairs(made["test"])
    rows = rows + test_rows

    def sample(k, q, ref, said):
        return RewardSample(sample_id=f"s{k}", prompt_id=f"p{k}", label="arith_trl", question=q, prompt_text=q,
                            response=f"Let me compute.\nAnswer: {said}", reference=ref)

    right = [sample(k, q, a, _true_answer(q)) for k, (q, a) in enumerate(rows)]
    wrong = [sample(k, q, a, _true_answer(q) + 1) for k, (q, a) in enumerate(rows[:20])]
    scores = MathAnswerReward(MathAnswerSource(grader="math_verify")).score(right + wrong)
    assert [s.score for s in scores[:len(right)]] == [1.0] * len(right)
    assert [s.score for s in scores[len(right):]] == [0.0] * len(wrong)


def test_preset_data_keys_map_onto_open_data_and_check(made, tiny_model):
    from rft_core.data.check import check_data
    from rft_core.models.loading import load_tokenizer

    cfg = yaml.safe_load((ROOT / "configs" / "grpo_my_data.yaml").read_text())
    data = cfg["data"]
    assert data["source"] == "files" and Path(data["path"]).name == made["trl"].name
    assert Path(cfg["eval"]["path"]).name == made["test"].name
    assert "columns" not in data  # a mapping would apply to every file: the README trains on all three with it
    ds = open_data(str(made["trl"]), format=data["format"])
    assert len(ds) == 200 and ds.layout.columns == {"prompt": "prompt", "answer": "solution"}
    r = check_data(load_tokenizer(tiny_model), path=str(made["trl"]), format=data["format"],
                   system_prompt=data["system_prompt"], prompt_template=data["prompt_template"],
                   max_prompt_tokens=data["max_prompt_tokens"])
    assert r.ok and r.examples[0].data_source == "arith_trl"
    assert cfg["reward"]["default_recipe"] in cfg["reward"]["recipes"]
    assert "Give the final answer on the last line as: Answer: <answer>" in r.examples[0].prompt_text
