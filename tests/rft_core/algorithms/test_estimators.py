"""RLOO, Dr. GRPO, REINFORCE++, REINFORCE++-baseline, GAE and KL-shaped token rewards:
hand-computed cases (arithmetic in comments) and float64 reference loops."""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms import ADVANTAGE_ESTIMATORS
from rft_core.algorithms.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    kl_shaped_token_rewards,
    last_token_index,
    reinforce_baseline_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

D = torch.float64


def _rand(seed, B=10, T=6):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(B, generator=g, dtype=D)
    groups = torch.randint(0, 3, (B,), generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # right-padded responses, some empty
    return g, rewards, groups, mask


def test_kl_shaped_token_rewards_hand():
    # r = 2, kl = [0.1, 0.2, (0.3 masked)], coef 0.5 -> [-0.05, -0.1 + 2, 0]
    out = kl_shaped_token_rewards(torch.tensor([2.0], dtype=D), torch.tensor([[0.1, 0.2, 0.3]], dtype=D),
                                  torch.tensor([[True, True, False]]), kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.9, 0.0]], dtype=D))
    assert last_token_index(torch.tensor([[True, True, False], [False] * 3])).tolist() == [1, -1]


def test_rloo_hand_and_both_ways():
    # group a: rewards 1, 0, 0, 1 -> A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    # group b: one sample -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 9])
    mask = torch.ones(5, 2, dtype=torch.bool)
    adv, _ = rloo_advantages(rewards, groups, mask)
    torch.testing.assert_close(adv[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0], dtype=D))
    # the same via G/(G-1) (r - mean), on random groups
    _, r, gids, m = _rand(0)
    adv, _ = rloo_advantages(r, gids, m)
    for i in range(len(r)):
        members = [r[j].item() for j in range(len(r)) if gids[j] == gids[i]]
        G = len(members)
        want = G / (G - 1) * (r[i].item() - sum(members) / G) if G > 1 else 0.0
        loo = r[i].item() - (sum(members) - r[i].item()) / (G - 1) if G > 1 else 0.0
        assert want == pytest.approx(loo, abs=1e-12)
        assert adv[i].tolist() == pytest.approx([want if x else 0.0 for x in m[i]], abs=1e-12)


