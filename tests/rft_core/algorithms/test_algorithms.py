"""GRPO advantages, KL estimators and the PPO clipped loss: hand-computed cases, float64
reference loops, masking invariants."""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, kl_penalty, masked_mean, masked_whiten
from rft_core.algorithms.advantages import group_normalized_advantages, group_stats
from rft_core.algorithms.aggregation import LOSS_AGGREGATIONS, seq_mean_token_mean, token_mean
from rft_core.algorithms.policy_loss import ppo_clip_loss
from rft_core.registry import UnknownNameError

D = torch.float64


# ---------------------------------------------------------------- GRPO
def test_grpo_hand_computed():
    # group 0: rewards 1, 0, 0 -> mean 1/3; unbiased var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3
    #   A = (1 - 1/3) / sqrt(1/3) = 1.154700..., (0 - 1/3) / sqrt(1/3) = -0.577350...
    # group 1: rewards 2, 2 -> std 0 -> A = 0 / (0 + eps) = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0], dtype=D)
    groups = torch.tensor([7, 7, 7, 3, 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    adv, ret = group_normalized_advantages(rewards, groups, mask, eps=0.0 + 1e-12)
    expected = torch.tensor([2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), 0.0, 0.0], dtype=D)
    torch.testing.assert_close(adv[:, 0], expected * mask[:, 0], rtol=0, atol=1e-9)
    assert adv[0, 1] == adv[0, 0] and adv[0, 2] == 0.0  # broadcast over tokens, zero where masked
    assert ret[0, 0] == 1.0 and ret[1, 1] == 0.0


def test_grpo_pins_unbiased_std():
    rewards = torch.tensor([1.0, 0.0], dtype=D)  # unbiased std = 0.7071, biased = 0.5
    adv, _ = group_normalized_advantages(rewards, torch.tensor([0, 0]), torch.ones(2, 1, dtype=torch.bool), eps=0.0)
    assert adv[0, 0].item() == pytest.approx(0.5 / math.sqrt(0.5), abs=1e-12)  # = 0.7071, not 1.0


def test_grpo_against_float64_loop():
    g = torch.Generator().manual_seed(0)
    B, T = 24, 7
    rewards = torch.rand(B, generator=g, dtype=D)
    groups = torch.randint(0, 5, (B,), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    adv, _ = group_normalized_advantages(rewards, groups, mask, eps=1e-6)
    for i in range(B):
        members = [rewards[j].item() for j in range(B) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1)) if len(members) > 1 else 0.0
        a = (rewards[i].item() - mean) / (std + 1e-6)
        for t in range(T):
            assert adv[i, t].item() == pytest.approx(a if mask[i, t] else 0.0, abs=1e-10)


def test_grpo_without_std_scaling_is_dr_grpo_centering():
    rewards = torch.tensor([3.0, 1.0, 5.0], dtype=D)
    adv, _ = group_normalized_advantages(rewards, torch.tensor([0, 0, 1]), torch.ones(3, 1, dtype=torch.bool), scale_by_std=False)
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0]


