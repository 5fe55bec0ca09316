"""Policy losses (per-token objectives) and their aggregation into a scalar.

A loss returns per-token terms (B, T); ``aggregate`` reduces them. Token-mean aggregation
takes an explicit ``num_tokens`` normalizer, so micro-batch losses summed under gradient
accumulation equal the full-batch loss exactly.

Every loss takes an optional ``weights`` (B, T) that multiplies its per-token loss (detached;
None: unchanged). It carries the rollout/trainer mismatch correction (``correction.py``) and
the high-entropy token filter as 0/1 weights, so that the aggregation can still count every
response token in its normaliser (see docs/algorithms.md, "Loss normalisers").

``POLICY_LOSSES.info(name)`` is a ``PolicyLossInfo``: the aggregation a loss requires (GSPO
is sequence-level) or None; ``check_policy_loss_aggregation`` refuses a mismatch.
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


@dataclass(frozen=True)
class PolicyLossInfo:
    """What a caller must know about a policy loss (``POLICY_LOSSES.info(name)``).

    Attributes:
        required_loss_agg: the name in ``LOSS_AGGREGATIONS`` the loss's paper defines it with,
            or None when any aggregation is the loss's own choice.
        reason: why (shown by ``check_policy_loss_aggregation``).
    """

    required_loss_agg: str | None = None
    reason: str = ""


PolicyLoss = Callable[..., PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
LOSS_AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("loss aggregation")

MAX_LOG_RATIO = 20.0
_ANY_AGG = PolicyLossInfo()
_GSPO_INFO = PolicyLossInfo(
    "seq-mean-token-mean",
    "GSPO's objective is sequence-level (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7): each response's "
    "gradient is weighted 1/G, its tokens 1/|y_i|; token-mean would weight each response by its length "
    "relative to the batch's mean length (OpenRLHF forces the per-sample mean for gspo too)",
)


def apply_token_weights(token_loss: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """token_loss * sg(weights), or token_loss unchanged when ``weights`` is None.

    Args:
        token_loss: (B, T) float per-token loss.
        weights: (B, T) float, e.g. truncated IS weights (``rollout_correction``) times a 0/1
            entropy-filter mask; detached here (a weight changes the measure, not the objective).
    Raises:
        ValueError: ``weights`` of another shape.
    """
    if weights is None:
        return token_loss
    if weights.shape != token_loss.shape:
        raise ValueError(
            f"policy loss weights must have the token loss's shape {tuple(token_loss.shape)}, got {tuple(weights.shape)}"
        )
    return token_loss * weights.detach().to(token_loss.dtype)


def check_policy_loss_aggregation(policy_loss: str, loss_agg: str) -> None:
    """Refuse an aggregation other than the one the policy loss's paper defines.

    Raises:
        UnknownNameError: unknown ``policy_loss`` or ``loss_agg``.
        ValueError: ``POLICY_LOSSES.info(policy_loss).required_loss_agg`` is set and differs
            from ``loss_agg``; the message says why.
    """
    LOSS_AGGREGATIONS[loss_agg]
    info = POLICY_LOSSES.info(policy_loss)
    if info.required_loss_agg is not None and loss_agg != info.required_loss_agg:
        raise ValueError(
            f"policy loss {policy_loss!r} needs update.loss_agg={info.required_loss_agg!r}, got {loss_agg!r}: {info.reason}"
        )


@POLICY_LOSSES.register("ppo_clip", info=_ANY_AGG)
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
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
        weights: optional (B, T) float multiplying each token's loss (``apply_token_weights``).
    Returns:
        PolicyLossOutput with (B, T) terms, zero where action_mask is False.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = apply_token_weights(-torch.minimum(surr1, surr2), weights)
    zeros = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=(surr2 < surr1) & action_mask,
        log_ratio=torch.where(action_mask, log_ratio, zeros),
    )


@POLICY_LOSSES.register("dual_clip", info=_ANY_AGG)
def dual_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> PolicyLossOutput:
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729, eq. 5), per token.

    For A >= 0 it is the PPO clip loss. For A < 0 the loss is also capped at -clip_c * A, so a
    huge ratio on a negative-advantage token cannot produce an unbounded update:
    L_t = min(max(-r A, -clip(r) A), -clip_c A) when A < 0.

    ``weights`` (B, T), optional, multiplies the final per-token loss (``apply_token_weights``).

    Raises:
        ValueError: ``clip_c`` <= 1, or ``weights`` of another shape.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    base = ppo_clip_loss(logprobs, old_logprobs, advantages, action_mask, clip_low=clip_low, clip_high=clip_high)
    cap = -clip_c * advantages
    capped = torch.minimum(base.token_loss, cap)
    neg = (advantages < 0) & action_mask
    token_loss = apply_token_weights(torch.where(neg, capped, base.token_loss), weights)
    zeros = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=base.clipped | (neg & (cap < base.token_loss)),
        log_ratio=base.log_ratio,
    )


@POLICY_LOSSES.register("gspo", info=_GSPO_INFO)
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLossOutput:
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7, token form).

    s_i = exp(mean_t (logprobs - old_logprobs)) over the response of sample i; the token-level
    ratio is s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] (value s_i, gradient s_i * grad log pi(y_t));
    L_t = -min(s_i,t A_t, clip(s_i,t, 1 - clip_low, 1 + clip_high) A_t). The paper's clip range
    is tiny (3e-4 / 4e-4) because s_i is a geometric mean. The paper's objective is
    sequence-level: aggregate with seq-mean-token-mean (``POLICY_LOSSES.info("gspo")``,
    ``check_policy_loss_aggregation``). ``weights`` (B, T), optional, multiplies each token's
    loss (``apply_token_weights``); a sequence-level correction (one weight per response) keeps
    the objective sequence-level.
    """
    zeros = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(action_mask, logprobs - old_logprobs, zeros)
    n = action_mask.sum(-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (log_ratio.sum(-1, keepdim=True) / n).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    token_loss = apply_token_weights(-torch.minimum(surr1, surr2), weights)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=(surr2 < surr1) & action_mask,
        log_ratio=torch.where(action_mask, seq_log_ratio.expand_as(logprobs), zeros),
    )


