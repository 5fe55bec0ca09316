"""Overlong penalty, Welford running moments, clipping: hand cases and float64 references."""
from __future__ import annotations

import statistics

import pytest
import torch

from rft_core.algorithms.shaping import RunningMoments, clip_with_fraction, normalize_rewards, overlong_penalty


def test_overlong_penalty_hand():
    # max 100, buffer 20 -> expected 80: len 70 -> 0; 90 -> -(10/20) = -0.5; 100 -> -1 (factor 1); factor 2 doubles
    lens = torch.tensor([70, 80, 90, 100])
    assert overlong_penalty(lens, max_new_tokens=100, buffer_len=20).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lens, max_new_tokens=100, buffer_len=20, penalty_factor=2.0).tolist() == [0.0, 0.0, -1.0, -2.0]
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lens, max_new_tokens=10, buffer_len=20)


def test_running_moments_equal_whole_stream():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1 for n in (5, 1, 12, 7)]
    m = RunningMoments()
    seen: list[float] = []
    for b in batches:
        m = m.update(b)
        seen += b.tolist()
        assert m.count == len(seen)
        assert m.mean == pytest.approx(statistics.fmean(seen), abs=1e-12)
        if len(seen) > 1:
            assert m.std == pytest.approx(statistics.stdev(seen), abs=1e-12)
    assert RunningMoments().std == 1.0 and RunningMoments().update(torch.tensor([])) == RunningMoments()


def test_normalize_and_clip_hand():
    m = RunningMoments().update(torch.tensor([1.0, 3.0]))  # mean 2, unbiased std sqrt(2)
    r = torch.tensor([4.0, 2.0], dtype=torch.float64)
    assert normalize_rewards(r, m, eps=0).tolist() == pytest.approx([2 / 2**0.5, 0.0])
    assert normalize_rewards(r, m, minus_mean=False, eps=0).tolist() == pytest.approx([4 / 2**0.5, 2 / 2**0.5])
    x, frac = clip_with_fraction(torch.tensor([[-3.0, 0.5, 2.0], [9.0, 0.0, 0.0]]), 1.0,
                                 mask=torch.tensor([[True, True, True], [False, True, True]]))
    assert x.tolist() == [[-1.0, 0.5, 1.0], [1.0, 0.0, 0.0]] and frac == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        clip_with_fraction(x, 0.0)


def _exp(rewards, lengths, prompt_ids):
    from schemas.batch import ColumnBatch

    B, T = len(lengths), max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    z = torch.zeros(B, T)
    ones = torch.ones(B, 1, dtype=torch.long)
    return ColumnBatch(sample_id=[f"{p}#{i}" for i, p in enumerate(prompt_ids)], prompt_id=prompt_ids,
                       finish_reason=["stop"] * B, prompt_token_ids=ones, prompt_mask=ones,
                       response_token_ids=mask.long(), response_mask=mask.long(), action_mask=mask,
                       response_length=torch.tensor(lengths), rollout_logprobs=z, old_logprobs=z,
                       rewards=torch.tensor(rewards))


def test_stage_applies_shaping_in_order_and_carries_state():
    from rft_core.config import DrGRPOAdvantage, KLConfig, ShapingConfig, TrainState
    from rft_core.stages.advantages import compute_advantages

    # rewards 1, 1, 0, 0; lengths 10, 4, 4, 4; max_new_tokens 10, buffer 4 -> expected 6:
    #   penalty(10) = -(10 - 6)/4 = -1, others 0 -> rewards 0, 1, 0, 0
    # reward_clip 0.5 -> 0, 0.5, 0, 0 (1 of 4 clipped)
    # dr_grpo, groups {a: 0, 0.5}, {b: 0, 0} -> A = -0.25, 0.25, 0, 0
    # advantage_clip 0.2 -> -0.2, 0.2, 0, 0 on every token (rows a: 10 + 4 = 14 of 22 tokens clipped)
    exp = _exp([1.0, 1.0, 0.0, 0.0], [10, 4, 4, 4], ["a", "a", "b", "b"])
    shaping = ShapingConfig(overlong_buffer_len=4, reward_clip=0.5, advantage_clip=0.2)
    res = compute_advantages(exp, kl_cfg=KLConfig(), adv_cfg=DrGRPOAdvantage(), shaping=shaping,
                             state=TrainState(), max_new_tokens=10)
    assert res["shaped_rewards"].tolist() == [0.0, 0.5, 0.0, 0.0]
    assert res["advantages"][:, 0].tolist() == pytest.approx([-0.2, 0.2, 0.0, 0.0])
    assert res["metrics"] == pytest.approx({"overlong_penalty_mean": -0.25, "reward_clip_frac": 0.25, "advantage_clip_frac": 14 / 22})
    # running normalisation: the state accumulates the (penalised) rewards of each call
    norm = ShapingConfig(reward_running_norm=True)
    s1 = compute_advantages(exp, kl_cfg=KLConfig(), adv_cfg=DrGRPOAdvantage(), shaping=norm, state=TrainState())["state"]
    assert (s1.reward_count, s1.reward_mean) == (4, 0.5)
    s2 = compute_advantages(_exp([3.0, 3.0], [2, 2], ["c", "c"]), kl_cfg=KLConfig(), adv_cfg=DrGRPOAdvantage(), shaping=norm,
                            state=s1)["state"]
    assert s2.reward_count == 6 and s2.reward_mean == pytest.approx(8 / 6)
    assert RunningMoments(s2.reward_count, s2.reward_mean, s2.reward_m2).std == pytest.approx(statistics.stdev([1, 1, 0, 0, 3, 3]))
