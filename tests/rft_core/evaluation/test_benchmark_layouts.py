"""GSM8K, MATH-500 and AIME 2024 files in the layouts the hub ships (tests/data/eval/README.md)
are read without a column mapping and graded right by math-verify: a correct and a wrong
response per layout, through the reward source the eval's rewards stage uses."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rft_core.config.rewards import MathAnswerSource
from rft_core.data.columns import gsm8k_final_answer, resolve_layout
from rft_core.data.files import FileDataset
from rft_core.rewards.base import RewardSample
from rft_core.rewards.math import MathAnswerReward

DATA = Path(__file__).resolve().parents[2] / "data" / "eval"


def _entries(name: str) -> tuple[FileDataset, list[dict]]:
    ds = FileDataset(str(DATA / name))
    return ds, [e for _, e in ds.entries(range(len(ds)))]


def test_gsm8k_layout_reads_the_number_after_the_hashes():
    ds, rows = _entries("gsm8k_sample.jsonl")
    assert ds.layout.columns == {"prompt": "question", "answer": "answer"} and ds.layout.gsm8k_answers
    assert [r["answer"] for r in rows] == ["126", "1200", "11"]  # "#### 1,200": commas removed
    assert rows[0]["question"].startswith("A bakery sells muffins") and rows[0]["data_source"] == "gsm8k_sample"


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("So she has 3 + 4 = <<3+4=7>>7.\n#### 7") == "7"
    assert gsm8k_final_answer("a\n#### 1,234,567 \n") == "1234567"
    assert gsm8k_final_answer("#### -2.5") == "-2.5"
    assert gsm8k_final_answer("72") is None and gsm8k_final_answer("#### 7\nthen more") is None
    assert gsm8k_final_answer("x\n####") is None


def test_question_answer_files_without_hashes_keep_their_answers(tmp_path):
    # the plain question/answer layout (e.g. examples/make_datasets.py's CSV) is unchanged
    p = tmp_path / "plain.jsonl"
    p.write_text('{"question": "What is 2 + 2?", "answer": "4"}\n{"question": "Name a prime.", "answer": "a #### b"}\n')
    ds = FileDataset(str(p))
    assert ds.layout.style == "plain" and [e["answer"] for _, e in ds.entries([0, 1])] == ["4", "a #### b"]
    # another prompt column: not GSM8K's names, the hashes stay
    layout = resolve_layout(pa.schema([("prompt", pa.string()), ("answer", pa.string())]), where="x")
    assert not layout.gsm8k_answers


def test_math500_layout():
    ds, rows = _entries("math500_sample.jsonl")
    assert ds.layout.columns == {"prompt": "problem", "answer": "answer"} and ds.layout.style == "plain"
    assert [r["answer"] for r in rows] == ["\\frac{7}{12}", "2\\sqrt{2}", "(-\\infty, 3)"]
    assert rows[0]["metadata"] == {"solution": rows[0]["metadata"]["solution"], "subject": "Prealgebra", "level": 2,
                                   "unique_id": "test/prealgebra/1623.json"}


def test_aime2024_layout_capitalised_columns_and_integer_answers():
    ds, rows = _entries("aime2024_sample.parquet")
    assert ds.format == "parquet" and ds.layout.columns == {"prompt": "Problem", "answer": "Answer"}
    assert [r["answer"] for r in rows] == ["24", "30", "77"]  # int64 column, as Maxwell-Jia/AIME_2024 ships it
    assert rows[1]["question"] == "How many positive divisors does $720$ have?"
    assert set(rows[0]["metadata"]) == {"ID", "Solution"} and rows[0]["metadata"]["ID"] == "2024-I-1"


# (file, row, a correct response, a wrong response)
CASES = [
    ("gsm8k_sample.jsonl", 1, "8 boxes of 150 pencils make 8 * 150 = 1200 pencils, so the answer is \\boxed{1200}.",
     "8 * 150 = 1150, so the answer is \\boxed{1150}."),
    ("gsm8k_sample.jsonl", 0, "She made 42 * 3 = 126 dollars. Answer: 126", "She made 14 * 3 = 42 dollars. Answer: 42"),
    ("math500_sample.jsonl", 0, "Dividing by 12 gives $\\boxed{\\dfrac{7}{12}}$.", "The fraction is $\\boxed{\\frac{7}{11}}$."),
    ("math500_sample.jsonl", 1, "The distance is $\\boxed{\\sqrt{8}}$.", "The distance is $\\boxed{2}$."),
    ("math500_sample.jsonl", 2, "So $x \\in \\boxed{(-\\infty, 3)}$.", "So $x \\in \\boxed{(3, \\infty)}$."),
    ("aime2024_sample.parquet", 0, "2^10 = 1024, so the remainder is \\boxed{024}.", "The remainder is \\boxed{124}."),
    ("aime2024_sample.parquet", 2, "2+3+5+7+11+13+17+19 = 77. The answer is \\boxed{77}.", "The answer is \\boxed{75}."),
]


def test_each_layout_graded_right_by_math_verify():
    samples, expected = [], []
    for name, row, right, wrong in CASES:
        _, rows = _entries(name)
        entry = rows[row]
        for response, ok in ((right, True), (wrong, False)):
            samples.append(RewardSample(sample_id=f"{name}#{row}#{ok}", prompt_id=f"{name}#{row}", label=entry["data_source"],
                                        question=entry["question"], prompt_text=entry["question"], response=response,
                                        reference=entry["answer"], metadata=entry["metadata"]))
            expected.append(ok)
    scores = MathAnswerReward(MathAnswerSource(grader="math_verify")).score(samples)
    got = [s.correct for s in scores]
    assert got == expected, [(s.sample_id, s.reference, g) for s, g, e in zip(samples, got, expected) if g != e]
    assert [s.score for s in scores] == [float(e) for e in expected]


@pytest.mark.parametrize("name", ["gsm8k_sample.jsonl", "math500_sample.jsonl", "aime2024_sample.parquet"])
def test_layouts_pass_the_column_checks_a_run_makes(name):
    from rft_core.data.validate import validate_dataset

    report = validate_dataset(FileDataset(str(DATA / name)))
    assert (report.rows, report.bad_rows, report.problems, report.file_problems) == (3, 0, [], [])
