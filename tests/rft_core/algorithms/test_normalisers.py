"""Loss normalisers (entropy filter, GSPO's aggregation, Dr. GRPO's constant), overlong filtering,
the KL penalty after group normalisation, and the estimators' metadata."""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    group_normalized_advantages,
    kl_penalized_outcome_advantages,
)
from rft_core.algorithms.kl import kl_penalty
from rft_core.algorithms.masked import high_entropy_mask
from rft_core.algorithms.aggregation import LOSS_AGGREGATIONS, seq_mean_token_mean, seq_mean_token_sum_norm, token_mean
from rft_core.algorithms.policy_loss import POLICY_LOSSES, check_policy_loss_aggregation, ppo_clip_loss
from rft_core.algorithms.shaping import overlong_filter_mask

D = torch.float64


# ---------------------------------------------------------------- high-entropy token filter
def _entropy_case():
    full = torch.ones(2, 4, dtype=torch.bool)
    entropy = torch.tensor([[1.0, 7.0, 2.0, 3.0], [8.0, 4.0, 5.0, 6.0]], dtype=D)
    # quantile_0.75 of 1..8 (linear) = 6.25: keeps 7 and 8, rho = 2/8
    kept = high_entropy_mask(entropy, full, top_fraction=0.25)
    assert torch.equal(kept, torch.tensor([[False, True, False, False], [True, False, False, False]]))
    adv = torch.tensor([[0.5, 2.0, -1.0, 1.0], [-3.0, 1.0, 0.5, 0.25]], dtype=D)
    old = torch.log(torch.full((2, 4), 0.5, dtype=D))
    return full, kept, adv, old


def _policy_grad(old, adv, mask, agg_mask, num_tokens, weights=None):
    lp = old.clone().requires_grad_(True)
    out = ppo_clip_loss(lp, old, adv, mask, weights)
    (g,) = torch.autograd.grad(token_mean(out.token_loss, agg_mask, num_tokens=num_tokens), lp)
    return g


def test_kept_count_normaliser_is_one_over_rho_times_the_full_count_one():
    full, kept, adv, old = _entropy_case()
    n_full, n_kept = int(full.sum()), int(kept.sum())
    rho = n_kept / n_full
    # current caller: policy mask = action_mask & kept, normaliser = kept count
    g_kept = _policy_grad(old, adv, full & kept, full & kept, n_kept)
    # full-count normaliser: only kept tokens contribute (0/1 weights), every response token counted
    g_full = _policy_grad(old, adv, full, full, n_full, weights=kept.to(D))
    torch.testing.assert_close(g_kept, g_full / rho, rtol=0, atol=1e-15)
    # hand value at ratio 1: d/dlp of -A * exp(lp - old) = -A, on kept tokens, / 8
    want = torch.where(kept, -adv / 8, torch.zeros_like(adv))
    torch.testing.assert_close(g_full, want, rtol=0, atol=1e-15)
    # the same with the mask route: policy mask = kept, num_tokens = full count
    torch.testing.assert_close(_policy_grad(old, adv, full & kept, full & kept, n_full), want, rtol=0, atol=1e-15)


def test_entropy_filter_kl_term_applies_to_every_token_and_seq_mean_uses_full_lengths():
    full, kept, adv, old = _entropy_case()
    ref = old - torch.tensor([[0.1, -0.2, 0.3, 0.05], [0.0, 0.4, -0.1, 0.2]], dtype=D)
    lp = old.clone().requires_grad_(True)
    kl = kl_penalty(lp, ref, full, estimator="k2")
    (g_kl,) = torch.autograd.grad(token_mean(kl, full, num_tokens=8), lp)
    torch.testing.assert_close(g_kl, (old - ref) / 8, rtol=0, atol=1e-15)  # grad of k2 = log ratio, on all tokens
    assert (g_kl[~kept] != 0).all()
    # seq-mean-token-mean (TRL's "grpo" loss): per-sequence sums of the kept tokens over the full length
    loss = ppo_clip_loss(old, old, adv, full, kept.to(D)).token_loss
    want = ((-2.0 / 4) + (3.0 / 4)) / 2
    assert float(seq_mean_token_mean(loss, full)) == pytest.approx(want, abs=1e-15)


