"""Policy losses (per-token objectives) and their aggregation into a scalar.

A loss returns per-token terms (B, T); ``aggregate`` reduces them. Token-mean aggregation
takes an explicit ``num_tokens`` normalizer, so micro-batch losses summed under gradient
accumulation equal the full-batch loss exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rft_core.algorithms.masked import masked_mean, masked_sum
from rft_core.registry import Registry


@dataclass(frozen=True)
class PolicyLossOutput:
    """Per-token loss terms and diagnostics.

    Attributes:
        token_loss: (B, T) float, the per-token objective to minimise (0 where masked).
        clipped: (B, T) bool, True where the clipped branch was the active one.
        log_ratio: (B, T) float, logprobs - old_logprobs.
    """

    token_loss: torch.Tensor
    clipped: torch.Tensor
    log_ratio: torch.Tensor


PolicyLoss = Callable[..., PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
LOSS_AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("loss aggregation")

MAX_LOG_RATIO = 20.0


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), per token.

    ratio_t = exp(logprobs_t - old_logprobs_t)
    L_t = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t)
    Separate ``clip_low`` / ``clip_high`` give DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).
    The log-ratio is clamped to [-20, 20] before the exp so the ratio stays finite.

    Args:
        logprobs: (B, T) float, current policy log-probs of the taken tokens (requires grad).
        old_logprobs: (B, T) float, log-probs under the policy that generated the rollout.
        advantages: (B, T) float.
        action_mask: (B, T) bool.
    Returns:
        PolicyLossOutput with (B, T) terms, zero where action_mask is False.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -torch.minimum(surr1, surr2)
    zeros = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=(surr2 < surr1) & action_mask,
        log_ratio=torch.where(action_mask, log_ratio, zeros),
    )


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(token_loss: torch.Tensor, action_mask: torch.Tensor, *, num_tokens: float | None = None) -> torch.Tensor:
    """sum over all unmasked tokens / num_tokens (default: the unmasked count of this batch).

    Pass the full batch's token count as ``num_tokens`` in every micro-batch so that the summed
    micro-batch losses equal the full-batch loss.
    """
    denom = float(action_mask.sum().clamp(min=1)) if num_tokens is None else max(float(num_tokens), 1.0)
    return masked_sum(token_loss, action_mask) / denom


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    token_loss: torch.Tensor, action_mask: torch.Tensor, *, num_sequences: float | None = None
) -> torch.Tensor:
    """mean over sequences of (mean over that sequence's unmasked tokens).

    ``num_sequences`` (default: B of this batch) plays the role of ``num_tokens`` above.
    An all-masked row contributes 0.
    """
    per_seq = masked_mean(token_loss, action_mask, dim=-1)
    denom = float(per_seq.shape[0]) if num_sequences is None else max(float(num_sequences), 1.0)
    return per_seq.sum() / denom
