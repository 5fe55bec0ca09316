"""One vision-language GRPO iteration through the Prefect flow: digit images in the prompt and
rollout shards (bit-exact), a mixed text/image batch, exact-match rewards, the update, and a
checkpoint that loads again as a VL model folder."""
from __future__ import annotations

import pytest

from schemas import read_shard
from tests.flows.conftest import flow_cfg


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from rft_core.models.vl import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlflow") / "tiny-vl")


def test_vl_iteration(prefect_harness, tiny_vl, tmp_path):
    from flows.train import train
    from rft_core.data.prompts import load_task
    from rft_core.models.vl import VLProcessor, is_vl_model

    task_config = {"images_per_prompt": 2, "text_only_fraction": 0.3}
    cfg = flow_cfg(tiny_vl, tmp_path / "run", iterations=1, **{
        "data.task": "vl_digits", "data.size": 40, "data.task_config": task_config, "data.prompts_per_iteration": 4,
        "data.system_prompt": "", "rollout.n_samples_per_prompt": 3, "rollout.max_new_tokens": 4,
        "reward.sources": {"exact": {"type": "exact_match"}}, "reward.recipes": {"vl_digits": [{"source": "exact"}]},
    })
    result = train(cfg)
    root = f"{cfg.run_root}/iter=000001"
    prompts = read_shard(f"{root}/prompts").to_pylist()
    rollout = read_shard(f"{root}/rollout").to_pylist()
    ds = load_task("vl_digits", size=40, seed=cfg.data.seed, task_config=task_config)
    by_id = {p["prompt_id"]: p for p in prompts}
    assert len(rollout) == 12 and {len(p["images"]) for p in prompts} <= {0, 2}
    for p in prompts:
        assert p["images"] == ds[int(p["prompt_id"].rsplit("-", 1)[1])]["images"]
    for r in rollout:  # each sample carries its prompt's images and image tokens, bit-exact
        assert r["images"] == by_id[r["prompt_id"]]["images"]
        assert r["prompt_token_ids"] == by_id[r["prompt_id"]]["prompt_token_ids"]
    rewards = read_shard(f"{root}/rewards").to_pylist()
    assert all(set(dict(w["reward_metrics"])) >= {"exact"} for w in rewards)
    assert read_shard(f"{root}/ppo_update").num_rows >= 1
    ckpt = result.final_policy_folder
    assert is_vl_model(ckpt) and VLProcessor(ckpt).image_token_id == VLProcessor(tiny_vl).image_token_id