def test_dr_grpo_is_mean_centering():
    adv, ret = dr_grpo_advantages(torch.tensor([3.0, 1.0, 2.0], dtype=D), torch.tensor([0, 0, 1]),
                                  torch.tensor([[True, False], [True, True], [True, True]]))
    assert adv.tolist() == [[1.0, 0.0], [-1.0, -1.0], [0.0, 0.0]]
    assert ret.tolist() == [[3.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_discounted_returns_hand_and_loop():
    # r = [0, 0, 1], gamma 0.5 -> G = [0.25, 0.5, 1]
    g = discounted_returns(torch.tensor([[0.0, 0.0, 1.0]], dtype=D), torch.ones(1, 3, dtype=torch.bool), gamma=0.5)
    assert g.tolist() == [[0.25, 0.5, 1.0]]
    gen, _, _, mask = _rand(1)
    tr = torch.randn(mask.shape, generator=gen, dtype=D)
    out = discounted_returns(tr, mask, gamma=0.9)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            want = sum(0.9 ** (k - t) * tr[b, k].item() for k in range(t, mask.shape[1]) if mask[b, k]) if mask[b, t] else 0.0
            assert out[b, t].item() == pytest.approx(want, abs=1e-12)


def _multi_turn_row():
    # one multi-turn row: turn 1 = 3 action tokens, an observation of 2 tokens (action_mask False),
    # turn 2 = 2 action tokens, then padding; and a plain right-padded row
    mask = torch.tensor([[True, True, True, False, False, True, True, False],
                         [True, True, True, True, False, False, False, False]])
    tr = torch.tensor([[0.5, -0.25, 1.0, 7.0, -3.0, 0.125, 2.0, 9.0],
                       [1.0, 0.0, -0.5, 4.0, 6.0, 6.0, 6.0, 6.0]], dtype=D)
    return tr, mask


def _returns_loop(tr, mask, gamma):
    """Reference: discount over the action tokens only (observation tokens are not actions)."""
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for b in range(mask.shape[0]):
        actions = [t for t in range(mask.shape[1]) if mask[b, t]]
        for i, t in enumerate(actions):
            out[b][t] = sum(gamma ** (j - i) * tr[b, actions[j]].item() for j in range(i, len(actions)))
    return out


def test_discounted_returns_skip_observation_tokens():
    tr, mask = _multi_turn_row()
    g = discounted_returns(tr, mask, gamma=0.5)
    # row 0, actions at 0, 1, 2, 5, 6 with rewards 0.5, -0.25, 1, 0.125, 2 (7 and -3 are observation
    # rewards, 9 is padding: ignored): G_6 = 2, G_5 = 0.125 + 0.5 * 2 = 1.125, G_2 = 1 + 0.5 * 1.125
    # = 1.5625 (the observation neither discounts nor resets), G_1 = -0.25 + 0.78125 = 0.53125,
    # G_0 = 0.5 + 0.265625 = 0.765625 (counting the observation positions in the powers of gamma,
    # the code before issue 29, gave G_2 = 1 + 0.125 * 1.125 = 1.140625);
    # row 1 (right-padded): G_3 = 4, G_2 = -0.5 + 2 = 1.5, G_1 = 0.75, G_0 = 1 + 0.375 = 1.375
    assert g.tolist() == [[0.765625, 0.53125, 1.5625, 0.0, 0.0, 1.125, 2.0, 0.0],
                          [1.375, 0.75, 1.5, 4.0, 0.0, 0.0, 0.0, 0.0]]
    for gamma in (0.9, 0.37, 1.0):
        got = discounted_returns(tr, mask, gamma=gamma)
        for row, want in zip(got.tolist(), _returns_loop(tr, mask, gamma)):
            assert row == pytest.approx(want, abs=1e-12), gamma
    # random multi-turn masks (holes anywhere), float64 loop
    gen = torch.Generator().manual_seed(11)
    mask = torch.rand(9, 12, generator=gen) > 0.35
    tr = torch.randn(9, 12, generator=gen, dtype=D)
    got = discounted_returns(tr, mask, gamma=0.9)
    want = _returns_loop(tr, mask, 0.9)
    for b in range(9):
        assert got[b].tolist() == pytest.approx(want[b], abs=1e-12), b


def test_reinforce_pp_on_a_multi_turn_row():
    # REINFORCE++ (gamma 0.5) on the multi-turn row: returns over actions, whitened over action tokens
    tr, mask = _multi_turn_row()
    adv, ret = reinforce_pp_advantages(torch.zeros(2, dtype=D), torch.tensor([0, 1]), mask, token_rewards=tr,
                                       gamma=0.5, eps=1e-8)
    want = _returns_loop(tr, mask, 0.5)
    vals = [want[b][t] for b in range(2) for t in range(8) if mask[b, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - 1) + 1e-8)
    for b in range(2):
        assert ret[b].tolist() == pytest.approx(want[b], abs=1e-12)
        assert adv[b].tolist() == pytest.approx([(want[b][t] - mean) / std if mask[b, t] else 0.0 for t in range(8)],
                                                abs=1e-12)


def test_reinforce_pp_whitens_over_batch():
    # outcome rewards 1 and 0 on rows of 2 tokens, gamma 1: G = [[1, 1], [0, 0]]
    # mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3 -> A = +-0.5 / sqrt(1/3) = +-0.8660
    adv, ret = reinforce_pp_advantages(torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0, 1]),
                                       torch.ones(2, 2, dtype=torch.bool), eps=0.0)
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=D) * 0.5 / math.sqrt(1 / 3))