# ---------------------------------------------------------------- GSPO aggregation
def _gspo_sequence_weights(agg: str) -> torch.Tensor:
    lengths = [4, 2, 1]
    mask = torch.tensor([[t < n for t in range(4)] for n in lengths])
    adv_seq = torch.tensor([1.0, -2.0, 0.5], dtype=D)
    adv = adv_seq[:, None].expand(3, 4).clone()
    old = torch.log(torch.full((3, 4), 0.3, dtype=D))
    lp = old.clone().requires_grad_(True)  # s_i = 1, inside the clip range
    out = POLICY_LOSSES["gspo"](lp, old, adv, mask)
    (g,) = torch.autograd.grad(LOSS_AGGREGATIONS[agg](out.token_loss, mask), lp)
    # GSPO's gradient (arXiv:2507.18071 eq. 7 at s_i = 1): -(1/G) A_i (1/|y_i|) sum_t grad log pi(y_i,t),
    # so the summed per-sequence gradient is -A_i / G; its multiple is the sequence's weight
    return (g * mask).sum(-1) / (-adv_seq / 3)


def test_gspo_sequence_weights_token_mean_vs_seq_mean():
    mean_len = 7 / 3
    torch.testing.assert_close(_gspo_sequence_weights("token-mean"),
                               torch.tensor([4 / mean_len, 2 / mean_len, 1 / mean_len], dtype=D), rtol=0, atol=1e-14)
    assert [round(float(x), 2) for x in _gspo_sequence_weights("token-mean")] == [1.71, 0.86, 0.43]
    torch.testing.assert_close(_gspo_sequence_weights("seq-mean-token-mean"), torch.ones(3, dtype=D), rtol=0, atol=1e-14)


def test_policy_loss_info_and_check():
    assert POLICY_LOSSES.info("gspo").required_loss_agg == "seq-mean-token-mean"
    for name in ("ppo_clip", "dual_clip", "cpgd"):
        assert POLICY_LOSSES.info(name).required_loss_agg is None
        check_policy_loss_aggregation(name, "token-mean")
    check_policy_loss_aggregation("gspo", "seq-mean-token-mean")
    with pytest.raises(ValueError, match="'gspo' needs update.loss_agg='seq-mean-token-mean', got 'token-mean'"):
        check_policy_loss_aggregation("gspo", "token-mean")
    with pytest.raises(KeyError, match="valid names"):
        check_policy_loss_aggregation("gspo", "seq-mean")


# ---------------------------------------------------------------- Dr. GRPO's constant normaliser
def _padded(rows: list[list[float]], T: int):
    loss = torch.zeros(len(rows), T, dtype=D)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        loss[i, : len(r)] = torch.tensor(r, dtype=D)
        mask[i, : len(r)] = True
    return loss, mask


def test_seq_mean_token_sum_norm_with_fixed_norm_tokens_ignores_the_longest_response():
    short = [[1.0, 2.0, 3.0], [4.0, 5.0]]
    long_ = [[0.5] * 5]
    # the same two responses padded to their own longest (3) or to a longer batch's (5)
    a3, m3 = _padded(short, 3)
    a5, m5 = _padded(short, 5)
    kw = {"num_sequences": 3, "norm_tokens": 8}  # norm_tokens = rollout.max_new_tokens
    assert float(seq_mean_token_sum_norm(a3, m3, **kw)) == pytest.approx(15 / (3 * 8), abs=1e-15)
    assert float(seq_mean_token_sum_norm(a3, m3, **kw)) == float(seq_mean_token_sum_norm(a5, m5, **kw))
    # micro-batches summed equal the whole batch, whatever each one's longest response
    b, mb = _padded(long_, 5)
    whole, mw = _padded(short + long_, 5)
    total = seq_mean_token_sum_norm(a3, m3, **kw) + seq_mean_token_sum_norm(b, mb, **kw)
    assert float(total) == pytest.approx(float(seq_mean_token_sum_norm(whole, mw, **kw)), abs=1e-15)
    assert float(total) == pytest.approx(17.5 / 24, abs=1e-15)
    # the default (this batch's padded length) depends on it
    assert seq_mean_token_sum_norm(a3, m3, num_sequences=3) != seq_mean_token_sum_norm(a5, m5, num_sequences=3)