def test_group_stats_rejects_bad_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        group_stats(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_estimator_registry_lists_names():
    assert ADVANTAGE_ESTIMATORS["grpo"] is ADVANTAGE_ESTIMATORS["group_norm"]
    with pytest.raises(UnknownNameError, match="valid names: .*grpo"):
        ADVANTAGE_ESTIMATORS["nope"]


# ---------------------------------------------------------------- KL
def test_kl_hand_computed():
    # pi = 0.5, pi_ref = 0.25: log_ratio = ln 2
    lp, ref = torch.tensor([[math.log(0.5)]], dtype=D), torch.tensor([[math.log(0.25)]], dtype=D)
    ln2 = math.log(2)
    assert KL_ESTIMATORS["k1"](lp, ref).item() == pytest.approx(ln2, abs=1e-12)
    assert KL_ESTIMATORS["k2"](lp, ref).item() == pytest.approx(0.5 * ln2**2, abs=1e-12)
    assert KL_ESTIMATORS["k3"](lp, ref).item() == pytest.approx(0.5 - 1 + ln2, abs=1e-12)  # 0.193147


def test_kl_against_float64_loop_and_clamp():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(4, 6, generator=g, dtype=D) * 3
    ref = -torch.rand(4, 6, generator=g, dtype=D) * 3
    ref[0, 0] = -60.0  # underflowed reference: clamped
    mask = torch.rand(4, 6, generator=g) > 0.2
    for name in ("k1", "k2", "k3"):
        out = kl_penalty(lp, ref, mask, estimator=name, kl_clamp=10.0)
        for b in range(4):
            for t in range(6):
                x = lp[b, t].item() - ref[b, t].item()
                val = {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(max(min(-x, 20), -20)) - 1 + max(min(x, 20), -20)}[name]
                want = max(min(val, 10.0), -10.0) if mask[b, t] else 0.0
                assert out[b, t].item() == pytest.approx(want, abs=1e-9), (name, b, t)
    assert kl_penalty(lp, ref, mask, estimator="k3")[0, 0] <= 10.0


def test_k3_nonnegative_and_unknown_name():
    g = torch.Generator().manual_seed(2)
    lp, ref = torch.randn(50, generator=g, dtype=D), torch.randn(50, generator=g, dtype=D)
    assert (KL_ESTIMATORS["k3"](lp, ref) >= 0).all()
    with pytest.raises(UnknownNameError, match=r"k1, k1\+, k2, k3, k3\+"):
        kl_penalty(lp[None], ref[None], torch.ones(1, 50, dtype=torch.bool), estimator="k9")


# ---------------------------------------------------------------- PPO clip
def _lp(ratios):
    return torch.log(torch.tensor(ratios, dtype=D))


def test_ppo_clip_hand_computed():
    # ratio 1.5, A=+1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped
    # ratio 0.5, A=+1: min(0.5, 0.8) = 0.5 -> loss -0.5
    # ratio 0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped
    # ratio 1.5, A=-1: min(-1.5, -1.2) = -1.5 -> loss 1.5
    lp = _lp([[1.5, 0.5, 0.5, 1.5]])
    old = torch.zeros(1, 4, dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=D)
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(out.token_loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5]], dtype=D))
    assert out.clipped.tolist() == [[True, False, True, False]]
    # token-mean: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15
    assert token_mean(out.token_loss, mask).item() == pytest.approx(0.15)
    # clip-higher: upper bound 1.28 -> first token -1.28
    hi = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert hi.token_loss[0, 0].item() == pytest.approx(-1.28)


