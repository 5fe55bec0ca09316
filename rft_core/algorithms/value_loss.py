"""Critic (value) losses, chosen by name from ``VALUE_LOSSES``."""
from __future__ import annotations

from typing import Callable

import torch

from rft_core.registry import Registry

VALUE_LOSSES: Registry[Callable[..., torch.Tensor]] = Registry("value loss")


@VALUE_LOSSES.register("clipped_mse")
def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    value_clip: float | None = 0.2,
) -> torch.Tensor:
    """PPO's clipped value loss, per token (Schulman et al. 2017 as implemented in OpenAI
    baselines ppo2; Andrychowicz et al. 2021, arXiv:2006.05990, sec. 3.5).

    V_clip = old + clip(V - old, -value_clip, value_clip)
    L_t = 0.5 * max((V - R)^2, (V_clip - R)^2), or 0.5 (V - R)^2 when value_clip is None.

    Args:
        values: (B, T) float, current critic values (requires grad).
        old_values: (B, T) float, values from the critic stage (before the update).
        returns: (B, T) float, targets (A + V_old for GAE).
        action_mask: (B, T) bool.
    Returns:
        (B, T) per-token losses, zero where masked (aggregate with LOSS_AGGREGATIONS).
    """
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    unclipped = (values - returns) ** 2
    if value_clip is None:
        loss = 0.5 * unclipped
    else:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss = 0.5 * torch.maximum(unclipped, (clipped - returns) ** 2)
    return torch.where(action_mask, loss, zeros)