def test_reinforce_baseline_hand():
    # group rewards 1, 0 -> baseline 0.5 -> returns [[0.5, 0.5], [-0.5, -0.5]]
    # mean 0, unbiased var = 4 * 0.25 / 3 -> A = +-0.8660
    adv, ret = reinforce_baseline_advantages(torch.tensor([1.0, 0.0], dtype=D), torch.tensor([4, 4]),
                                             torch.ones(2, 2, dtype=torch.bool), eps=0.0)
    assert ret.tolist() == [[0.5, 0.5], [-0.5, -0.5]]
    assert adv[0, 0].item() == pytest.approx(0.5 / math.sqrt(1 / 3)) and adv[1, 1].item() == pytest.approx(-0.5 / math.sqrt(1 / 3))


def test_reinforce_variants_float64_loop():
    gen, rewards, groups, mask = _rand(2, B=12)
    kl = torch.rand(mask.shape, generator=gen, dtype=D)
    tr = kl_shaped_token_rewards(rewards, kl, mask, kl_coef=0.1)
    for name, fn in (("reinforce", reinforce_pp_advantages), ("reinforce_baseline", reinforce_baseline_advantages)):
        adv, _ = fn(rewards, groups, mask, token_rewards=tr, eps=1e-8)
        B, T = mask.shape
        G = [[0.0] * T for _ in range(B)]
        for b in range(B):
            base = 0.0
            if name == "reinforce_baseline":
                members = [rewards[j].item() for j in range(B) if groups[j] == groups[b]]
                base = sum(members) / len(members)
            valid = [t for t in range(T) if mask[b, t]]
            running = 0.0
            for t in reversed(valid):
                r_t = tr[b, t].item() - (base if t == valid[-1] else 0.0)
                running = r_t + running
                G[b][t] = running
        vals = [G[b][t] for b in range(B) for t in range(T) if mask[b, t]]
        mean = sum(vals) / len(vals)
        var = sum((x - mean) ** 2 for x in vals) / (len(vals) - 1)
        for b in range(B):
            for t in range(T):
                want = (G[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
                assert adv[b, t].item() == pytest.approx(want, abs=1e-9), (name, b, t)


def test_gae_hand():
    # r = [0, 1], V = [0.5, 0.8], gamma 1, lambda 0.5
    # t=1: delta = 1 + 0 - 0.8 = 0.2, A_1 = 0.2;  t=0: delta = 0 + 0.8 - 0.5 = 0.3, A_0 = 0.3 + 0.5 * 0.2 = 0.4
    adv, ret = gae_advantages(torch.tensor([1.0], dtype=D), torch.tensor([0]), torch.ones(1, 2, dtype=torch.bool),
                              values=torch.tensor([[0.5, 0.8]], dtype=D), gamma=1.0, gae_lambda=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.2]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[0.9, 1.0]], dtype=D))
    # whitened (the default, as verl and OpenRLHF): A = [0.4, 0.2], mean 0.3, unbiased var
    # (0.01 + 0.01) / 1 = 0.02 -> A = +-0.1 / sqrt(0.02 + 1e-8) = +-0.70710661; returns unchanged
    adv, ret2 = gae_advantages(torch.tensor([1.0], dtype=D), torch.tensor([0]), torch.ones(1, 2, dtype=torch.bool),
                               values=torch.tensor([[0.5, 0.8]], dtype=D), gamma=1.0, gae_lambda=0.5)
    s = 0.1 / math.sqrt(0.02 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[s, -s]], dtype=D), rtol=0, atol=1e-14)
    assert torch.equal(ret2, ret)