def test_ppo_clip_against_float64_loop_and_masking():
    g = torch.Generator().manual_seed(3)
    B, T = 5, 9
    lp = -torch.rand(B, T, generator=g, dtype=D)
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.4
    out = ppo_clip_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    total, n = 0.0, 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                assert out.token_loss[b, t].item() == 0.0
                continue
            r = math.exp(lp[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            want = -min(r * a, min(max(r, 0.9), 1.3) * a)
            assert out.token_loss[b, t].item() == pytest.approx(want, abs=1e-12)
            total += want
            n += 1
    assert token_mean(out.token_loss, mask).item() == pytest.approx(total / n, abs=1e-12)
    # garbage (even NaN/inf) at masked positions changes nothing
    lp2, adv2 = lp.clone(), adv.clone()
    lp2[~mask] = float("nan")
    adv2[~mask] = float("inf")
    out2 = ppo_clip_loss(lp2, old, adv2, mask, clip_low=0.1, clip_high=0.3)
    assert token_mean(out2.token_loss, mask).item() == pytest.approx(total / n, abs=1e-12)


def test_all_masked_row_gives_finite_loss_and_grad():
    lp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    mask = torch.tensor([[False] * 3, [True, True, False]])
    out = ppo_clip_loss(lp, torch.zeros(2, 3, dtype=D), torch.ones(2, 3, dtype=D), mask)
    for agg in (token_mean(out.token_loss, mask), seq_mean_token_mean(out.token_loss, mask)):
        assert torch.isfinite(agg)
    token_mean(out.token_loss, torch.zeros_like(mask)).backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("loss_name", ["ppo_clip", "dual_clip", "gspo", "cpgd"])
@pytest.mark.parametrize("agg_name", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_full_batch_loss_and_grad(loss_name, agg_name):
    g = torch.Generator().manual_seed(4)
    B, T = 8, 6
    base = -torch.rand(B, T, generator=g, dtype=D)
    old = base + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.3
    loss_fn, agg = POLICY_LOSSES[loss_name], LOSS_AGGREGATIONS[agg_name]
    totals = {"num_tokens": int(mask.sum()), "num_sequences": B, "norm_tokens": T}
    full_lp = base.clone().requires_grad_(True)
    full = agg(loss_fn(full_lp, old, adv, mask).token_loss, mask, **totals)
    full.backward()
    micro_lp = base.clone().requires_grad_(True)
    acc = 0.0
    for s in range(0, B, 3):  # micro-batches of 3, 3, 2 sequences
        sl = slice(s, s + 3)
        part = agg(loss_fn(micro_lp[sl], old[sl], adv[sl], mask[sl]).token_loss, mask[sl], **totals)
        part.backward()
        acc += part.item()
    assert acc == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=0, atol=1e-12)


def test_aggregations_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]], dtype=D)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert LOSS_AGGREGATIONS["token-mean"](loss, mask).item() == pytest.approx(10 / 4)  # (1+2+3+4)/4
    assert LOSS_AGGREGATIONS["seq-mean-token-mean"](loss, mask).item() == pytest.approx(3.0)  # (2 + 4)/2
    assert LOSS_AGGREGATIONS["seq-mean-token-sum"](loss, mask).item() == pytest.approx(5.0)  # (6 + 4)/2
    assert LOSS_AGGREGATIONS["seq-mean-token-sum-norm"](loss, mask, norm_tokens=5).item() == pytest.approx(1.0)  # 10/(2*5)
    assert LOSS_AGGREGATIONS["seq-mean-token-sum-norm"](loss, mask).item() == pytest.approx(10 / 6)  # default T = 3


def test_dual_clip_hand_computed():
    # ratio 5, A=-1: PPO gives max(5, 1.2) = 5; the cap -clip_c*A = 3 wins -> 3
    # ratio 0.5, A=-1: PPO gives 0.8 < 3 -> 0.8;  ratio 1.5, A=+1: -1.2 (positive A is not capped)
    lp, old = _lp([[5.0, 0.5, 1.5]]), torch.zeros(1, 3, dtype=D)
    adv, mask = torch.tensor([[-1.0, -1.0, 1.0]], dtype=D), torch.ones(1, 3, dtype=torch.bool)
    out = POLICY_LOSSES["dual_clip"](lp, old, adv, mask, clip_c=3.0)
    torch.testing.assert_close(out.token_loss, torch.tensor([[3.0, 0.8, -1.2]], dtype=D))
    assert out.clipped.tolist() == [[True, True, True]]
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        POLICY_LOSSES["dual_clip"](lp, old, adv, mask, clip_c=1.0)