# ---------------------------------------------------------------- overlong filtering
def test_overlong_filter_mask():
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    out = overlong_filter_mask(mask, ["stop", "length", "stop"])
    assert torch.equal(out, torch.tensor([[True, True, False], [False, False, False], [True, False, False]]))
    with pytest.raises(ValueError, match=r"finish_reason\[2\] = 'eos'"):
        overlong_filter_mask(mask, ["stop", "length", "eos"])
    with pytest.raises(ValueError, match="2 finish reasons for 3 rows"):
        overlong_filter_mask(mask, ["stop", "stop"])
    with pytest.raises(ValueError, match="bool"):
        overlong_filter_mask(mask.float(), ["stop"] * 3)


# ---------------------------------------------------------------- KL penalty after group normalisation
def _kl_tokens(sums: list[float], T: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(len(sums), T, dtype=torch.bool)
    kl = torch.tensor(sums, dtype=D)[:, None].expand(len(sums), T) / T
    return kl.clone(), mask


def test_equal_rewards_give_advantages_no_larger_than_the_kl_term():
    rewards = torch.ones(4, dtype=D)
    groups = torch.zeros(4, dtype=torch.long)
    sums = [1e-4, 2e-4, 0.5e-4, 1.5e-4]
    kl, mask = _kl_tokens(sums)
    kl_coef = 0.1
    adv, ret = kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl, kl_coef=kl_coef)
    bound = kl_coef * torch.tensor(sums, dtype=D)
    assert (adv.abs().amax(-1) <= bound + 1e-18).all()
    torch.testing.assert_close(adv[:, 0], -bound, rtol=1e-12, atol=0)
    torch.testing.assert_close(ret[:, 0], 1 - bound, rtol=0, atol=1e-15)
    # the current order: penalty in the reward, then normalised by the group std of the tiny differences
    old, _ = group_normalized_advantages(rewards - kl_coef * kl.sum(-1), groups, mask)
    assert float(old.abs().max()) > 0.9
    assert float(old.abs().max()) > 1e3 * float(adv.abs().max())


def test_kl_after_normalisation_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D)
    groups = torch.zeros(4, dtype=torch.long)
    kl, mask = _kl_tokens([0.2, 0.0, 0.1, 0.0])
    z = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # (r - 0.5) / (unbiased std + eps)
    adv, _ = kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl, kl_coef=0.5)
    torch.testing.assert_close(adv[:, 0], torch.tensor([z - 0.1, -z, -z - 0.05, z], dtype=D), rtol=0, atol=1e-12)
    adv, _ = kl_penalized_outcome_advantages("dr_grpo", rewards, groups, mask, kl=kl, kl_coef=0.5)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.4, -0.5, -0.55, 0.5], dtype=D), rtol=0, atol=1e-15)
    adv, _ = kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl, kl_coef=0.5, scale_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.4, -0.5, -0.55, 0.5], dtype=D), rtol=0, atol=1e-15)