def test_gae_whitening_float64_loop():
    # whiten over every response token of the batch: mean and unbiased var of the raw GAE
    # advantages (verl: verl_F.masked_whiten(advantages, response_mask)); returns = raw A + V;
    # multi-turn rows included (observation tokens skipped by the recurrence and the statistics)
    gen, rewards, groups, mask = _rand(7, B=9, T=8)
    mask[:3, 2:4] = False  # observation tokens inside three responses
    mask[:3, 4:6] = True
    values = torch.randn(mask.shape, generator=gen, dtype=D)
    tr = torch.randn(mask.shape, generator=gen, dtype=D)
    adv, ret = gae_advantages(rewards, groups, mask, values=values, token_rewards=tr, gamma=0.95, gae_lambda=0.9)
    raw, ret_raw = gae_advantages(rewards, groups, mask, values=values, token_rewards=tr, gamma=0.95, gae_lambda=0.9,
                                  whiten=False)
    assert torch.equal(ret, ret_raw)
    B, T = mask.shape
    A = {}
    for b in range(B):
        a_next = v_next = 0.0
        for t in reversed([t for t in range(T) if mask[b, t]]):
            a_next = tr[b, t].item() + 0.95 * v_next - values[b, t].item() + 0.95 * 0.9 * a_next
            v_next = values[b, t].item()
            A[b, t] = a_next
    mean = sum(A.values()) / len(A)
    var = sum((a - mean) ** 2 for a in A.values()) / (len(A) - 1)
    for b in range(B):
        for t in range(T):
            want = (A[b, t] - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
            assert adv[b, t].item() == pytest.approx(want, abs=1e-12), (b, t)
            assert raw[b, t].item() == pytest.approx(A.get((b, t), 0.0), abs=1e-12)
            assert ret[b, t].item() == pytest.approx(A[b, t] + values[b, t].item() if mask[b, t] else 0.0, abs=1e-12)
    assert abs(mean) > 1e-3 and abs(var - 1) > 1e-2  # so the whitening is visible


def test_gae_whiten_is_a_config_key_defaulting_to_the_peers():
    from rft_core.config import TrainConfig, estimator_kwargs

    cfg = TrainConfig.model_validate({"advantage": {"estimator": "gae"}})
    assert estimator_kwargs(cfg.advantage) == {"gamma": 1.0, "gae_lambda": 0.95, "whiten": True}
    off = TrainConfig.model_validate({"advantage": {"estimator": "gae", "whiten": False}})
    assert estimator_kwargs(off.advantage)["whiten"] is False


def test_gae_reference_recurrence_ignores_masked_values():
    gen, rewards, groups, mask = _rand(3, B=8, T=7)
    values = torch.randn(mask.shape, generator=gen, dtype=D)
    tr = torch.randn(mask.shape, generator=gen, dtype=D)
    adv, ret = gae_advantages(rewards, groups, mask, values=values, token_rewards=tr, gamma=0.99, gae_lambda=0.9,
                              whiten=False)
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        a_next, v_next = 0.0, 0.0
        want = {}
        for t in reversed(valid):
            delta = tr[b, t].item() + 0.99 * v_next - values[b, t].item()
            a_next = delta + 0.99 * 0.9 * a_next
            v_next = values[b, t].item()
            want[t] = a_next
        for t in range(mask.shape[1]):
            assert adv[b, t].item() == pytest.approx(want.get(t, 0.0), abs=1e-10)
            assert ret[b, t].item() == pytest.approx(want[t] + values[b, t].item() if t in want else 0.0, abs=1e-10)
    # arbitrary (even non-finite) values and rewards at masked positions change nothing
    v2, tr2 = values.clone(), tr.clone()
    v2[~mask], tr2[~mask] = float("nan"), 1e6
    adv2, ret2 = gae_advantages(rewards, groups, mask, values=v2, token_rewards=tr2, gamma=0.99, gae_lambda=0.9,
                                whiten=False)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_baseline", "cpgd", "gae"])
def test_every_estimator_is_finite_on_empty_rows_and_zero_there(name):
    gen, rewards, groups, mask = _rand(4)
    mask[0] = False  # an all-masked row
    kw = {"values": torch.randn(mask.shape, generator=gen, dtype=D)} if name == "gae" else {}
    adv, ret = ADVANTAGE_ESTIMATORS[name](rewards, groups, mask, **kw)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_cpgd_hand_and_no_collapse():
    from rft_core.algorithms.advantages import cpgd_advantages

    # group a: scores 1, 0 -> mean 0.5, population std 0.5 -> A = +-1; group b: 2, 2 -> 0
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=D)
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    adv, ret = cpgd_advantages(rewards, groups, mask, eps=0.0 + 1e-12)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=D))
    assert torch.equal(adv, ret)
    # token rewards are summed first: a KL penalty of 0.25 on sample 0's two tokens -> scores 0.5, 0
    tr = kl_shaped_token_rewards(rewards, torch.tensor([[1.0, 1.0], [0, 0], [0, 0], [0, 0]], dtype=D), mask, kl_coef=0.25)
    adv, _ = cpgd_advantages(rewards, groups, mask, token_rewards=tr, weight_factor="mean")
    assert adv[:, 0].tolist() == pytest.approx([0.25, -0.25, 0.0, 0.0])
    # per prompt over the whole batch: one sample per micro-batch would give 0, here it does not
    _, r, gids, m = _rand(5, B=16)
    m[:, 0] = True
    adv, _ = cpgd_advantages(r, gids, m)
    assert adv.abs().sum() > 0
    with pytest.raises(ValueError, match="valid: std, clip_filter_like, mean"):
        cpgd_advantages(r, gids, m, weight_factor="z")


