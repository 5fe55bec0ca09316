"""The whole dataset validated before a run starts (issue 30 item 1): every row of the data files
(not eval.path, which training never reads: issue 38) checked column-wise, bad rows reported by
file and 1-based JSON Lines line (or row index) with their column, at most 20 listed and all
counted, nothing written on failure, and a passed validation remembered by the files' fingerprint."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.config import load_config
from rft_core.data import validate as validate_mod
from rft_core.data.files import FileDataset, jsonl_blank_lines, jsonl_line
from rft_core.data.mixture import open_data
from rft_core.data.prompts import DatasetError
from rft_core.data.validate import (
    CHECKS_DIR,
    DataValidationError,
    Needs,
    check_batch,
    validate_dataset,
    validate_run_data,
)

FORMAT_ONLY = {"reward.sources": {"fmt": {"type": "format"}}, "reward.recipes": {"any": [{"source": "fmt"}]},
               "reward.default_recipe": "any"}


def _jsonl(path: Path, rows, *, blank_after=()) -> str:
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r) + "\n")
        if i in blank_after:
            lines.append("\n   \n")  # an empty line and a whitespace-only one: the reader skips both
    path.write_text("".join(lines))
    return str(path)


def _cfg(tmp_path, data_path, **over):
    # math_verify: these files' rows are labelled with the file's name, which the default dataset grader
    # (reasoning-gym's scorer) cannot grade (test_the_dataset_grader_needs_reasoning_gym_labels)
    grader = {} if "reward.sources" in over or "reward.grader" in over else {"reward.grader": "math_verify"}
    return load_config(None, {"run_root": str(tmp_path / "run"), "data.source": "files", "data.path": str(data_path),
                              "data.prompts_per_iteration": 3, "iterations": 2, **grader, **over})


def _good(i):
    return {"question": f"What is {i} + {i}?", "answer": str(2 * i)}


def test_the_fourth_line_without_its_answer_fails_before_anything_is_written(tmp_path):
    """The issue's case: 3 prompts x 2 iterations used to train iteration 1 and stop in iteration 2
    with 'bad.jsonl row 3: no answer'; now the run stops before any stage, naming line 4."""
    rows = [_good(i) for i in range(6)]
    del rows[3]["answer"]
    p = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataValidationError) as err:
        validate_run_data(_cfg(tmp_path, p))
    msg = str(err.value)
    assert f"{p} line 4 (row 3): no answer (column 'answer' is None)" in msg
    assert msg.startswith("data validation failed before any stage ran, nothing was written: 1 bad row(s) of 6 in ")
    assert err.value.report.bad_rows == 1 and isinstance(err.value, DatasetError)
    assert not (tmp_path / "run" / CHECKS_DIR).exists()  # a failed validation leaves no marker


def test_jsonl_lines_count_blank_lines_as_an_editor_does(tmp_path):
    rows = [_good(i) for i in range(5)]
    rows[4]["question"] = "   "
    rows[2]["answer"] = None
    p = _jsonl(tmp_path / "b.jsonl", rows, blank_after=(0, 1))  # lines: 1 row0, 2-3 blank, 4 row1, 5-6 blank, 7 row2 ...
    lines = lambda raw, n: jsonl_line(jsonl_blank_lines(raw, n), np.arange(n)).tolist()  # noqa: E731
    assert lines(Path(p).read_bytes(), 5) == [1, 4, 7, 8, 9]
    assert jsonl_blank_lines(b'{"a": 1}\n{"a": 2}', 2) is None  # no blank line: row r is line r + 1
    assert lines(b'{"a": 1}\n{"a": 2}', 2) == [1, 2]
    assert lines(b'\r\n{"a": 1}\r\n\t\r\n  \n{"a": 2}\n\n', 2) == [2, 5]
    assert lines(b'\n\n{"a": 1}\n \n{"a": 2}\n{"a": 3}  \n\n\n{"a": 4}', 4) == [3, 5, 6, 9]
    assert lines(b'{"a": 1}\n\n{"a": 2}\n  ', 2) == [1, 3]  # a blank last line without a newline
    assert jsonl_blank_lines(b'{"a": 1}\n\n{"a": 2}\n', 1) is False  # lines and rows disagree: rows by index
    report = validate_dataset(open_data(p))
    assert report.problems == [f"{p} line 7 (row 2): no answer (column 'answer' is None)",
                               f"{p} line 9 (row 4): empty prompt (column 'question' is '   ')"]
    ds = open_data(p)  # the prompts stage names the same lines
    assert ds.where(2) == f"{p} line 7 (row 2)"
    with pytest.raises(DatasetError, match=re.escape(f"{p} line 7 (row 2): no answer")):
        ds.entries([2])


def test_parquet_rows_by_index_across_batches_and_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(validate_mod, "BATCH_ROWS", 4)  # batches of 4 rows: the offsets carry over
    rows = [{"prompt": f"q{i}", "reward_model": {"ground_truth": str(i)}, "extra": i} for i in range(15)]
    rows[5]["reward_model"] = None  # a null parent: no answer
    rows[12]["reward_model"]["ground_truth"] = " "
    rows[13]["prompt"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet", row_group_size=6)
    report = validate_dataset(open_data(str(tmp_path / "t.parquet")))
    p = tmp_path / "t.parquet"
    assert (report.rows, report.bad_rows) == (15, 3)
    assert report.problems == [f"{p} row 5: no answer (column 'reward_model.ground_truth' is None)",
                               f"{p} row 12: no answer (column 'reward_model.ground_truth' is ' ')",
                               f"{p} row 13: no prompt (column 'prompt' is null)"]


def test_more_than_20_bad_rows_list_the_first_20_and_count_all(tmp_path):
    rows = [_good(i) if i % 3 else {"question": f"q{i}", "answer": ""} for i in range(90)]  # 30 bad
    p = _jsonl(tmp_path / "many.jsonl", rows)
    with pytest.raises(DataValidationError) as err:
        validate_run_data(_cfg(tmp_path, p))
    report = err.value.report
    assert (report.rows, report.bad_rows, len(report.problems)) == (90, 30, 20)
    assert report.problems[0] == f"{p} line 1 (row 0): no answer (column 'answer' is '')"
    assert report.problems[19] == f"{p} line 58 (row 57): no answer (column 'answer' is '')"
    msg = str(err.value)
    assert "bad rows (the first 20 of 30):" in msg and msg.endswith("... and 10 more bad row(s)")


def test_image_paths_that_do_not_exist(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(b"png")
    rows = [{"question": "q0", "answer": "1", "images": ["pics/a.png"]},
            {"question": "q1", "answer": "1", "images": ["pics/a.png", "pics/missing.png"]},
            {"question": "q2", "answer": "1", "images": []},
            {"question": "q3", "answer": "1", "images": [str(tmp_path / "pics" / "a.png")]},
            {"question": "q4", "answer": "1", "images": [str(tmp_path / "nowhere.png")]}]
    p = _jsonl(tmp_path / "v.jsonl", rows)
    report = validate_dataset(open_data(p))
    assert report.problems == [
        f"{p} line 2 (row 1) column 'images' item 1: 'pics/missing.png' does not exist (resolved to "
        f"'{tmp_path}/pics/missing.png')",
        f"{p} line 5 (row 4) column 'images' item 0: '{tmp_path}/nowhere.png' does not exist (resolved to "
        f"'{tmp_path}/nowhere.png')"]
    assert validate_dataset(open_data(p), Needs(media=False)).ok  # media not checked: nothing else is wrong
    # HF image features: {bytes, path} structs, bytes win over the path
    feats = [{"question": "q", "answer": "1", "image": {"bytes": b"\x89PNG", "path": "gone.png"}},
             {"question": "q", "answer": "1", "image": {"bytes": None, "path": "gone.png"}},
             {"question": "q", "answer": "1", "image": {"bytes": None, "path": "pics/a.png"}}]
    pq.write_table(pa.Table.from_pylist(feats), tmp_path / "f.parquet")
    report = validate_dataset(open_data(str(tmp_path / "f.parquet")))
    assert report.bad_rows == 1 and report.problems[0].startswith(f"{tmp_path}/f.parquet row 1 column 'image' item 0: "
                                                                 "'gone.png' does not exist")


def test_a_grader_that_reads_no_answer_accepts_rows_without_one(tmp_path, tiny_model):
    from rft_core.stages import prompts as prompts_stage
    from rft_core.stages.contracts import PromptsInput
    from schemas import read_shard

    rows = [_good(i) for i in range(4)]
    rows[1]["answer"] = None
    rows[2]["answer"] = " "
    p = _jsonl(tmp_path / "a.jsonl", rows)
    cfg = _cfg(tmp_path, p, **FORMAT_ONLY, **{"policy.path": tiny_model, "data.prompts_per_iteration": 4})
    assert not cfg.reward.needs_reference and _cfg(tmp_path, p).reward.needs_reference
    assert Needs.of(cfg.reward) == Needs(answer=False, recipe_labels=("any",))
    report = validate_run_data(cfg)
    assert report.ok and report.rows == 4
    # the prompts stage takes them too, with an empty reference
    ref = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, answer_required=False,
                                         out=str(tmp_path / "run" / "prompts")))
    got = {r["question"]: r["answer"] for r in read_shard(ref, stage="prompts").to_pylist()}
    assert got == {"What is 0 + 0?": "0", "What is 1 + 1?": "", "What is 2 + 2?": " ", "What is 3 + 3?": "6"}
    # a file without any answer column, too
    q = _jsonl(tmp_path / "q.jsonl", [{"question": "q"}])
    assert validate_run_data(_cfg(tmp_path, q, **FORMAT_ONLY)).ok
    with pytest.raises(DatasetError, match="no answer column"):
        validate_run_data(_cfg(tmp_path, q))


def test_cached_by_fingerprint_so_a_resume_does_not_read_again(tmp_path, monkeypatch):
    scans = []
    real = validate_mod.validate_dataset
    monkeypatch.setattr(validate_mod, "validate_dataset", lambda *a, **kw: scans.append(1) or real(*a, **kw))
    p = _jsonl(tmp_path / "d.jsonl", [_good(i) for i in range(5)])
    cfg = _cfg(tmp_path, p)
    first = validate_run_data(cfg)
    assert (first.ok, first.cached, first.rows, len(scans)) == (True, False, 5, 1)
    markers = list((tmp_path / "run" / CHECKS_DIR).glob("*.json"))
    assert len(markers) == 1 and json.loads(markers[0].read_text())["rows"] == 5
    again = validate_run_data(cfg)
    assert (again.cached, again.rows, len(scans)) == (True, 5, 1)  # found the marker: no row read
    assert "validated before" in again.summary()
    # other graders' needs, or edited data: validated again
    validate_run_data(_cfg(tmp_path, p, **FORMAT_ONLY))
    assert len(scans) == 2
    _jsonl(tmp_path / "d.jsonl", [_good(i) for i in range(5)] + [{"question": "new", "answer": None}])
    with pytest.raises(DataValidationError, match=re.escape(f"{p} line 6 (row 5): no answer")):
        validate_run_data(cfg)
    assert len(scans) == 3
    # the marker goes through fsspec: a run root on an object store works the same
    clean = _jsonl(tmp_path / "e.jsonl", [_good(i) for i in range(5)])
    remote = load_config(None, {"run_root": f"memory://runs/{tmp_path.name}", "data.source": "files", "data.path": clean,
                                "reward.grader": "math_verify"})
    assert not validate_run_data(remote).cached and validate_run_data(remote).cached and len(scans) == 4


def test_messages_checked_column_wise_agree_with_the_row_check(tmp_path):
    """Every row the vectorised checks flag is one the prompts stage's own row check refuses, and
    the reverse: chat messages, content parts, answers as messages."""
    u = lambda text: {"role": "user", "content": text}  # noqa: E731
    prompts = [[u("hi")], [], None, [{"role": "system", "content": "s"}, u("  ")], [{"role": "robot", "content": "x"}],
               [{"role": "user", "content": None}], [{"role": "system", "content": "s"}], [u("a"), {"role": None, "content": "b"}],
               [{"role": "assistant", "content": "a"}, u("ok")]]
    rows = [{"prompt": pr, "answer": "1"} for pr in prompts]
    p = _jsonl(tmp_path / "m.jsonl", rows)
    _agree(open_data(p))
    parts = [[{"type": "text", "text": "hi"}], [{"type": "image"}], [{"type": "text", "text": " "}], [{"type": "audio"}],
             [{"type": "text", "text": None}, {"type": "video_url"}], [], [{"type": None}]]
    rows = [{"prompt": [{"role": "user", "content": c}], "answer": [{"role": "assistant", "content": a}]}
            for c, a in zip(parts, ["1", "2", " ", "3", "4", "5", "6"])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "parts.parquet")
    _agree(open_data(str(tmp_path / "parts.parquet")))


def _agree(ds):
    part, layout = ds.parts[0], ds.layouts[0]
    batch = part.table.combine_chunks().to_batches()[0] if hasattr(part, "table") else \
        pq.read_table(ds.files.paths[0]).combine_chunks().to_batches()[0]
    flagged = np.zeros(len(batch), dtype=bool)
    for mask, _, _ in check_batch(batch, layout, Needs(), base_dir=part.base_dir):
        flagged |= mask
    refused = []
    for i, values in enumerate(batch.to_pylist()):
        try:
            ds._entry(0, i, values)
            refused.append(False)
        except DatasetError:
            refused.append(True)
    assert flagged.tolist() == refused and any(refused) and not all(refused)


def test_graders_needs_code_exec_metadata_and_answer_types(tmp_path):
    code = {"reward.sources": {"tests": {"type": "code_exec"}}, "reward.recipes": {"any": [{"source": "tests"}]},
            "reward.default_recipe": "any"}
    p = _jsonl(tmp_path / "c.jsonl", [{"question": "q", "test": "assert f()", "entry_point": "f"},
                                      {"question": "q", "test": "assert f()", "entry_point": None}])
    with pytest.raises(DataValidationError) as err:
        validate_run_data(_cfg(tmp_path, p, **code))
    assert err.value.report.problems == [f"{p} line 2 (row 1) column 'entry_point': null; the code_exec grader reads it"]
    q = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "entry_point": "f"}])
    with pytest.raises(DataValidationError, match=re.escape(f"{q}: no column 'test'; the code_exec grader reads it")):
        validate_run_data(_cfg(tmp_path, q, **code))
    # math_answer compares text: a struct answer cannot be read; a number or chat messages can
    pq.write_table(pa.table({"question": ["q"], "answer": [{"value": 3}]}), tmp_path / "s.parquet")
    with pytest.raises(DataValidationError, match=r"s.parquet: column 'answer' \(used as answer\) has type struct"):
        validate_run_data(_cfg(tmp_path, tmp_path / "s.parquet"))
    pq.write_table(pa.table({"question": ["q"], "answer": [3]}), tmp_path / "n.parquet")
    assert validate_run_data(_cfg(tmp_path, tmp_path / "n.parquet")).ok


def test_labels_without_a_reward_recipe(tmp_path):
    recipes = {"reward.sources": {"em": {"type": "exact_match"}}, "reward.recipes": {"gsm8k": [{"source": "em"}]}}
    p = _jsonl(tmp_path / "l.jsonl", [{**_good(0), "data_source": "gsm8k"}, {**_good(1), "data_source": "other"},
                                      {**_good(2), "data_source": None}, {**_good(3), "data_source": ""}])
    with pytest.raises(DataValidationError) as err:
        validate_run_data(_cfg(tmp_path, p, **recipes))
    report = err.value.report
    assert report.bad_rows == 3 and report.problems[0] == (
        f"{p} line 2 (row 1) column 'data_source': a label without a reward recipe (recipes: gsm8k; "
        "reward.default_recipe is not set)")
    assert validate_run_data(_cfg(tmp_path, p, **recipes, **{"reward.default_recipe": "gsm8k"})).ok
    # a file without a data_source column: its name is every row's label, checked once
    q = _jsonl(tmp_path / "gsm8k.jsonl", [_good(0)])
    assert validate_run_data(_cfg(tmp_path, q, **recipes)).ok
    r = _jsonl(tmp_path / "math.jsonl", [_good(0)])
    with pytest.raises(DataValidationError, match=re.escape(f"{r}: its rows' label 'math' has no reward recipe")):
        validate_run_data(_cfg(tmp_path, r, **recipes))


def test_mixtures_are_validated_and_the_heldout_file_is_left_to_rft_eval(tmp_path):
    """Every source of a mixture is checked, each named by its config key; eval.path is not read
    by a training run (the train flow runs no evaluation), so a bad or missing held-out file
    does not stop it (issue 38: configs/grpo_my_data.yaml with one's own data.path)."""
    a = _jsonl(tmp_path / "a.jsonl", [_good(i) for i in range(3)])
    b = _jsonl(tmp_path / "b.jsonl", [_good(0), {"question": "q", "answer": None}])
    held = _jsonl(tmp_path / "held.jsonl", [_good(0), {"question": None, "answer": "1"}])
    mixture = {"run_root": str(tmp_path / "run"), "data.source": "files", "reward.grader": "math_verify",
               "data.sources": [{"path": a, "weight": 2}, {"path": b}]}
    with pytest.raises(DataValidationError) as err:
        validate_run_data(load_config(None, {**mixture, "eval.path": held}))
    assert err.value.report.problems == [f"{b} line 2 (row 1): no answer (column 'answer' is None)"]
    assert err.value.report.rows == 5  # the held-out file's rows are not among them
    assert str(err.value).splitlines()[0].endswith(f"in data.sources[0].path '{a}', data.sources[1].path '{b}'")
    # the same files, fixed: the run validates with a bad eval.path and with a missing one
    b = _jsonl(tmp_path / "b.jsonl", [_good(0), _good(1)])
    for eval_path in (held, str(tmp_path / "no-such-test.jsonl")):
        report = validate_run_data(load_config(None, {**mixture, "eval.path": eval_path}), use_cache=False)
        assert report.ok and report.rows == 5 and report.datasets == [f"data.sources[0].path '{a}', data.sources[1].path '{b}'"]
    assert report.summary().startswith(f"data.sources[0].path '{a}', data.sources[1].path '{b}': all 5 rows valid")
    # a generated task: nothing to validate, nothing read
    plain = load_config(None, {"run_root": str(tmp_path / "run2"), "eval.path": held})
    assert validate_run_data(plain).ok and validate_run_data(plain).rows == 0


def test_an_unopenable_dataset_raises_its_own_error(tmp_path):
    p = _jsonl(tmp_path / "x.jsonl", [{"question": "q", "label": "1"}])
    with pytest.raises(DatasetError, match="no answer column"):
        validate_run_data(_cfg(tmp_path, p))
    assert validate_run_data(_cfg(tmp_path, p, **{"data.columns": {"answer": "label"}})).ok
    assert isinstance(FileDataset(p, require_answer=False), FileDataset)


def test_the_dataset_grader_needs_reasoning_gym_labels(tmp_path):
    """The demo config (reward.grader=dataset: reasoning-gym's own scorer, picked by each row's
    label) on a user's file is refused before any stage, naming both keys and the fix; rows
    labelled with reasoning-gym names pass; a label whose own recipe does not use it passes."""
    plain = _jsonl(tmp_path / "mine.jsonl", [_good(i) for i in range(5)])
    with pytest.raises(DataValidationError) as err:
        validate_run_data(_cfg(tmp_path, plain, **{"reward.grader": "dataset"}))
    msg = str(err.value)
    assert "mine.jsonl: every row's label 'mine' names no reasoning-gym dataset, but reward.grader=dataset" in msg
    assert "(data.source=files): set reward.grader=math_verify" in msg and "labelled with its name" in msg
    assert not (tmp_path / "run" / "_data_checks").exists()
    # labels from a column: only the rows with a foreign label, by line
    rows = [{**_good(i), "data_source": "chain_sum" if i != 2 else "openai/gsm8k"} for i in range(5)]
    labelled = _jsonl(tmp_path / "labelled.jsonl", rows)
    with pytest.raises(DataValidationError) as err:
        validate_run_data(_cfg(tmp_path, labelled, **{"reward.grader": "dataset"}))
    assert err.value.report.bad_rows == 1 and err.value.report.problems[0].startswith(f"{labelled} line 3 (row 2)")
    assert "label 'openai/gsm8k' names no reasoning-gym dataset" in err.value.report.problems[0]
    ok_rows = _jsonl(tmp_path / "rg.jsonl", [{**_good(i), "data_source": "chain_sum"} for i in range(5)])
    assert validate_run_data(_cfg(tmp_path, ok_rows, **{"reward.grader": "dataset"})).ok
    # a recipe per label: 'openai/gsm8k' is graded by math_verify, chain_sum by reasoning-gym's scorer
    recipes = {"reward.sources": {"rg": {"type": "math_answer", "grader": "dataset"},
                                  "mv": {"type": "math_answer", "grader": "math_verify"}},
               "reward.recipes": {"chain_sum": [{"source": "rg"}], "openai/gsm8k": [{"source": "mv"}]}}
    assert validate_run_data(_cfg(tmp_path, labelled, **recipes)).ok
    with pytest.raises(DataValidationError, match=r"label 'mine' names no reasoning-gym dataset, but "
                                                  r"reward.sources.rg.grader=dataset"):
        validate_run_data(_cfg(tmp_path, plain, **recipes, **{"reward.default_recipe": "chain_sum"}))
