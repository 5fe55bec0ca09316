"""Advantage estimators, chosen by name from ``ADVANTAGE_ESTIMATORS``.

Each estimator takes tensors and keyword-only scalars and returns ``(advantages, returns)``,
both (B, T) float, zero where ``action_mask`` is False.
"""
from __future__ import annotations

from typing import Callable

import torch

from rft_core.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and unbiased group std.

    Args:
        values: (B,) float.
        group_ids: (B,) int, samples of one prompt share an id (any integers, any order).
    Returns:
        (mean, std), each (B,): the statistic of the sample's own group. A group of one sample
        has std 0 (the unbiased estimate is undefined there).
    """
    if values.shape != group_ids.shape or values.dim() != 1:
        raise ValueError(
            f"values and group_ids must both be (B,), got {tuple(values.shape)} and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.bincount(inverse, minlength=n_groups).to(values.dtype)
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    mean = sums / counts
    centered = values - mean[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, centered**2)
    var = torch.where(counts > 1, sq / (counts - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[inverse], var.sqrt()[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo", "group_norm")
def group_normalized_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps), std unbiased (Bessel), broadcast over the
    response tokens of sample i. With ``scale_by_std=False`` it is r_i - mean_g(r)
    (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).

    Args:
        rewards: (B,) float, one scalar reward per sample (any KL penalty already applied).
        group_ids: (B,) int, samples of one prompt share an id.
        action_mask: (B, T) bool.
    Returns:
        (advantages, returns): (B, T) each, zero where action_mask is False. For an outcome
        reward with gamma = 1, returns are the reward broadcast over the response.
    """
    mean, std = group_stats(rewards, group_ids)
    adv = rewards - mean
    if scale_by_std:
        adv = adv / (std + eps)
    zeros = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    advantages = torch.where(action_mask, adv[:, None], zeros)
    returns = torch.where(action_mask, rewards[:, None], zeros)
    return advantages, returns
