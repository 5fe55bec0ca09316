"""Training on your own data through the flows (issue 17): two iterations of the tiny model from a
Parquet file whose rows reach the prompts shards exactly; a resume that reuses every stage; an
edited file refused by name; a bad column mapping failing before anything is committed; the
held-out evaluation from `eval.path`."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg

N_ROWS = 12


def _write(path: Path, n: int = N_ROWS, *, prefix: str = "What is") -> list[dict]:
    # data_source: reasoning-gym names, so the default grader (patched by fake_rewards) accepts the labels
    rows = [{"question": f"{prefix} {i} + {i + 1}?", "answer": str(2 * i + 1),
             "data_source": "basic_arithmetic" if i % 2 else "chain_sum",
             "extra_info": {"index": i, "split": "train"}, "level": i % 4} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    return rows


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0].startswith("iter=")}


def _cfg(tiny_model, tmp_path, **extra):
    return flow_cfg(tiny_model, tmp_path / "run", **{"data.source": "files", "data.path": str(tmp_path / "train.parquet"),
                                                      **extra})


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_two_iterations_from_a_parquet_file_then_resume_then_edited_data(prefect_harness, tiny_model, tmp_path,
                                                                        fake_rewards):
    from flows.train import train
    from schemas import StaleShardError

    rows = _write(tmp_path / "train.parquet")
    cfg = _cfg(tiny_model, tmp_path)
    result = train(cfg)
    assert [m["iteration"] for m in result.metrics] == [1, 2]
    # the documented order: one permutation of the 12 rows (PCG64 seeded [data.seed, epoch 0]), 3 per iteration
    order = np.random.Generator(np.random.PCG64([cfg.data.seed, 0])).permutation(N_ROWS).tolist()
    for it in (1, 2):
        want = order[(it - 1) * 3: it * 3]
        table = read_shard(f"{cfg.run_root}/iter={it:06d}/prompts", stage="prompts").to_pylist()
        assert [r["prompt_id"] for r in table] == [f"train-{i:06d}" for i in want]
        assert [(r["question"], r["answer"], r["data_source"], json.loads(r["metadata_json"])) for r in table] == [
            (rows[i]["question"], rows[i]["answer"], rows[i]["data_source"],
             {"extra_info": rows[i]["extra_info"], "level": rows[i]["level"]}) for i in want]
        summary = read_manifest(f"{cfg.run_root}/iter={it:06d}/prompts")[0].summary
        assert summary["rows"] == [f"{tmp_path / 'train.parquet'} row {i}" for i in want]
        rollout = read_shard(f"{cfg.run_root}/iter={it:06d}/rollout", stage="rollout")
        assert rollout.num_rows == 3 * 4 and set(rollout.column("prompt_id").to_pylist()) == {r["prompt_id"] for r in table}
        rewards = read_shard(f"{cfg.run_root}/iter={it:06d}/rewards", stage="rewards")
        assert rewards.num_rows == 12
    assert read_shard(f"{result.final_policy.uri}").num_rows == 1

    # resume: every stage reused, no committed file touched
    root = Path(cfg.run_root)
    before = _snapshot(root)
    again = train(cfg)
    assert again.final_policy == result.final_policy and _snapshot(root) == before

    # the data file edited (one answer fixed): resuming is refused, naming the dataset
    rows[0]["answer"] = "one"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=5)
    with pytest.raises(StaleShardError, match=f"the dataset '{tmp_path / 'train.parquet'}' changed since this stage"):
        train(cfg)
    assert _snapshot(root) == before


def test_a_mapping_naming_an_absent_column_fails_before_any_commit(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.train import train
    from rft_core.data.prompts import DatasetError

    _write(tmp_path / "train.parquet")
    cfg = _cfg(tiny_model, tmp_path, **{"data.columns": {"prompt": "input"}})
    with pytest.raises(DatasetError, match=r"train.parquet: data.columns.prompt names column 'input', which is not in "
                                           r"the file; columns: \['question', 'answer', 'data_source', 'extra_info'"):
        train(cfg)
    assert list(Path(cfg.run_root).rglob("_MANIFEST.json")) == []


def test_a_jsonl_whose_fourth_line_lacks_its_answer_fails_before_any_stage(prefect_harness, tiny_model, tmp_path,
                                                                           fake_rewards):
    """Issue 30: with 3 prompts x 2 iterations this used to train iteration 1 and stop in
    iteration 2 ("bad.jsonl row 3: no answer"); every row is now checked before the first stage."""
    from flows.train import train
    from rft_core.api import DataValidationError

    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "data_source": "basic_arithmetic"} for i in range(6)]
    del rows[3]["answer"]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = flow_cfg(tiny_model, tmp_path / "run", **{"data.source": "files", "data.path": str(path)})
    with pytest.raises(DataValidationError, match=rf"{path} line 4 \(row 3\): no answer \(column 'answer' is None\)"):
        train(cfg)
    assert list(Path(cfg.run_root).rglob("_MANIFEST.json")) == [] and not list(Path(cfg.run_root).glob("iter=*"))


def test_eval_from_eval_path(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.eval import evaluate

    _write(tmp_path / "train.parquet")
    test = _write(tmp_path / "test.parquet", 7, prefix="Held out")
    cfg = _cfg(tiny_model, tmp_path, **{"eval.path": str(tmp_path / "test.parquet"), "eval.num_prompts": 5,
                                        "eval.max_new_tokens": 4, "eval.batch_size": 4})
    res = evaluate(cfg, None, str(tmp_path / "ev"))
    rows = read_shard(f"{tmp_path}/ev/eval", stage="eval").to_pylist()
    assert [(r["prompt_id"], r["question"], r["answer"]) for r in rows] == [
        (f"heldout-test-{i:06d}", test[i]["question"], test[i]["answer"]) for i in range(5)]
    assert res.num_prompts == 5 and res.accuracy == sum(r["correct"] for r in rows) / 5
