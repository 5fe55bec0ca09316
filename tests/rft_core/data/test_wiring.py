"""The data layer wired into the config and the stage programs (issue 17): `data.source: files`
validated, reasoning-gym hashes exactly as before, the prompts and held-out prompts programs read
the files (rows, order, mixtures, templates), bad rows fail before a commit, edited data is
refused by name, and the `data check` report of a config."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.config import ConfigError, load_config
from rft_core.data.mixture import dataset_fingerprint
from rft_core.data.prompts import DatasetError
from rft_core.stages import evaluate as eval_stage
from rft_core.stages import prompts as prompts_stage
from rft_core.stages.contracts import EvalPromptsInput, PromptsInput, hash_value
from rft_core.stages.prompts import DatasetChangedError
from schemas import StaleShardError, config_hash, read_manifest, read_shard

ROOT = Path(__file__).resolve().parents[3]


def write_rows(path, n, *, prefix="What is", source="basic_arithmetic", blank_answer_at=()):
    """A plain Parquet file: question, answer, data_source, difficulty (int), tags (list)."""
    rows = [{"question": f"{prefix} {i} + {i}?", "answer": " " if i in blank_answer_at else str(2 * i),
             "data_source": source, "difficulty": i % 3, "tags": [f"t{i}"]} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return rows


def files_cfg(tiny_model, **over):
    return load_config(None, {"policy.path": tiny_model, "data.source": "files", "data.prompts_per_iteration": 4,
                              "data.seed": 7, **over})


def epoch_order(seed_key, size, epoch=0):
    """Reference of the documented data order: the permutation PCG64([*key, epoch]) of range(size)."""
    return np.random.Generator(np.random.PCG64([*seed_key, epoch])).permutation(size).tolist()


# --- config --------------------------------------------------------------------------------

@pytest.mark.parametrize("over, message", [
    ({"data.source": "files"}, "needs exactly one of data.path .* got neither"),
    ({"data.source": "files", "data.path": "a.jsonl", "data.sources": [{"path": "b.jsonl"}]}, "got both"),
    ({"data.path": "a.jsonl"}, "data.path is for data.source=files, but data.source is 'reasoning_gym'"),
    ({"data.format": "csv"}, "data.format is for data.source=files"),
    ({"data.source": "files", "data.path": "a", "data.columns": {"question": "q"}},
     r"unknown key\(s\) \['question'\]; valid keys: \['prompt', 'answer', 'data_source', 'images', 'videos'\]"),
    ({"data.source": "files", "data.sources": [{"path": "a", "weight": 0}]}, "weight: Input should be greater than 0"),
    ({"data.source": "files", "data.sources": [{"path": "a", "weight": float("inf")}]}, "finite"),
    ({"data.source": "files", "data.sources": [{"path": "a", "columns": {"label": "y"}}]}, r"unknown key\(s\) \['label'\]"),
    ({"data.source": "files", "data.sources": [{"path": "a", "wieght": 2}]}, r"data.sources.0.wieght: not a setting; valid keys here: path, weight, "),
    ({"data.source": "hub"}, "data.source: Input should be 'reasoning_gym' or 'files'"),
])
def test_bad_data_config_is_refused_naming_the_key(over, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, over)


# PromptsInput(iteration=3) and EvalPromptsInput hashes of every preset, computed with the code of
# the commit before these fields existed (git archive of c7bd0f9): new defaults must not move them.
# Those hashes were made under the contracts "prompts v1" / "eval_prompts v1"; issue 21 moved both
# to v2 (the videos column) and issue 38 to v3 (GSM8K `#### N` answers), so the hash views are checked
# under the old contract ids, and the new hashes differ from them only by the contract id.
HASHES_BEFORE = {
    "grpo_demo.yaml": ("5dc0a8b4cb79c0ce", "7e355bbcd33c0403"),
    "grpo_gsm_symbolic.yaml": ("5da06e4f64042155", "2ff9017110404932"),
    "grpo_humaneval.yaml": ("db0cceb282df965d", "d35d6d010cff7c6d"),
    "grpo_learning.yaml": ("282e647bd8771414", "797cff93863345ae"),
    "grpo_scale.yaml": ("441bff535432e333", "7e5b56103ffc1a9b"),
    "grpo_vl_digits.yaml": ("28ae3b3fcd3b4b88", "0d3500a9ab6eb6dd"),
}


@pytest.mark.parametrize("preset", sorted(HASHES_BEFORE))
def test_reasoning_gym_presets_load_and_hash_as_before(preset):
    cfg = load_config(ROOT / "configs" / preset)
    p = PromptsInput(data=cfg.data, tokenizer_path=cfg.policy.path, iteration=3, out="x")
    e = EvalPromptsInput(data=cfg.data, eval=cfg.eval, tokenizer_path=cfg.policy.path, out="x")
    got = (config_hash("prompts v1", p.hash_view(), {}), config_hash("eval_prompts v1", e.hash_view(), {}))
    assert got == HASHES_BEFORE[preset]
    assert (p.contract, e.contract) == ("prompts v3", "eval_prompts v3")
    assert (p.config_hash(), e.config_hash()) == (config_hash("prompts v3", p.hash_view(), {}),
                                                  config_hash("eval_prompts v3", e.hash_view(), {}))
    assert dataset_fingerprint(cfg.data) is None
    assert not {"path", "format", "columns", "sources", "prompt_template"} & set(hash_value(cfg.data))


def test_my_data_preset_loads_as_files():
    cfg = load_config(ROOT / "configs" / "grpo_my_data.yaml")
    assert (cfg.data.source, cfg.data.path, cfg.eval.path) == ("files", "examples/data/arith_trl.jsonl",
                                                               "examples/data/arith_test.jsonl")


# --- the prompts program ---------------------------------------------------------------------

def test_prompts_from_a_parquet_file_rows_order_and_resume(tmp_path, tiny_model):
    rows = write_rows(tmp_path / "train.parquet", 10)
    cfg = files_cfg(tiny_model, **{"data.path": str(tmp_path / "train.parquet")})
    order = epoch_order((7,), 10) + epoch_order((7,), 10, epoch=1)
    refs = []
    for it in (1, 2, 3):
        out = str(tmp_path / f"p{it}")
        ref = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=it, out=out))
        refs.append(ref)
        want = order[(it - 1) * 4: it * 4]  # iteration 3 crosses into the second epoch
        table = read_shard(ref, stage="prompts").to_pylist()
        assert [r["prompt_id"] for r in table] == [f"train-{i:06d}" for i in want]
        assert [(r["question"], r["answer"], r["data_source"]) for r in table] == [
            (rows[i]["question"], rows[i]["answer"], rows[i]["data_source"]) for i in want]
        assert [json.loads(r["metadata_json"]) for r in table] == [
            {"difficulty": rows[i]["difficulty"], "tags": rows[i]["tags"]} for i in want]
        summary = read_manifest(out)[0].summary
        assert summary["dataset_indices"] == want and summary["dataset_rows"] == 10
        assert summary["rows"] == [f"{tmp_path / 'train.parquet'} row {i}" for i in want]
    # the fingerprint the program filled in is the one the flow passes: same hash, reused as is
    fp = dataset_fingerprint(cfg.data)
    again = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p1"),
                                           data_fingerprint=fp))
    assert again == refs[0] and read_manifest(refs[0].uri)[0].summary["data_fingerprint"] == fp
    # the file edited: the committed stage is refused naming the dataset, and left as it was
    before = (tmp_path / "p1" / "_MANIFEST.json").read_bytes()
    write_rows(tmp_path / "train.parquet", 11)
    with pytest.raises(DatasetChangedError, match=f"the dataset '{tmp_path / 'train.parquet'}' changed since this stage"):
        prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p1")))
    assert issubclass(DatasetChangedError, StaleShardError)
    assert (tmp_path / "p1" / "_MANIFEST.json").read_bytes() == before
    # a fingerprint that no longer matches the files when the program reads them
    with pytest.raises(DatasetError, match="changed while the stage ran"):
        prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p9"),
                                       data_fingerprint=fp))
    assert not (tmp_path / "p9").exists()


def test_a_dynamic_sampling_refill_takes_its_own_stream(tmp_path, tiny_model):
    rows = write_rows(tmp_path / "t.parquet", 9)
    cfg = files_cfg(tiny_model, **{"data.path": str(tmp_path / "t.parquet")})
    ref = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=2, attempt=1,
                                         out=str(tmp_path / "p")))
    # reference: 4 distinct rows drawn by PCG64([seed, 1, iteration, attempt]) (apart from the main order)
    want = np.random.Generator(np.random.PCG64([7, 1, 2, 1])).choice(9, size=4, replace=False).tolist()
    assert [r["question"] for r in read_shard(ref, stage="prompts").to_pylist()] == [rows[i]["question"] for i in want]


def test_a_mixture_draws_each_source_in_its_own_order(tmp_path, tiny_model):
    a = write_rows(tmp_path / "a.parquet", 6, prefix="A")
    b = [{"question": f"B{i}", "answer": str(i)} for i in range(5)]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in b))
    sources = [{"path": str(tmp_path / "a.parquet"), "weight": 3}, {"path": str(tmp_path / "b.jsonl"), "data_source": "bee"}]
    # 'bee' names no reasoning-gym dataset: the dataset grader is refused (docs/config.md), math_verify grades it
    cfg = files_cfg(tiny_model, **{"data.sources": sources, "data.prompts_per_iteration": 8, "reward.grader": "math_verify"})
    ref = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p")))
    # reference of the documented draw: counts ~ Multinomial(8, [3/4, 1/4]) and the slot order from
    # PCG64([seed, 2, iteration]); each source's rows from its own stream PCG64([seed, 3, s, epoch])
    rng = np.random.Generator(np.random.PCG64([7, 2, 1]))
    counts = rng.multinomial(8, np.array([3.0, 1.0]) / 4)
    labels = rng.permutation(np.repeat([0, 1], counts))
    streams = {s: iter(epoch_order((7, 3, s), size)) for s, size in ((0, 6), (1, 5))}
    want = [(int(s), next(streams[int(s)])) for s in labels]
    got = read_shard(ref, stage="prompts").to_pylist()
    assert [r["question"] for r in got] == [a[i]["question"] if s == 0 else b[i]["question"] for s, i in want]
    assert [r["data_source"] for r in got] == ["basic_arithmetic" if s == 0 else "bee" for s, _ in want]
    assert [r["prompt_id"] for r in got] == [f"mixture-{i if s == 0 else 6 + i:06d}" for s, i in want]
    where = read_manifest(ref.uri)[0].summary["rows"]
    assert where == [f"{tmp_path}/a.parquet row {i}" if s == 0 else f"{tmp_path}/b.jsonl line {i + 1} (row {i})"
                     for s, i in want]


def test_a_bad_row_fails_before_anything_is_written(tmp_path, tiny_model):
    write_rows(tmp_path / "t.parquet", 8, blank_answer_at=range(8))
    cfg = files_cfg(tiny_model, **{"data.path": str(tmp_path / "t.parquet")})
    first = epoch_order((7,), 8)[0]
    with pytest.raises(DatasetError, match=rf"t.parquet row {first}: no answer \(column 'answer' is ' '\)"):
        prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p")))
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())
    # a mapping naming a column the file does not have: refused at open time, naming both
    cfg = files_cfg(tiny_model, **{"data.path": str(tmp_path / "t.parquet"), "data.columns": {"answer": "label"}})
    with pytest.raises(DatasetError, match="data.columns.answer names column 'label', which is not in the file"):
        prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "q")))
    assert not (tmp_path / "q").exists() or not any((tmp_path / "q").iterdir())


def test_prompt_template_renders_plain_text(tmp_path, tiny_model):
    from rft_core.models.loading import load_tokenizer

    rows = write_rows(tmp_path / "t.parquet", 5)
    cfg = files_cfg(tiny_model, **{"data.path": str(tmp_path / "t.parquet"), "data.prompt_template": "Q: {prompt}\nA:"})
    ref = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "p")))
    tok = load_tokenizer(tiny_model)
    for r in read_shard(ref, stage="prompts").to_pylist():
        i = int(r["prompt_id"].rsplit("-", 1)[1])
        assert r["prompt_text"] == f"Q: {rows[i]['question']}\nA:"
        assert r["prompt_token_ids"] == tok(f"Q: {rows[i]['question']}\nA:")["input_ids"]


# --- held-out prompts ------------------------------------------------------------------------

def test_heldout_prompts_from_eval_path(tmp_path, tiny_model):
    test = write_rows(tmp_path / "test.parquet", 5, prefix="Held")
    write_rows(tmp_path / "train.parquet", 10)
    cfg = files_cfg(tiny_model, **{"data.path": str(tmp_path / "train.parquet"), "eval.num_prompts": 3})
    with pytest.raises(DatasetError, match="eval.path is not set"):
        eval_stage.run_prompts(EvalPromptsInput(data=cfg.data, eval=cfg.eval, tokenizer_path=tiny_model,
                                                out=str(tmp_path / "e0")))
    assert not (tmp_path / "e0").exists()
    ev = cfg.eval.model_copy(update={"path": str(tmp_path / "test.parquet")})
    ref = eval_stage.run_prompts(EvalPromptsInput(data=cfg.data, eval=ev, tokenizer_path=tiny_model, out=str(tmp_path / "e")))
    got = read_shard(ref, stage="prompts").to_pylist()
    assert [(r["prompt_id"], r["question"], r["answer"]) for r in got] == [
        (f"heldout-test-{i:06d}", test[i]["question"], test[i]["answer"]) for i in range(3)]
    # all rows when the file has fewer than num_prompts; an edited file is refused by name
    ev10 = ev.model_copy(update={"num_prompts": 10})
    ref = eval_stage.run_prompts(EvalPromptsInput(data=cfg.data, eval=ev10, tokenizer_path=tiny_model, out=str(tmp_path / "f")))
    assert ref.num_rows == 5
    write_rows(tmp_path / "test.parquet", 6, prefix="Held")
    with pytest.raises(DatasetChangedError, match="test.parquet' changed since this stage was committed"):
        eval_stage.run_prompts(EvalPromptsInput(data=cfg.data, eval=ev10, tokenizer_path=tiny_model,
                                                out=str(tmp_path / "f")))


# --- data check of a config ------------------------------------------------------------------

def test_check_config_data_of_a_mixture_and_of_a_path(tmp_path, tiny_model):
    from rft_core.data.check import check_config_data

    write_rows(tmp_path / "a.parquet", 6)
    write_rows(tmp_path / "b.parquet", 4, blank_answer_at={1, 3})
    sources = [{"path": str(tmp_path / "a.parquet"), "weight": 2}, {"path": str(tmp_path / "b.parquet")}]
    cfg = files_cfg(tiny_model, **{"data.sources": sources})
    report = check_config_data(cfg)
    assert [(s.rows, s.weight) for s in report.sources] == [(6, 2.0), (4, 1.0)]
    assert report.rows == 10 and report.bad_rows == 2 and not report.ok
    assert [p.split(": ", 1)[0] for p in report.problems] == [f"{tmp_path / 'b.parquet'} row {i}" for i in (1, 3)]
    assert len(report.examples) == 2 and report.examples[0].answer == "0"
    one = check_config_data(cfg, str(tmp_path / "a.parquet"))
    assert one.ok and one.rows == 6 and len(one.sources) == 1
    none = check_config_data(load_config(None, {"policy.path": tiny_model}))
    assert not none.ok and "give a PATH" in none.problems[0]
