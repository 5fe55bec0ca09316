"""Group-statistic advantage estimators beyond GRPO: GPG's corrected group advantage (Chu et al.
2025, arXiv:2504.02546) and GDPO's per-reward group normalisation (Liu et al. 2026,
arXiv:2601.05242). Registered in ``ADVANTAGE_ESTIMATORS`` when ``rft_core.algorithms`` is imported."""
from __future__ import annotations

from typing import Mapping

import torch

from rft_core.algorithms.advantages import (
    _OUTCOME_GROUP,
    ADVANTAGE_ESTIMATORS,
    EstimatorInfo,
    _broadcast,
    group_stats,
)
from rft_core.algorithms.masked import masked_whiten


def _flat_groups(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the sample's group has one value only (max == min; a group of one included),
    compared exactly, not through a std that rounding can leave at 1e-17."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    hi = torch.full((n,), -torch.inf, dtype=values.dtype).scatter_reduce(0, inverse, values, "amax")
    lo = torch.full((n,), torch.inf, dtype=values.dtype).scatter_reduce(0, inverse, values, "amin")
    return (hi == lo)[inverse]


@ADVANTAGE_ESTIMATORS.register("gpg", info=_OUTCOME_GROUP)
def gpg_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    scale_by_std: bool = False,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG's corrected group advantage (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning", arXiv:2504.02546, "accurate gradient estimation"):

        A_i = alpha (r_i - mean_g r) / F_norm,   alpha = B / (B - M),

    B the samples of the rollout, M those whose group's rewards are all equal (their advantage
    is 0 whatever alpha: they carry no gradient, so the mean over B would shrink the gradient of
    the others by (B - M) / B; alpha undoes that). F_norm = 1 (default: the paper's best run,
    "F_norm = 1, alpha = B / (B - M)") or, with ``scale_by_std``, std_g(r) + eps (unbiased std).
    alpha = 1 when every group is flat (all advantages are 0 then). Broadcast over the response.

    As the authors' code (``open-r1/src/open_r1/gpg_trainer.py`` of github.com/AMAP-ML/GPG:
    ``inverse_alpha`` = groups with spread / groups, the loss divided by it; eps 1e-4). Their
    threshold beta_th (keep sampling until a fraction beta_th of the groups has spread) is
    dynamic sampling, not part of the estimator (``dynamic_sampling``, which drops flat groups:
    M = 0 and alpha = 1 then).

    verl's ``compute_gpg_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``, verl commit
    1dda039b) departs from the paper: its alpha is B / (number of samples with a non-zero
    reward), which equals B / (B - M) only when the zero rewards are exactly the flat groups'
    (for 0/1 rewards it is 1 / accuracy instead); and a group of one gets mean 0 there (A = alpha r),
    0 here (its reward has no group to compare with). Its f_norm is a constant (1).

    Args:
        rewards: (B,) float; group_ids: (B,) int; action_mask: (B, T) bool.
        scale_by_std: F_norm = std_g + eps instead of 1.
        eps: added to the std (the authors' 1e-4).
    Returns:
        (advantages, returns = the reward broadcast), (B, T) each, zero where masked.
    """
    mean, std = group_stats(rewards, group_ids)
    flat = _flat_groups(rewards, group_ids)
    B, M = len(rewards), int(flat.sum())
    alpha = B / (B - M) if B > M else 1.0
    centred = torch.where(flat, torch.zeros_like(rewards), rewards - mean)
    adv = alpha * (centred / (std + eps) if scale_by_std else centred)
    return _broadcast(adv, action_mask), _broadcast(rewards, action_mask)


GDPO_INFO = EstimatorInfo(token_level=False, needs_critic=False, group_baseline=True, needs_reward_sources=True)


@ADVANTAGE_ESTIMATORS.register("gdpo", info=GDPO_INFO)
def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    source_rewards: Mapping[str, torch.Tensor],
    reward_weights: Mapping[str, float] | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    batch_norm: str = "samples",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO advantages (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization", arXiv:2601.05242): each reward is normalised
    within its group before the rewards are combined, then the sum is normalised over the batch:

        A^k_i = (s^k_i - mean_g s^k) / (std_g s^k + eps)      per reward source k (GRPO's form)
        S_i = sum_k w_k A^k_i
        A_i = (S_i - mean_B S) / (std_B S + eps)               ``batch_norm="samples"``

    GRPO's (sum_k w_k s^k - mean) / std lets a dominant reward drown the others and maps distinct
    reward combinations to one advantage; normalising each first keeps them apart. The batch
    normalisation keeps the sum's scale independent of the number of rewards. std unbiased, as
    the authors' TRL implementation (``trl-GDPO`` of github.com/NVlabs/GDPO: per-reward group
    mean/std, weighted sum, then mean/std over the batch's samples).

    ``batch_norm``: "samples" (the paper's and the authors' TRL code: one value per sample),
    "tokens" (verl's ``compute_gdpo_outcome_advantage``, ``verl/trainer/ppo/core_algos.py``, verl
    commit 1dda039b, and the authors' verl port: ``masked_whiten`` over the response tokens, i.e.
    each sample weighted by its length, (S - mean) / sqrt(var + 1e-8)), or "none" (S itself).
    verl also gives a group of one mean 0 and std 1 (A^k = s^k / (1 + eps)); here such a group's
    A^k is 0, as GRPO's (``group_stats``). A group whose scores of every source are equal has
    S = 0; with ``batch_norm="samples"`` it keeps A = 0 (up to rounding: each group's centred
    scores sum to 0, so mean_B S = 0; ``group_baseline``), while verl's token whitening gives it
    -mean_T S / std_T S, the length-weighted mean being no longer 0.

    Args:
        rewards: (B,) float, the combined reward (used for the returns and the shape only).
        group_ids: (B,) int; action_mask: (B, T) bool.
        source_rewards: source name -> (B,) float score of that source (the rewards shard's
            ``reward_metrics[name]``), NaN where the sample's recipe has no such source. A group
            has a source for all its samples or for none.
        reward_weights: source name -> w_k; None: every source of ``source_rewards`` with weight 1
            (verl's default ``gdpo_reward_weights``).
        scale_by_std: divide by std_g + eps (False: s - mean_g, Dr. GRPO's form per reward).
        eps: added to both stds (verl's GRPO 1e-6; the authors' TRL code uses 1e-4).
        batch_norm: "samples", "tokens" or "none" (above).
    Returns:
        (advantages, returns = the reward broadcast), (B, T) each, zero where masked.
    Raises:
        ValueError: no source, a weighted source missing from ``source_rewards`` or present in no
            sample, a score of another shape, a group where some samples have a source and others
            not, or an unknown ``batch_norm``.
    """
    if batch_norm not in ("samples", "tokens", "none"):
        raise ValueError(f"gdpo: unknown batch_norm {batch_norm!r}; valid: samples, tokens, none")
    weights = dict(reward_weights) if reward_weights is not None else {k: 1.0 for k in source_rewards}
    if not weights:
        raise ValueError("gdpo needs at least one reward source score (the rewards shard's reward_metrics)")
    missing = sorted(set(weights) - set(source_rewards))
    if missing:
        raise ValueError(f"gdpo: advantage.reward_weights names {missing}, which no sample's reward_metrics has "
                         f"(scores found: {sorted(source_rewards)})")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    total = torch.zeros_like(rewards)
    for name, w in weights.items():
        s = source_rewards[name].to(rewards.dtype)
        if s.shape != rewards.shape:
            raise ValueError(f"gdpo: the scores of source {name!r} have shape {tuple(s.shape)}, not {tuple(rewards.shape)}")
        present = ~torch.isnan(s)
        if not bool(present.any()):
            raise ValueError(f"gdpo: no sample has a score of source {name!r}: no recipe uses it")
        mixed = torch.unique(inverse[present])[torch.isin(torch.unique(inverse[present]), inverse[~present])]
        if len(mixed):
            raise ValueError(f"gdpo: source {name!r} scores some samples of a group and not others (group "
                             f"{int(group_ids[inverse == mixed[0]][0])}): every sample of a prompt uses one recipe")
        idx = torch.nonzero(present).flatten()
        sk, gk = s[idx], group_ids[idx]
        mean, std = group_stats(sk, gk)
        a = torch.where(_flat_groups(sk, gk), torch.zeros_like(sk), sk - mean)
        if scale_by_std:
            a = a / (std + eps)
        total[idx] += w * a
    if batch_norm == "samples":
        std = total.std(unbiased=True) if len(total) > 1 else torch.zeros((), dtype=total.dtype)
        adv = _broadcast((total - total.mean()) / (std + eps), action_mask)
    elif batch_norm == "tokens":
        adv = torch.where(action_mask, masked_whiten(_broadcast(total, action_mask), action_mask), 0.0)
    else:
        adv = _broadcast(total, action_mask)
    return adv, _broadcast(rewards, action_mask)
