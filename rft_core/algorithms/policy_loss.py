"""Policy losses (per-token objectives) and their aggregation into a scalar.

A loss returns per-token terms (B, T); ``aggregate`` reduces them. Token-mean aggregation
takes an explicit ``num_tokens`` normalizer, so micro-batch losses summed under gradient
accumulation equal the full-batch loss exactly.
"""
from __future__ import annotations

import math
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


@POLICY_LOSSES.register("dual_clip")
def dual_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> PolicyLossOutput:
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729, eq. 5), per token.

    For A >= 0 it is the PPO clip loss. For A < 0 the loss is also capped at -clip_c * A, so a
    huge ratio on a negative-advantage token cannot produce an unbounded update:
    L_t = min(max(-r A, -clip(r) A), -clip_c A) when A < 0.

    Raises:
        ValueError: ``clip_c`` <= 1.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    base = ppo_clip_loss(logprobs, old_logprobs, advantages, action_mask, clip_low=clip_low, clip_high=clip_high)
    cap = -clip_c * advantages
    capped = torch.minimum(base.token_loss, cap)
    neg = (advantages < 0) & action_mask
    token_loss = torch.where(neg, capped, base.token_loss)
    zeros = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=base.clipped | (neg & (cap < base.token_loss)),
        log_ratio=base.log_ratio,
    )


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLossOutput:
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7, token form).

    s_i = exp(mean_t (logprobs - old_logprobs)) over the response of sample i; the token-level
    ratio is s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] (value s_i, gradient s_i * grad log pi(y_t));
    L_t = -min(s_i,t A_t, clip(s_i,t, 1 - clip_low, 1 + clip_high) A_t). The paper's clip range
    is tiny (3e-4 / 4e-4) because s_i is a geometric mean. Use with seq-mean-token-mean.
    """
    zeros = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(action_mask, logprobs - old_logprobs, zeros)
    n = action_mask.sum(-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (log_ratio.sum(-1, keepdim=True) / n).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = -torch.minimum(surr1, surr2)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=(surr2 < surr1) & action_mask,
        log_ratio=torch.where(action_mask, seq_log_ratio.expand_as(logprobs), zeros),
    )


@POLICY_LOSSES.register("cpgd")
def cpgd_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> PolicyLossOutput:
    """CPGD's clipped log-ratio objective (Liu et al. 2025, arXiv:2505.12504, eq. 6), per token.

    L_t = -min(log_ratio_t A_t, clip(log_ratio_t, ln(1 - clip_low), ln(1 + clip_high)) A_t)
    with log_ratio = logprobs - old_logprobs: the ratio of PPO is replaced by its logarithm, so
    the update stays bounded. The paper's policy-drift term (a KL to the old policy) is not part
    of this function; add it with the KL loss term.
    """
    zeros = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    surr1 = log_ratio * advantages
    lo, hi = math.log(1.0 - clip_low), math.log(1.0 + clip_high)
    surr2 = log_ratio.clamp(lo, hi) * advantages
    token_loss = -torch.minimum(surr1, surr2)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=(surr2 < surr1) & action_mask,
        log_ratio=torch.where(action_mask, log_ratio, zeros),
    )


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """sum over all unmasked tokens / num_tokens (default: the unmasked count of this batch).

    Every aggregation takes the same keywords: ``num_tokens`` / ``num_sequences`` are the totals
    of the whole mini-batch, passed to each of its micro-batches so that the summed
    micro-batch losses equal the mini-batch loss.
    """
    denom = float(action_mask.sum().clamp(min=1)) if num_tokens is None else max(float(num_tokens), 1.0)
    return masked_sum(token_loss, action_mask) / denom


def _num_seq(token_loss: torch.Tensor, num_sequences: float | None) -> float:
    return float(token_loss.shape[0]) if num_sequences is None else max(float(num_sequences), 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """mean over sequences of (mean over that sequence's unmasked tokens) (GRPO's original form,
    Shao et al. 2024, eq. 3). An all-masked row contributes 0."""
    per_seq = masked_mean(token_loss, action_mask, dim=-1)
    return per_seq.sum() / _num_seq(token_loss, num_sequences)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """mean over sequences of (sum over that sequence's unmasked tokens)."""
    return masked_sum(token_loss, action_mask, dim=-1).sum() / _num_seq(token_loss, num_sequences)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """sum over all unmasked tokens / (num_sequences * norm_tokens): Dr. GRPO's constant
    normaliser (Liu et al. 2025, arXiv:2503.20783, sec. 3.2), free of the length bias of the
    per-sequence mean. ``norm_tokens`` defaults to this batch's padded length T.
    """
    T = float(action_mask.shape[-1]) if norm_tokens is None else max(float(norm_tokens), 1.0)
    return masked_sum(token_loss, action_mask) / (_num_seq(token_loss, num_sequences) * T)
