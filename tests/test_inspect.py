"""Inspecting a run: status, samples, exports, the CLI, and direct loading with pandas, DuckDB
and datasets (no Prefect: the run is built by calling the stage programs)."""
from __future__ import annotations

import json
import zlib

import pytest

from rft_core import stages
from rft_core.stages.contracts import AdvantagesInput, PromptsInput, RewardsInput, RolloutInput
from rft_core.config import load_config
from rft_core.inspect import export_table, run_status, samples_view
from rft_core.rewards.math import RewardResult
from schemas import read_shard, stage_uri


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr("rft_core.rewards.math.score_response",
               lambda text, **kw: RewardResult(float(zlib.crc32(text.encode()) % 2), False, "7", {"correctness": 0.0}))
    cfg = load_config(None, [f"policy.path={tiny_model}", "data.prompts_per_iteration=2", "rollout.n_samples_per_prompt=3",
                             "rollout.max_new_tokens=5", "kl.kl_coef=0"])
    root = str(tmp_path_factory.mktemp("inspect") / "run")
    p = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=stage_uri(root, 1, "prompts")))
    r = stages.rollout.run(RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, out=stage_uri(root, 1, "rollout")))
    w = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=stage_uri(root, 1, "rewards")))
    stages.advantages.run(AdvantagesInput(rollout=r, rewards=w, kl=cfg.kl, advantage=cfg.advantage, state=cfg.initial_state, out=stage_uri(root, 1, "advantages")))
    (tmp_path_factory.getbasetemp() / "inspect0/run/iter=000001/ppo_update").mkdir()  # an interrupted stage
    mp.undo()
    return root


def test_run_status(run):
    rows = {(r["iteration"], r["stage"]): r for r in run_status(run)}
    assert rows[(1, "rollout")]["status"] == "committed" and rows[(1, "rollout")]["rows"] == 6
    assert rows[(1, "rollout")]["bytes"] > 0 and rows[(1, "prompts")]["rows"] == 2
    assert rows[(1, "ppo_update")]["status"] == "incomplete"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_status(run + "-nope")


def test_samples_view_and_exports(run, tmp_path):
    view = samples_view(run, 1)
    assert view.num_rows == 6
    assert {"question", "response_text", "rewards", "advantage_mean", "kl_sum"} <= set(view.column_names)
    rewards = read_shard(stage_uri(run, 1, "rewards")).to_pandas().set_index("sample_id").rewards
    for row in view.to_pylist():
        assert row["rewards"] == rewards[row["sample_id"]]
    export_table(view, str(tmp_path / "v.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [x["sample_id"] for x in lines] == view.column("sample_id").to_pylist()
    export_table(read_shard(stage_uri(run, 1, "rollout")), str(tmp_path / "r.csv"))  # list columns as JSON text
    import pandas as pd

    back = pd.read_csv(tmp_path / "r.csv")
    assert len(back) == 6 and json.loads(back.response_token_ids[0]) == read_shard(stage_uri(run, 1, "rollout")).column("response_token_ids")[0].as_py()
    with pytest.raises(ValueError, match=".csv or .jsonl"):
        export_table(view, str(tmp_path / "v.xlsx"))


def test_cli_inspect(run, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, ["inspect", run])
    assert res.exit_code == 0 and "rollout" in res.output and "incomplete" in res.output
    res = CliRunner().invoke(app, ["inspect", run, "-i", "1", "-n", "2"], env={"COLUMNS": "250"})
    assert res.exit_code == 0 and "response_text" in res.output and res.output.count("basic_arithmetic-") == 2
    res = CliRunner().invoke(app, ["inspect", run, "-i", "1", "--stage", "rewards", "--export", str(tmp_path / "w.jsonl")])
    assert res.exit_code == 0 and len((tmp_path / "w.jsonl").read_text().splitlines()) == 6
    res = CliRunner().invoke(app, ["inspect", run, "-i", "1", "--stage", "ppo_update"])
    assert res.exit_code == 2 and "no _MANIFEST.json" in res.output


def test_shards_load_with_pandas_duckdb_and_datasets(run):
    import duckdb
    import pandas as pd
    from datasets import load_dataset

    folder = f"{run}/iter=000001/rollout"
    df = pd.read_parquet(folder)
    assert len(df) == 6 and set(df.columns) >= {"sample_id", "response_token_ids", "rollout_logprobs"}
    joined = duckdb.sql(
        f"select r.sample_id, r.response_text, w.rewards from '{folder}/*.parquet' r "
        f"join '{run}/iter=000001/rewards/*.parquet' w using (sample_id) order by r.sample_id").fetchall()
    assert len(joined) == 6
    ds = load_dataset("parquet", data_files=f"{folder}/*.parquet", split="train")
    assert ds.num_rows == 6 and ds.features["response_token_ids"].feature.dtype == "int32"