def test_clip_filter_like_weights_hand():
    from rft_core.algorithms.advantages import clip_filter_like_weights

    # 4 groups, 1 flat (g2): others get min(4 / 3, 3) = 1.333, the flat one lamda = 0.5
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5], dtype=D)
    groups = torch.tensor([0, 0, 2, 2, 5, 5, 7, 7])
    w = clip_filter_like_weights(rewards, groups, lamda=0.5)
    assert w.tolist() == pytest.approx([4 / 3, 4 / 3, 0.5, 0.5, 4 / 3, 4 / 3, 4 / 3, 4 / 3])
    # 3 of 4 flat: 4 / 1 = 4, clipped to clip_eps 3
    w = clip_filter_like_weights(torch.tensor([1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 0.0, 1.0]), groups, clip_eps=3.0)
    assert w.tolist() == [1.0] * 6 + [3.0, 3.0]
    # all flat: ones
    assert clip_filter_like_weights(torch.ones(4), torch.tensor([0, 0, 1, 1]), lamda=0.1).tolist() == [1.0] * 4


@pytest.mark.parametrize("weight_factor", ["std", "clip_filter_like", "mean"])
def test_dr_grpo_and_cpgd_against_float64_loop(weight_factor):
    from rft_core.algorithms.advantages import cpgd_advantages

    gen, rewards, groups, mask = _rand(6, B=14)
    kl = torch.rand(mask.shape, generator=gen, dtype=D)
    tr = kl_shaped_token_rewards(rewards, kl, mask, kl_coef=0.3)
    adv, _ = cpgd_advantages(rewards, groups, mask, token_rewards=tr, weight_factor=weight_factor, eps=1e-6, clip_eps=3.0, lamda=0.5)
    dr, _ = dr_grpo_advantages(rewards, groups, mask)
    B, T = mask.shape
    scores = [sum(tr[b, t].item() for t in range(T) if mask[b, t]) for b in range(B)]
    gids = sorted(set(groups.tolist()))
    members = {g: [b for b in range(B) if groups[b] == g] for g in gids}
    flat = {g: len({round(scores[b], 12) for b in members[g]}) == 1 for g in gids}
    n_flat = sum(flat.values())
    w_signal = min(len(gids) / (len(gids) - n_flat), 3.0) if n_flat < len(gids) else 1.0
    for b in range(B):
        g = groups[b].item()
        s = [scores[j] for j in members[g]]
        mean = sum(s) / len(s)
        std = (sum((x - mean) ** 2 for x in s) / len(s)) ** 0.5  # population std
        if weight_factor == "std":
            want = (scores[b] - mean) / (std + 1e-6)
        elif weight_factor == "clip_filter_like":
            w = 1.0 if n_flat == len(gids) else (0.5 if flat[g] else w_signal)
            want = (scores[b] - mean) * w
        else:
            want = scores[b] - mean
        r = [rewards[j].item() for j in members[g]]
        for t in range(T):
            assert adv[b, t].item() == pytest.approx(want if mask[b, t] else 0.0, abs=1e-9)
            assert dr[b, t].item() == pytest.approx(rewards[b].item() - sum(r) / len(r) if mask[b, t] else 0.0, abs=1e-12)