@POLICY_LOSSES.register("cpgd", info=_ANY_AGG)
def cpgd_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> PolicyLossOutput:
    """CPGD's clipped log-ratio objective (Liu et al. 2025, arXiv:2505.12504, eq. 6), per token.

    L_t = -min(log_ratio_t A_t, clip(log_ratio_t, ln(1 - clip_low), ln(1 + clip_high)) A_t)
    with log_ratio = logprobs - old_logprobs: the ratio of PPO is replaced by its logarithm, so
    the update stays bounded. The paper's policy-drift term is a KL to the old policy, not to
    the reference: it is ``cpgd_policy_drift`` (``kl.py``), added by the caller as its own term.
    ``weights`` (B, T), optional, multiplies each token's loss (``apply_token_weights``).
    """
    zeros = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    surr1 = log_ratio * advantages
    lo, hi = math.log(1.0 - clip_low), math.log(1.0 + clip_high)
    surr2 = log_ratio.clamp(lo, hi) * advantages
    token_loss = apply_token_weights(-torch.minimum(surr1, surr2), weights)
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
    per-sequence mean. ``norm_tokens`` defaults to this batch's padded length T, which depends
    on the batch's longest response; pass a constant (the generation budget,
    ``rollout.max_new_tokens``, as Dr. GRPO and TRL's ``dr_grpo`` loss do) so the loss of a
    sequence does not depend on which other responses share its batch.
    """
    T = float(action_mask.shape[-1]) if norm_tokens is None else max(float(norm_tokens), 1.0)
    return masked_sum(token_loss, action_mask) / (_num_seq(token_loss, num_sequences) * T)