def test_gspo_hand_computed_value_and_gradient():
    # token log-ratios ln 1.1, ln 0.9 -> s = exp(mean) = sqrt(0.99) = 0.994987; A = 1
    # clip(s, 1 - 3e-4, 1 + 4e-4) = 0.9997 > s, so min(s, 0.9997) = s: loss -s on each token, not clipped
    lp = _lp([[1.1, 0.9]]).requires_grad_(True)
    old, adv, mask = torch.zeros(1, 2, dtype=D), torch.ones(1, 2, dtype=D), torch.ones(1, 2, dtype=torch.bool)
    out = POLICY_LOSSES["gspo"](lp, old, adv, mask)
    s_i = math.sqrt(0.99)
    torch.testing.assert_close(out.token_loss, torch.tensor([[-s_i, -s_i]], dtype=D))
    assert not out.clipped.any()
    token_mean(out.token_loss, mask).backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-s_i / 2, -s_i / 2]], dtype=D))  # d(-s_i,t)/d logp_t = -s_i
    # float64 loop on random data: each token's loss uses its sequence's geometric-mean ratio
    g = torch.Generator().manual_seed(7)
    lp = -torch.rand(4, 5, generator=g, dtype=D)
    old = lp + 0.001 * torch.randn(4, 5, generator=g, dtype=D)
    adv = torch.randn(4, 5, generator=g, dtype=D)
    mask = torch.rand(4, 5, generator=g) > 0.3
    out = POLICY_LOSSES["gspo"](lp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    for b in range(4):
        toks = [t for t in range(5) if mask[b, t]]
        s = math.exp(sum(lp[b, t].item() - old[b, t].item() for t in toks) / max(len(toks), 1))
        for t in range(5):
            a = adv[b, t].item()
            want = -min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a) if mask[b, t] else 0.0
            assert out.token_loss[b, t].item() == pytest.approx(want, abs=1e-12)


def test_cpgd_hand_computed():
    # log-ratio ln 1.5 = 0.405465, A=+1: clip to ln 1.2 = 0.182322 -> min(0.405, 0.182) -> loss -0.182322
    # log-ratio ln 0.5 = -0.693147, A=-1: clip to ln 0.8 = -0.223144 -> min(0.693, 0.223) -> loss -0.223144
    lp, old = _lp([[1.5, 0.5]]), torch.zeros(1, 2, dtype=D)
    out = POLICY_LOSSES["cpgd"](lp, old, torch.tensor([[1.0, -1.0]], dtype=D), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out.token_loss, torch.tensor([[-math.log(1.2), math.log(0.8)]], dtype=D))
    assert out.clipped.tolist() == [[True, True]]


@pytest.mark.parametrize("loss_name", ["ppo_clip", "dual_clip", "gspo", "cpgd"])
def test_every_loss_ignores_masked_garbage(loss_name):
    g = torch.Generator().manual_seed(8)
    lp = -torch.rand(3, 4, generator=g, dtype=D)
    old = lp + 0.1 * torch.randn(3, 4, generator=g, dtype=D)
    adv = torch.randn(3, 4, generator=g, dtype=D)
    mask = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    ref = POLICY_LOSSES[loss_name](lp, old, adv, mask).token_loss
    lp2, adv2 = lp.clone(), adv.clone()
    lp2[~mask], adv2[~mask] = float("nan"), float("inf")
    out = POLICY_LOSSES[loss_name](lp2, old, adv2, mask).token_loss
    assert torch.equal(out, ref) and torch.isfinite(out).all()


def test_masked_helpers():
    v = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]], dtype=D)
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert masked_mean(v, m).item() == pytest.approx(2.0)  # (1+2+3)/3
    assert masked_mean(v, m, dim=-1).tolist() == [1.5, 3.0]
    w = masked_whiten(v, m)
    # mean 2, unbiased var 1 -> (x - 2) / 1
    assert w[m].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert w[~m].tolist() == [0.0, 0.0, 0.0]


def test_policy_loss_registry():
    assert POLICY_LOSSES["ppo_clip"] is ppo_clip_loss
    with pytest.raises(UnknownNameError, match="ppo_clip"):
        POLICY_LOSSES["ppo_clipp"]


def test_kl_controllers_hand_computed():
    from rft_core.algorithms.kl import next_kl_coef

    assert next_kl_coef(0.1, 5.0, controller="fixed") == 0.1
    # KL 0.2 vs target 0.1: error clip(1, -0.2, 0.2) = 0.2; 32 samples / horizon 320 -> 0.1 * (1 + 0.2 * 0.1) = 0.102
    assert next_kl_coef(0.1, 0.2, controller="adaptive", target=0.1, horizon=320, n_steps=32) == pytest.approx(0.102)
    # KL 0.09 vs 0.1: error -0.1 -> 0.1 * (1 - 0.1 * 0.1) = 0.099
    assert next_kl_coef(0.1, 0.09, controller="adaptive", target=0.1, horizon=320, n_steps=32) == pytest.approx(0.099)
    with pytest.raises(ValueError, match="needs target > 0"):
        next_kl_coef(0.1, 0.2, controller="adaptive")
    with pytest.raises(ValueError, match="valid: adaptive, fixed"):
        next_kl_coef(0.1, 0.2, controller="pid")


