"""``check_data``: detected format and mapping, row count, prompts rendered as the policy sees
them, and every problem the column checks of ``rft train`` find (issue 38: the same checks, the
same messages), as an object and as text."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.data.check import check_data, render_report


@pytest.fixture(scope="module")
def tok(tiny_model):
    from rft_core.models.loading import load_tokenizer

    return load_tokenizer(tiny_model)


def _verl_rows(n):
    return [{"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(n)]


def test_report_of_a_verl_file_with_bad_rows(tmp_path, tok):
    rows = _verl_rows(6)
    rows[0]["reward_model"]["ground_truth"] = None  # bad: no answer
    rows[4]["prompt"] = [{"role": "user", "content": ""}]  # bad: empty prompt
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet", row_group_size=2)
    r = check_data(tok, path=str(tmp_path / "v.parquet"), max_prompt_tokens=1000)
    src, = r.sources
    assert (src.format, src.style, src.prompt_kind, src.rows, r.rows) == ("parquet", "verl", "messages", 6, 6)
    assert src.columns == {"prompt": "prompt", "answer": "reward_model.ground_truth", "data_source": "data_source"}
    assert src.metadata_columns == ["reward_model"]
    assert r.bad_rows == 2 and not r.ok
    assert r.problems[0] == f"{tmp_path}/v.parquet row 0: no answer (column 'reward_model.ground_truth' is None)"
    assert r.problems[1] == f"{tmp_path}/v.parquet row 4 column 'prompt': empty prompt (no user message with text)"
    assert len(r.problems) == 2  # the examples skip bad rows without adding duplicates
    ex1, ex2 = r.examples  # the first two good rows: 1 and 2
    assert (ex1.where, ex1.answer, ex1.data_source) == (f"{tmp_path}/v.parquet row 1", "2", "arith")
    want = tok.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=False)
    assert ex1.prompt_text == want and ex1.n_tokens == len(tok(want, add_special_tokens=False)["input_ids"])
    assert ex2.where.endswith("row 2") and "What is 2 + 1?" in ex2.prompt_text
    text = render_report(r)
    assert "layout:   verl (prompt as chat messages)" in text
    assert "columns:  prompt <- prompt, answer <- reward_model.ground_truth, data_source <- data_source" in text
    assert f"rows: 6   fingerprint: {r.fingerprint}" in text and want in text
    assert "problems (2 bad row(s); 2 listed):" in text and text.endswith("FAILED: 2 bad row(s), 2 problem(s)")


def test_report_of_a_clean_mixture_and_of_a_broken_path(tmp_path, tok):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"question": f"qa{i}", "answer": str(i)}) + "\n" for i in range(3)))
    (tmp_path / "b.csv").write_text("problem,solution\nqb0,7\n")
    r = check_data(tok, sources=[{"path": str(tmp_path / "a.jsonl"), "weight": 2}, {"path": str(tmp_path / "b.csv")}],
                   system_prompt="Be exact.", max_prompt_tokens=5)
    assert [(s.format, s.style, s.rows, s.weight) for s in r.sources] == [("jsonl", "plain", 3, 2), ("csv", "plain", 1, 1)]
    assert r.rows == 4 and r.bad_rows == 0
    assert [e.where for e in r.examples] == [f"{tmp_path}/a.jsonl line 1 (row 0)", f"{tmp_path}/b.csv row 0"]  # one per source
    assert r.examples[1].prompt_text == tok.apply_chat_template(
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "qb0"}], add_generation_prompt=True, tokenize=False)
    assert r.problems == [f"{e.where}: prompt has {e.n_tokens} tokens, data.max_prompt_tokens is 5" for e in r.examples]
    bad = check_data(tok, path=str(tmp_path / "nope.parquet"))
    assert bad.rows == 0 and bad.problems == [f"data.path '{tmp_path}/nope.parquet': no such file or folder"]
    assert render_report(bad).splitlines()[-1] == "FAILED: 0 bad row(s), 1 problem(s)"
    ok = check_data(tok, path=str(tmp_path / "a.jsonl"))
    assert ok.ok and render_report(ok).endswith("\nOK")


def test_tokenizer_given_as_a_model_path(tmp_path, tok, tiny_model):
    (tmp_path / "a.jsonl").write_text(json.dumps({"question": "q0", "answer": "0"}) + "\n")
    by_path = check_data(tiny_model, path=str(tmp_path / "a.jsonl"))
    assert by_path.examples == check_data(tok, path=str(tmp_path / "a.jsonl")).examples and by_path.ok


def test_check_config_data_runs_the_column_checks_of_rft_train(tmp_path, tiny_model):
    """What the graders of the config read is checked as `rft train` checks it, with its texts:
    a label without a reward recipe (which the per-row scan `rft data check` ran before let pass),
    a struct answer a text-comparing grader cannot read, and a bad row."""
    from rft_core.config import load_config
    from rft_core.data.check import check_config_data
    from rft_core.data.validate import DataValidationError, validate_run_data

    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "data_source": "gsm8k"} for i in range(4)]
    rows[1]["data_source"], rows[2]["answer"] = "other", " "
    p = tmp_path / "l.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, {"policy.path": tiny_model, "run_root": str(tmp_path / "run"), "data.source": "files",
                             "data.path": str(p), "reward.sources": {"em": {"type": "exact_match"}},
                             "reward.recipes": {"gsm8k": [{"source": "em"}]}})
    with pytest.raises(DataValidationError) as err:
        validate_run_data(cfg, use_cache=False)
    want = [f"{p} line 2 (row 1) column 'data_source': a label without a reward recipe (recipes: gsm8k; "
            "reward.default_recipe is not set)", f"{p} line 3 (row 2): no answer (column 'answer' is ' ')"]
    assert err.value.report.problems == want
    r = check_config_data(cfg)
    assert (r.rows, r.bad_rows, r.problems, r.ok) == (4, 2, want, False)
    assert [e.where for e in r.examples] == [f"{p} line 1 (row 0)", f"{p} line 4 (row 3)"]  # the good rows
    assert render_report(r).endswith("FAILED: 2 bad row(s), 2 problem(s)")
    # a whole column the grader cannot read: the file problem of rft train, first
    pq.write_table(pa.table({"question": ["q0", "q1"], "answer": [{"v": 1}, {"v": 2}], "data_source": ["gsm8k"] * 2}),
                   tmp_path / "s.parquet")
    s = check_config_data(cfg, str(tmp_path / "s.parquet"))
    assert s.bad_rows == 0 and s.problems[0] == (f"{tmp_path}/s.parquet: column 'answer' (used as answer) has type "
                                                 "struct<v: int64>: the grader compares the answer as text: give text, "
                                                 "a number, a bool or chat messages") and not s.ok