def test_kl_after_normalisation_keeps_the_kl_term_out_of_the_shaping_transform():
    from rft_core.algorithms.masked import masked_whiten

    # a batch in which every group has equal task rewards: whitening the penalised advantages
    # would blow the KL differences up to ~1; the transform sees only the task part (all zero)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=D)
    groups = torch.tensor([0, 0, 1, 1])
    kl, mask = _kl_tokens([0.01, 0.03, 0.02, 0.0])
    seen = []

    def whiten(a):
        seen.append(a.clone())
        return masked_whiten(a, mask)

    adv, _ = kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl, kl_coef=0.1, transform=whiten)
    assert float(seen[0].abs().max()) == 0.0  # the estimator's part, before the penalty
    torch.testing.assert_close(adv[:, 0], -0.1 * torch.tensor([0.01, 0.03, 0.02, 0.0], dtype=D), rtol=1e-12, atol=1e-18)
    whitened_after = masked_whiten(adv, mask)  # the other order, whiten(A - penalty): |A| ~ 1
    assert float(whitened_after.abs().max()) > 1.0
    # a transform with a task signal: (B, T) in, same shape out, penalty subtracted afterwards
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D)
    adv, _ = kl_penalized_outcome_advantages("dr_grpo", rewards, groups, mask, kl=kl, kl_coef=1.0,
                                             transform=lambda a: 2.0 * a)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0 - 0.01, -1.0 - 0.03, -0.02, 0.0], dtype=D),
                               rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="transform must keep the advantages' shape"):
        kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl, kl_coef=0.1, transform=lambda a: a[:, :1])


def test_kl_after_normalisation_errors():
    rewards, groups = torch.ones(2, dtype=D), torch.zeros(2, dtype=torch.long)
    kl, mask = _kl_tokens([0.1, 0.2])
    with pytest.raises(ValueError, match="token-level"):
        kl_penalized_outcome_advantages("reinforce", rewards, groups, mask, kl=kl, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl, kl_coef=-1.0)
    with pytest.raises(ValueError, match="shape"):
        kl_penalized_outcome_advantages("grpo", rewards, groups, mask, kl=kl[:, :2], kl_coef=0.1)


# ---------------------------------------------------------------- estimator metadata
def test_estimator_info_flags():
    names = ADVANTAGE_ESTIMATORS.names()
    otb = {"optimal_token_baseline", "tir_optimal_token_baseline"}
    assert {n for n in names if ADVANTAGE_ESTIMATORS.info(n).token_level} == {"reinforce", "reinforce_baseline", "gae",
                                                                              "remax"} | otb
    assert {n for n in names if ADVANTAGE_ESTIMATORS.info(n).needs_critic} == {"gae"}
    assert {n for n in names if ADVANTAGE_ESTIMATORS.info(n).greedy_baseline} == {"remax"}
    assert {n for n in names if ADVANTAGE_ESTIMATORS.info(n).needs_sum_pi_squared} == otb
    assert {n for n in names if ADVANTAGE_ESTIMATORS.info(n).needs_reward_sources} == {"gdpo"}


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_group_baseline_flag_matches_the_formula(name):
    # two groups, each with equal rewards (1 and 0): zero advantages iff a group statistic is subtracted
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=D)
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[True, True, True], [True, True, False], [True, True, True], [True, False, False]])
    kw = {"values": torch.tensor([[0.1, 0.2, 0.3]] * 4, dtype=D)} if ADVANTAGE_ESTIMATORS.info(name).needs_critic else {}
    if ADVANTAGE_ESTIMATORS.info(name).greedy_baseline:  # a greedy response of reward 0.5: not a group statistic
        kw["reward_baselines"] = torch.full((4,), 0.5, dtype=D)
    tol = 1e-9
    if ADVANTAGE_ESTIMATORS.info(name).needs_sum_pi_squared:
        # OTB: A = G eps / (sum W + eps) up to the second-longest length, but the longest response of a group
        # (row 0, 3 tokens vs 2) has baseline 0 past it (handle_zero_tail): A = G = 1 at its last token
        kw |= {"old_logprobs": torch.full((4, 3), math.log(0.5), dtype=D), "sum_pi_squared": torch.full((4, 3), 0.3, dtype=D)}
        tol = 1e-7
    if ADVANTAGE_ESTIMATORS.info(name).needs_reward_sources:  # GDPO: one source, the reward itself
        kw["source_rewards"] = {"r": rewards}
    adv, _ = ADVANTAGE_ESTIMATORS[name](rewards, groups, mask, **kw)
    assert bool((adv.abs() < tol).all()) == ADVANTAGE_ESTIMATORS.info(name).group_baseline
