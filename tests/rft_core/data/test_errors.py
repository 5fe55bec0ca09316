"""Bad input, written to real files, gets a DatasetError naming the file, the row (or line and
byte offset) and the column: at open time for what is cheap, per row for the rows used."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.data.files import FileDataset
from rft_core.data.mixture import open_data
from rft_core.data.prompts import DatasetError


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _raises(match, fn, *args, **kw):
    with pytest.raises(DatasetError, match=match):
        fn(*args, **kw)


def test_missing_columns_and_bad_mappings(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "label": "1"}])
    _raises(re.escape(f"{p}: no answer column (looked for ['reward_model.ground_truth', 'answer', 'solution', "
                      "'ground_truth', 'completion', 'Answer']); the file has ['question', 'label']; map one with "
                      "data.columns.answer"),
            open_data, p)
    _raises(re.escape(f"{p}: data.columns.answer names column 'meta.label', which is not in the file; "
                      "columns: ['question', 'label']"), open_data, p, columns={"answer": "meta.label"})
    _raises(re.escape("data.columns: unknown key(s) ['solution']"), open_data, p, columns={"solution": "label"})
    assert open_data(p, columns={"answer": "label"}).entries([0])[0][1]["answer"] == "1"


def test_column_of_the_wrong_type(tmp_path):
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["a", "b"]}), tmp_path / "t.parquet")
    _raises(re.escape(f"{tmp_path}/t.parquet: column 'prompt' (used as prompt) has type int64: a prompt must be text "
                      "or a list of {role, content} chat messages"), open_data, str(tmp_path / "t.parquet"))
    pq.write_table(pa.table({"prompt": ["p"], "answer": ["a"], "images": [3]}), tmp_path / "i.parquet")
    _raises("column 'images' .* has type int64: images must be paths/URIs, bytes", open_data, str(tmp_path / "i.parquet"))


def test_rows_without_prompt_or_answer_fail_only_when_used(tmp_path):
    p = _jsonl(tmp_path / "r.jsonl", [{"question": "ok", "answer": "1"}, {"question": None, "answer": "2"},
                                      {"question": "q", "answer": None}, {"question": "  ", "answer": "3"},
                                      {"question": "q", "answer": ""}])
    ds = open_data(p)  # the cheap checks pass
    assert ds.entries([0])[0][1]["question"] == "ok"
    _raises(re.escape(f"{p} line 2 (row 1): no prompt (column 'question' is null)"), ds.entries, [0, 1])
    _raises(re.escape(f"{p} line 3 (row 2): no answer (column 'answer' is None)"), ds.entries, [2])
    _raises(re.escape(f"{p} line 4 (row 3): empty prompt (column 'question' is '  ')"), ds.entries, [3])
    _raises(re.escape(f"{p} line 5 (row 4): no answer (column 'answer' is '')"), ds.entries, [4])
    _raises(re.escape(f"{p}: row index 5 out of range (the dataset has 5 rows)"), ds.entries, [5])


def test_bad_messages(tmp_path):
    p = _jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
                                      {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": " "}], "answer": "1"},
                                      {"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"},
                                      {"prompt": [], "answer": "1"}])
    ds = open_data(p)
    _raises(re.escape(f"{p} line 2 (row 1) column 'prompt': empty prompt (no user message with text)"), ds.entries, [1])
    _raises(re.escape(f"{p} line 3 (row 2) column 'prompt' message 0: expected {{role: one of ['system', 'user', 'assistant', "
                      "'tool'], content}, got {'role': 'robot', 'content': 'hi'}"), ds.entries, [2])
    _raises(re.escape(f"{p} line 4 (row 3) column 'prompt': empty prompt (no messages)"), ds.entries, [3])


def test_image_path_that_does_not_exist(tmp_path):
    p = _jsonl(tmp_path / "v.jsonl", [{"question": "q", "answer": "a", "images": ["pics/missing.png"]}])
    _raises(re.escape(f"{p} line 1 (row 0) column 'images' item 0: 'pics/missing.png' does not exist (resolved to "
                      f"'{tmp_path}/pics/missing.png')"), open_data(p).entries, [0])


def test_truncated_parquet(tmp_path):
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"question": ["q"] * 100, "answer": ["a"] * 100}), path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    _raises(re.escape(f"{path}: not a readable Parquet file (truncated or another format?)"), open_data, str(path))


def test_jsonl_line_that_is_not_json_names_line_and_byte_offset(tmp_path):
    line1 = '{"question": "é?", "answer": "1"}\n'  # "é" is 2 bytes in UTF-8
    line3 = '{"question": "b", "answer": }\n'
    (tmp_path / "bad.jsonl").write_text(line1 + "\n" + line3, encoding="utf-8")
    offset = len(line1.encode("utf-8")) + 1 + line3.index("}")  # 35 (34 characters, é takes 2 bytes) + 1 + 28
    assert offset == 64
    _raises(re.escape(f"{tmp_path}/bad.jsonl line 3 (row 1): not valid JSON at byte offset 64: Expecting value"),
            open_data, str(tmp_path / "bad.jsonl"))
    (tmp_path / "arr.jsonl").write_text(line1 + "[1, 2]\n")
    _raises("arr.jsonl line 2 \\(row 1\\): a JSON Lines row must be an object, got array", open_data, str(tmp_path / "arr.jsonl"))


def test_truncated_json_array_names_byte_offset(tmp_path):
    text = '[{"question": "é", "answer": "1"},\n {"question": "b", "ans'
    (tmp_path / "t.json").write_text(text, encoding="utf-8")
    offset = len(text[:text.rindex('"')].encode("utf-8"))  # the unterminated string's quote; é counts 2 bytes
    assert offset == 55  # 54 characters before the quote, é takes 2 bytes
    _raises(re.escape(f"{tmp_path}/t.json (line 2, column 20): not valid JSON at byte offset 55: Unterminated string"),
            open_data, str(tmp_path / "t.json"))


def test_mixed_types_in_a_column(tmp_path):
    p = _jsonl(tmp_path / "x.jsonl", [{"question": "a", "answer": "1"}, {"question": "b", "answer": 2}])
    _raises(re.escape(f"{p} row 1 (line 2) column 'answer': mixed types, number here but string in row 0"), open_data, p)
    (tmp_path / "x.json").write_text(json.dumps([{"question": "a", "answer": 1}, {"question": ["b"], "answer": 2}]))
    _raises(re.escape(f"{tmp_path}/x.json row 1 column 'question': mixed types, array here but string in row 0"),
            open_data, str(tmp_path / "x.json"))
    (tmp_path / "f").mkdir()
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), tmp_path / "f" / "a.parquet")
    pq.write_table(pa.table({"question": ["b"], "answer": [2]}), tmp_path / "f" / "b.parquet")
    _raises(re.escape(f"{tmp_path}/f/b.parquet: column 'answer' (answer) has type int64, but string in "
                      f"{tmp_path}/f/a.parquet (mixed types)"), open_data, str(tmp_path / "f"))


def test_csv_row_with_wrong_field_count(tmp_path):
    (tmp_path / "c.csv").write_text("question,answer\nq1,1\nq2,2,extra\n")
    _raises(re.escape(f"{tmp_path}/c.csv row 1 (line 3): 3 fields, the header has 2 (['question', 'answer'])"),
            open_data, str(tmp_path / "c.csv"))


@pytest.mark.parametrize("weight", [0, -1.5, float("nan"), float("inf"), "3", True, None])
def test_mixture_weight_must_be_positive(tmp_path, weight):
    p = _jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "1"}])
    _raises(re.escape(f"data.sources[1] (missing.jsonl): weight must be a positive number, got {weight!r}"),
            open_data, sources=[{"path": p, "weight": 2}, {"path": "missing.jsonl", "weight": weight}])


def test_bad_paths_formats_and_sources(tmp_path):
    _raises(re.escape(f"data.path '{tmp_path}/nope.jsonl': no such file or folder"), open_data, str(tmp_path / "nope.jsonl"))
    _raises("matches no files", open_data, str(tmp_path / "*.parquet"))
    (tmp_path / "d.txt").write_text("x")
    _raises("cannot tell the format of .*d.txt.* set data.format", open_data, str(tmp_path / "d.txt"))
    _raises(re.escape("data.format 'xlsx' is not one of"), open_data, str(tmp_path / "d.txt"), format="xlsx")
    (tmp_path / "mix").mkdir()
    _jsonl(tmp_path / "mix" / "a.jsonl", [{"question": "q", "answer": "1"}])
    (tmp_path / "mix" / "b.csv").write_text("question,answer\nq,1\n")
    _raises(re.escape("files of several formats ['csv', 'jsonl']"), open_data, str(tmp_path / "mix"))
    (tmp_path / "empty.csv").write_text("question,answer\n")
    _raises(re.escape(f"{tmp_path}/empty.csv: no rows"), FileDataset, str(tmp_path / "empty.csv"))
    _raises("exactly one of data.path and data.sources", open_data)
    _raises(re.escape("data.sources[0]: needs 'path'; unknown key(s) ['wieght']"), open_data, sources=[{"path": "a", "wieght": 1}])


def test_every_open_error_names_the_config_key_of_its_path(tmp_path):
    """Issue 38: the held-out file of configs/grpo_my_data.yaml, missing, was reported as
    `data.path 'examples/data/arith_test.jsonl': no such file or folder`; each error now names the
    key the path came from (data.path, eval.path, data.sources[k].path), for a missing path and for
    a file that opens but cannot be read."""
    from rft_core.config import load_config
    from rft_core.data.mixture import data_fingerprint, heldout_fingerprint, open_data_config

    good = _jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "1"}])
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "1"}\n{"question": \n')
    broken = str(tmp_path / "broken.jsonl")
    missing = str(tmp_path / "arith_test.jsonl")
    cfg = load_config(None, {"data.source": "files", "data.path": good, "eval.path": missing})
    _raises(f"^{re.escape(f'eval.path {missing!r}: no such file or folder')}$", heldout_fingerprint, cfg.data, cfg.eval)
    _raises(f"^{re.escape(f'eval.path {missing!r}: no such file or folder')}$", FileDataset, missing, key="eval.path")
    _raises(f"^{re.escape(f'data.path {missing!r}: no such file or folder')}$", open_data, missing)
    _raises(f"^{re.escape(f'eval.path: {broken} line 2 (row 1): not valid JSON')}", FileDataset, broken, key="eval.path")
    _raises(f"^{re.escape(f'data.path: {broken} line 2 (row 1): not valid JSON')}", open_data, broken)
    # a mixture: each source by its index, whether the flow fingerprints it or opens it
    mix = load_config(None, {"data.source": "files", "data.sources": [{"path": good}, {"path": missing}]})
    _raises(f"^{re.escape(f'data.sources[1].path {missing!r}: no such file or folder')}$", open_data_config, mix.data)
    _raises(f"^{re.escape(f'data.sources[1].path {missing!r}: no such file or folder')}$", data_fingerprint,
            sources=[{"path": good}, {"path": missing}])
    _raises(f"^{re.escape(f'data.sources[0].path: {broken} line 2 (row 1): not valid JSON')}", open_data,
            sources=[{"path": broken}, {"path": good}])
    # the format key of a source is its own (falling back to data.format)
    (tmp_path / "d.txt").write_text("x")
    _raises(re.escape(f"data.sources[0].path '{tmp_path}/d.txt': cannot tell the format of '{tmp_path}/d.txt' from its "
                      "extension; set data.sources[0].format (or data.format) to one of"),
            open_data, sources=[{"path": str(tmp_path / "d.txt")}])
