"""Issue 16 end to end: two iterations of the flow on the tiny model with the demo preset's KL
and estimator settings (and with the demo's former ones, the KL as a k1 reward penalty). Read
from the committed shards: every group whose task rewards are all equal has advantages no
larger in magnitude than its own KL term (exactly minus it in reward mode, zero in loss mode),
the KL loss acts in iteration 2, and the rollout correction's metrics reach metrics.jsonl."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from rft_core.config import load_config
from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg


def _half_flat_score(text, *, question, **kw):
    """Half of the prompts (by question) get the same reward for every response: flat groups;
    the others a deterministic spread (crc32 parity of the response)."""
    from rft_core.rewards.math import RewardResult

    flat = zlib.crc32(question.encode()) % 2 == 0
    r = 1.0 if flat else float(zlib.crc32(text.encode()) % 2)
    return RewardResult(r, r >= 1.0, None, {"correctness": r, "format": 0.0})


@pytest.fixture
def half_flat_rewards(monkeypatch):
    monkeypatch.setattr("rft_core.rewards.math.score_response", _half_flat_score)


def _demo_kl(**over) -> dict:
    demo = load_config("configs/grpo_demo.yaml")
    kl = {"kl.kl_coef": demo.kl.kl_coef, "kl.estimator": demo.kl.estimator, "kl.mode": demo.kl.mode,
          "advantage.estimator": demo.advantage.estimator}
    return {**kl, **over, "data.prompts_per_iteration": 4}


def _flat_groups(root: str, it: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sample of a group with equal task rewards: (its advantages, its per-token KL)."""
    rewards = read_shard(f"{root}/iter={it:06d}/rewards").to_pandas().set_index("sample_id")
    adv = read_shard(f"{root}/iter={it:06d}/advantages").to_pandas().set_index("sample_id")
    adv["reward"] = rewards.rewards.loc[adv.index]
    out = []
    for _, g in adv.groupby("prompt_id"):
        if g.reward.nunique() == 1:
            out += [(np.asarray(a, dtype=np.float64), np.asarray(k, dtype=np.float64)) for a, k in zip(g.advantages, g.kl)]
    return out


def test_reward_mode_kl_never_becomes_a_normalised_advantage(prefect_harness, tiny_model, tmp_path, half_flat_rewards):
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", **_demo_kl(**{"kl.mode": "reward", "kl.estimator": "k1"}))
    assert (cfg.kl.mode, cfg.kl.estimator, cfg.advantage.estimator) == ("reward", "k1", "grpo")
    train(cfg)
    coef = cfg.kl.kl_coef
    kl_seen = 0.0
    for it in (1, 2):
        flat = _flat_groups(cfg.run_root, it)
        assert flat, f"iteration {it} has no group with equal rewards"
        for adv, kl in flat:
            term = coef * kl.sum()
            assert np.abs(adv).max() <= abs(term) * (1 + 1e-4) + 1e-9  # no larger than its KL term
            np.testing.assert_allclose(adv, -term, rtol=1e-4, atol=1e-9)  # exactly minus it
            kl_seen = max(kl_seen, abs(kl.sum()))
    assert kl_seen > 1e-4  # iteration 2's policy moved away from the reference: the check had something to bound


def test_demo_kl_settings_train_with_the_kl_in_the_loss(prefect_harness, tiny_model, tmp_path, half_flat_rewards):
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", **_demo_kl(**{"rollout.top_p": 0.95}))
    assert cfg.kl.in_loss and cfg.update.rollout_correction.enabled  # top_p < 1: the engine samples another distribution
    result = train(cfg)
    for it in (1, 2):
        flat = _flat_groups(cfg.run_root, it)
        assert flat
        assert max(np.abs(adv).max() for adv, _ in flat) == 0.0  # the KL is not in the advantages at all
        rewards = read_shard(f"{cfg.run_root}/iter={it:06d}/advantages").to_pandas()
        assert (rewards.shaped_rewards.to_numpy() == read_shard(f"{cfg.run_root}/iter={it:06d}/rewards").to_pandas()
                .set_index("sample_id").rewards.loc[rewards.sample_id].to_numpy()).all()
    upd2 = read_manifest(f"{cfg.run_root}/iter=000002/ppo_update")[0]
    assert upd2.summary["kl_loss"] > 0 and "ref_logprobs" in upd2.inputs  # the KL acts as a loss term
    lines = [json.loads(x) for x in Path(cfg.run_root, "metrics.jsonl").read_text().splitlines()]
    for row in lines:
        assert 0 < row["rollout_is_weight_mean"] <= 2.0 and 0 <= row["rollout_is_capped_frac"] <= 1
        assert np.isfinite(row["rollout_kl"]) and row["kl_loss"] >= 0
    assert result.metrics[1]["kl_loss"] > 0