def test_high_entropy_mask_hand_computed():
    from rft_core.algorithms.masked import high_entropy_mask

    # unmasked entropies 1..8 (the 99 is masked): the 0.75 quantile of 1..8 is 6.25 -> keep 7, 8
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [99.0, 0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[True] * 4, [True] * 4, [False] * 4])
    kept = high_entropy_mask(ent, mask, top_fraction=0.25)
    assert kept.tolist() == [[False] * 4, [False, False, True, True], [False] * 4]
    assert torch.equal(high_entropy_mask(ent, mask, top_fraction=1.0), mask)
    with pytest.raises(ValueError, match="top_fraction"):
        high_entropy_mask(ent, mask, top_fraction=0.0)


def test_clipped_value_loss_hand_and_loop():
    from rft_core.algorithms.value_loss import VALUE_LOSSES

    # V = 1.0, old = 0.5, R = 2.0, clip 0.2: V_clip = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845
    # V = 0.6, old = 0.5, R = 0.0: V_clip = 0.6; max(0.36, 0.36) -> 0.18
    v = torch.tensor([[1.0, 0.6, 5.0]], dtype=D)
    old = torch.tensor([[0.5, 0.5, 0.0]], dtype=D)
    ret = torch.tensor([[2.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[True, True, False]])
    out = VALUE_LOSSES["clipped_mse"](v, old, ret, mask, value_clip=0.2)
    torch.testing.assert_close(out, torch.tensor([[0.845, 0.18, 0.0]], dtype=D))
    torch.testing.assert_close(VALUE_LOSSES["clipped_mse"](v, old, ret, mask, value_clip=None),
                               torch.tensor([[0.5, 0.18, 0.0]], dtype=D))
    g = torch.Generator().manual_seed(9)
    v, old, ret = (torch.randn(3, 5, generator=g, dtype=D) for _ in range(3))
    out = VALUE_LOSSES["clipped_mse"](v, old, ret, torch.ones(3, 5, dtype=torch.bool), value_clip=0.3)
    for b in range(3):
        for t in range(5):
            vc = old[b, t].item() + max(min(v[b, t].item() - old[b, t].item(), 0.3), -0.3)
            want = 0.5 * max((v[b, t].item() - ret[b, t].item()) ** 2, (vc - ret[b, t].item()) ** 2)
            assert out[b, t].item() == pytest.approx(want, abs=1e-12)


def test_dual_clip_and_cpgd_losses_against_float64_loop():
    g = torch.Generator().manual_seed(10)
    B, T = 6, 7
    lp = -torch.rand(B, T, generator=g, dtype=D)
    old = lp + 0.8 * torch.randn(B, T, generator=g, dtype=D)  # large ratios: every branch is hit
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.25
    dual = POLICY_LOSSES["dual_clip"](lp, old, adv, mask, clip_low=0.2, clip_high=0.3, clip_c=2.5).token_loss
    cpgd = POLICY_LOSSES["cpgd"](lp, old, adv, mask, clip_low=0.2, clip_high=0.3).token_loss
    for b in range(B):
        for t in range(T):
            x = lp[b, t].item() - old[b, t].item()
            r, a = math.exp(x), adv[b, t].item()
            ppo = -min(r * a, min(max(r, 0.8), 1.3) * a)
            want_dual = min(ppo, -2.5 * a) if a < 0 else ppo
            want_cpgd = -min(x * a, min(max(x, math.log(0.8)), math.log(1.3)) * a)
            assert dual[b, t].item() == pytest.approx(want_dual if mask[b, t] else 0.0, abs=1e-12)
            assert cpgd[b, t].item() == pytest.approx(want_cpgd if mask[b, t] else 0.0, abs=1e-12)
