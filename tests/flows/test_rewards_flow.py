"""The reward engine inside the flow: HumanEval prompts scored by the code-execution sandbox and
a user function, with every per-source score and reason in the rewards shard."""
from __future__ import annotations

import json

from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg


def test_humaneval_iteration_with_code_exec_reward(prefect_harness, tiny_model, tmp_path):
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{
        "data.task": "humaneval", "data.size": 20, "data.max_prompt_tokens": 1024, "data.prompts_per_iteration": 2,
        "reward.sources": {"tests": {"type": "code_exec", "timeout_s": 5},
                           "fenced": {"type": "python", "function": "rft_core.rewards.code:has_code_block"}},
        "reward.recipes": {"humaneval": [{"source": "tests", "weight": 1.0}, {"source": "fenced", "weight": 0.1}]},
    })
    result = train(cfg)
    root = f"{cfg.run_root}/iter=000001"
    prompts = read_shard(f"{root}/prompts").to_pylist()
    assert {p["data_source"] for p in prompts} == {"humaneval"}
    meta = json.loads(prompts[0]["metadata_json"])
    assert meta["task_id"].startswith("HumanEval/") and "def check(candidate)" in meta["test"]
    rewards = read_shard(f"{root}/rewards").to_pylist()
    assert len(rewards) == 8
    for r in rewards:
        m = dict(r["reward_metrics"])
        assert set(m) >= {"tests", "fenced", "tests.seconds"}
        # the reward is exactly the recipe's weighted sum of the per-source scores in the shard
        assert abs(r["rewards"] - (m["tests"] + 0.1 * m["fenced"])) < 1e-6
        # a random tiny model never passes: each failure says why
        assert m["tests"] == 0.0 and r["correct"] is False and dict(r["reward_reasons"])["tests"]
    summary = read_manifest(f"{root}/rewards")[0].summary
    assert summary["reward_sources"]["tests"]["n"] == 8 and summary["reward_fallbacks"] == 0
    assert result.metrics[0]["reward_fallbacks"] == 0
