"""The shared varying-reward fixture (tests/varying.py): its reward by hand, its three config forms
agree, and its checks fail on what the equality tests used to train on (every reward 0, every
advantage 0, a policy loss of 0 with only the KL gradient) and pass on a real signal."""
from __future__ import annotations

import pyarrow as pa
import pytest

from rft_core.config import load_config
from rft_core.rewards.base import RewardSample
from schemas import stage_uri, write_shard
from schemas.columns import ADVANTAGES, PPO_UPDATE, REWARDS
from tests.varying import (
    REWARD,
    REWARD_YAML,
    assert_advantages_vary,
    assert_policy_loss_nonzero,
    reward_args,
    token_reward,
)


def _sample(response: str) -> RewardSample:
    return RewardSample(sample_id="p#0", prompt_id="p", label="basic_arithmetic", question="1 + 1", prompt_text="",
                        response=response, reference="2")


def test_token_reward_by_hand():
    # crc32(b"abc") = 891568578 = 5 * 178313715 + 3; crc32(b"hello") and crc32(b"") are 0 mod 5
    assert token_reward(_sample("abc")) == 0.75
    assert token_reward(_sample("hello")) == 0.0 and token_reward(_sample("")) == 0.0


def test_the_mapping_the_strings_and_the_yaml_give_one_reward_config(tmp_path):
    a = load_config(None, REWARD).reward
    b = load_config(None, reward_args()).reward
    (tmp_path / "c.yaml").write_text(REWARD_YAML)
    c = load_config(tmp_path / "c.yaml").reward
    assert a == b == c and a.default_recipe == "varying" and a.sources["varying"].function == "tests.varying:token_reward"


def _commit(root, rewards: list[float], advantages: list[float], losses: list[float], norms: list[float]) -> str:
    """Hand-made rewards, advantages and update shards of iteration 1: two groups of two samples."""
    ids, pids = ["a#0", "a#1", "b#0", "b#1"], ["a", "a", "b", "b"]
    n = len(ids)
    write_shard(pa.table({"sample_id": ids, "prompt_id": pids, "rewards": rewards, "correct": [False] * n,
                          "extracted_answer": [None] * n, "reward_metrics": [[] for _ in ids],
                          "reward_reasons": [[] for _ in ids]}, schema=REWARDS.arrow),
                stage_uri(str(root), 1, "rewards"), schema=REWARDS, config_hash="r")
    write_shard(pa.table({"sample_id": ids, "prompt_id": pids, "shaped_rewards": rewards, "kl": [[0.0, 0.0]] * n,
                          "advantages": [[x, x] for x in advantages], "returns": [[x, x] for x in advantages]},
                         schema=ADVANTAGES.arrow), stage_uri(str(root), 1, "advantages"), schema=ADVANTAGES, config_hash="a")
    k = len(losses)
    write_shard(pa.table({"step": list(range(k)), "epoch": [0] * k, "policy_loss": losses, "kl_loss": [0.0] * k,
                          "clip_frac": [0.0] * k, "approx_kl": [0.0] * k, "grad_norm": norms, "lr": [1e-3] * k,
                          "num_tokens": [8] * k}, schema=PPO_UPDATE.arrow),
                stage_uri(str(root), 1, "ppo_update"), schema=PPO_UPDATE, config_hash="u")
    return str(root)


def test_the_checks_fail_on_zero_rewards_and_a_kl_only_update(tmp_path):
    root = _commit(tmp_path, [0.0] * 4, [0.0] * 4, [0.0, 0.0], [4e-6, 3e-6])  # the tiny model's old setting
    with pytest.raises(AssertionError, match="every group's rewards are equal"):
        assert_advantages_vary(root, 1)
    with pytest.raises(AssertionError, match="gradient norm above 1e-3"):
        assert_policy_loss_nonzero(root, 1)


def test_the_checks_pass_on_a_learning_signal_and_catch_each_part_missing(tmp_path):
    root = _commit(tmp_path / "ok", [0.0, 1.0, 0.5, 0.5], [-0.7071, 0.7071, 0.0, 0.0], [3.7e-9, -4.3e-2], [0.75, 0.73])
    assert assert_advantages_vary(root, 1) == pytest.approx(0.7071)
    assert assert_policy_loss_nonzero(root, 1) == pytest.approx(4.3e-2)
    # rewards that vary but advantages written as 0 (joined to the wrong samples, or dropped)
    root = _commit(tmp_path / "lost", [0.0, 1.0, 0.5, 0.5], [0.0] * 4, [1e-2], [0.5])
    with pytest.raises(AssertionError, match="every advantage is 0"):
        assert_advantages_vary(root, 1)
    # a policy loss but no gradient above the KL term's
    root = _commit(tmp_path / "flat", [0.0, 1.0, 0.5, 0.5], [-0.7, 0.7, 0.0, 0.0], [1e-2], [4e-6])
    with pytest.raises(AssertionError, match="gradient norm"):
        assert_policy_loss_nonzero(root, 1)
    # one on-policy step: its loss is -sum(A)/tokens = 0 whatever A is; its gradient counts
    root = _commit(tmp_path / "one", [0.0, 1.0, 0.5, 0.5], [-0.7, 0.7, 0.0, 0.0], [3.7e-9], [0.75])
    assert assert_policy_loss_nonzero(root, 1) == pytest.approx(3.7e-9)
    # several steps, each with a loss of 0: the later ones (ratio != 1) cannot all be 0 with A != 0
    root = _commit(tmp_path / "zeros", [0.0, 1.0, 0.5, 0.5], [-0.7, 0.7, 0.0, 0.0], [0.0, 0.0], [0.75, 0.7])
    with pytest.raises(AssertionError, match="policy_loss is 0 in every step"):
        assert_policy_loss_nonzero(root, 1)
