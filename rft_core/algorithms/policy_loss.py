"""Policy losses (per-token objectives) and their aggregation into a scalar.

A loss returns per-token terms (B, T); ``aggregate`` reduces them. Token-mean aggregation
takes an explicit ``num_tokens`` normalizer, so micro-batch losses summed under gradient
accumulation equal the full-batch loss exactly.

Every loss takes an optional ``weights`` (B, T) that multiplies its per-token loss (detached;
None: unchanged). It carries the rollout/trainer mismatch correction (``correction.py``) and
the high-entropy token filter as 0/1 weights, so that the aggregation can still count every
response token in its normaliser (see docs/algorithms.md, "Loss normalisers").

``POLICY_LOSSES.info(name)`` is a ``PolicyLossInfo``: the aggregation a loss requires (GSPO,
GMPO and SAPO are sequence-level) or None, and whether a token's loss depends on the other
sequences of the same call (``clip_cov``, ``kl_cov``); ``check_policy_loss_aggregation``
refuses a mismatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from rft_core.algorithms.aggregation import LOSS_AGGREGATIONS  # noqa: F401  (where callers have always found it)
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
        batch_dependent: True when a token's loss depends on the tokens of *other sequences*
            passed in the same call: ``clip_cov`` and ``kl_cov`` pick tokens by a covariance
            over the call's tokens, so (as in verl, which calls them per micro-batch) the
            micro-batch split changes which tokens are picked, and micro-batch losses do not
            sum to the mini-batch loss. False for every other loss: each sequence's loss is its own.
    """

    required_loss_agg: str | None = None
    reason: str = ""
    batch_dependent: bool = False


PolicyLoss = Callable[..., PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

MAX_LOG_RATIO = 20.0
_ANY_AGG = PolicyLossInfo()
_GSPO_INFO = PolicyLossInfo(
    "seq-mean-token-mean",
    "GSPO's objective is sequence-level (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7): each response's "
    "gradient is weighted 1/G, its tokens 1/|y_i|; token-mean would weight each response by its length "
    "relative to the batch's mean length (OpenRLHF forces the per-sample mean for gspo too)",
)

_GMPO_INFO = PolicyLossInfo(
    "seq-mean-token-mean",
    "GMPO's objective is sequence-level (Zhao et al. 2025, arXiv:2507.20673): one geometric-mean ratio per "
    "response, each response weighted 1/G; every token of a response carries the response's loss, so only "
    "seq-mean-token-mean gives back the paper's objective (verl's geo_mean ignores loss_agg_mode and takes the "
    "mean over responses); token-mean would weight each response by its length",
)
_SAPO_INFO = PolicyLossInfo(
    "seq-mean-token-mean",
    "SAPO's objective averages the gated token terms per response, then over the G responses (Gao et al. 2025, "
    "arXiv:2511.20347, GRPO's form); verl's sapo loss always aggregates with seq-mean-token-mean",
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


def _masked_output(
    token_loss: torch.Tensor, clipped: torch.Tensor, log_ratio: torch.Tensor, action_mask: torch.Tensor
) -> PolicyLossOutput:
    """A loss's (B, T) terms zeroed outside ``action_mask`` (tokens the policy did not sample)."""
    zeros = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return PolicyLossOutput(
        token_loss=torch.where(action_mask, token_loss, zeros),
        clipped=clipped & action_mask,
        log_ratio=torch.where(action_mask, log_ratio, zeros),
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
    return _masked_output(token_loss, surr2 < surr1, log_ratio, action_mask)


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


@POLICY_LOSSES.register("cispo", info=_ANY_AGG)
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.2,
) -> PolicyLossOutput:
    """CISPO, clipped IS-weight policy optimization (MiniMax 2025, arXiv:2506.13585, eq. 4-5), per token.

    r_t = exp(logprobs_t - old_logprobs_t) (log-ratio clamped to [-20, 20]);
    w_t = sg(clip(r_t, 1 - clip_low, 1 + clip_high));  L_t = -w_t * A_t * logprobs_t.
    A REINFORCE term weighted by a clipped, detached importance weight: unlike PPO's clip, no
    token's gradient is ever zeroed, the weight only bounds it (gradient -w_t A_t grad log pi).
    ``clip_low`` None means no lower bound: the paper "did not impose a lower bound on the IS
    weight" and tuned only eps_high; it gives no value for eps_high: 0.2 is the one of
    verl's example run (``examples/cispo_trainer``, clip_ratio_high=0.2 with clip_ratio_low=10,
    i.e. no lower bound). Eq. 4 normalises by the number of tokens of the batch: token-mean, the
    default aggregation (any is accepted, as in verl). Checked against verl
    ``compute_policy_loss_cispo`` (``verl/trainer/ppo/core_algos.py``, commit b178a3cd), value
    and gradient (``tests/rft_core/algorithms/test_policy_losses_2025.py``).

    Args:
        logprobs: (B, T) float, current policy log-probs of the taken tokens (requires grad).
        old_logprobs: (B, T) float, log-probs under the policy that generated the rollout.
        advantages: (B, T) float.
        action_mask: (B, T) bool.
        weights: optional (B, T) float multiplying each token's loss (``apply_token_weights``).
        clip_low: eps_low (>= 0) or None for no lower bound.
        clip_high: eps_high (>= 0).
    Returns:
        PolicyLossOutput, (B, T) terms zero where action_mask is False; ``clipped`` is True where
        the weight was clipped.
    Raises:
        ValueError: a negative ``clip_low`` or ``clip_high``, or ``weights`` of another shape.
    """
    if clip_high < 0 or (clip_low is not None and clip_low < 0):
        raise ValueError(f"cispo: clip_low and clip_high must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)
    token_loss = apply_token_weights(-weight * advantages * logprobs, weights)
    return _masked_output(token_loss, weight != ratio, log_ratio, action_mask)


@POLICY_LOSSES.register("gmpo", "geo_mean", info=_GMPO_INFO)
def gmpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> PolicyLossOutput:
    """GMPO, geometric-mean policy optimization (Zhao et al. 2025, arXiv:2507.20673), verl's ``geo_mean``.

    The paper's objective: per response i, the geometric mean of the token terms,
    J_i = sgn(A_i) * (prod_t |min(rho_t A_i, clip(rho_t, e^-clip_low, e^clip_high) A_i)|)^(1/|o_i|),
    J = 1/G sum_i J_i; in log space, with l_t = logprobs_t - old_logprobs_t, J_i = A_i s_i where
      l'_t = sgn(A_t) * min(sgn(A_t) l_t, sgn(A_t) clip(l_t, -clip_low, clip_high))   (token-level clip)
      s_i  = exp(mean_t l'_t);   L_i = -A_i s_i,   A_i = mean_t A_t over the response.
    The clip range is in log space: the paper's (e^-0.4, e^0.4) is ``clip_low = clip_high = 0.4``
    (verl's GMPO example, ``examples/gmpo_trainer``). The paper assumes one advantage per
    response (outcome rewards); with token-level advantages A_i is their mean over the response,
    as in verl. Each token of response i carries L_i (gradient through s_i), so the loss needs
    ``seq-mean-token-mean`` (``POLICY_LOSSES.info("gmpo")``): mean_i L_i, the paper's
    1/G sum over responses (verl: ``torch.mean`` over the responses). ``weights`` (B, T)
    multiply each token's copy of L_i: under seq-mean-token-mean a response's loss is scaled
    by the arithmetic mean of its token weights (verl scales it by their geometric mean).
    l_t is clamped to [-20, 20] (verl leaves it unclamped); no other difference.
    Checked against verl ``compute_policy_loss_geo_mean`` (``core_algos.py``, commit b178a3cd),
    value and gradient.

    Args:
        logprobs, old_logprobs, advantages: (B, T) float; action_mask: (B, T) bool.
        weights: optional (B, T) float (``apply_token_weights``).
        clip_low, clip_high: the log-space clip range (>= 0).
    Returns:
        PolicyLossOutput: ``token_loss`` (B, T) is L_i on every unmasked token of response i;
        ``clipped`` is True where the clipped branch of the token's min was active;
        ``log_ratio`` is l_t.
    Raises:
        ValueError: a negative ``clip_low`` or ``clip_high``, or ``weights`` of another shape.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"gmpo: clip_low and clip_high must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    zeros = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(action_mask, (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), zeros)
    sign = torch.sign(advantages)
    clipped_ratio = log_ratio.clamp(-clip_low, clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped_ratio)
    n = action_mask.sum(-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    seq_ratio = torch.exp(torch.where(action_mask, kept, zeros).sum(-1, keepdim=True) / n)
    seq_adv = torch.where(action_mask, advantages, zeros).sum(-1, keepdim=True) / n
    token_loss = apply_token_weights((-seq_adv * seq_ratio).expand_as(logprobs), weights)
    return _masked_output(token_loss, sign * clipped_ratio < sign * log_ratio, log_ratio, action_mask)


@POLICY_LOSSES.register("sapo", info=_SAPO_INFO)
def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLossOutput:
    """SAPO, soft adaptive policy optimization (Gao et al. 2025, Qwen, arXiv:2511.20347), per token.

    r_t = exp(logprobs_t - old_logprobs_t) (log-ratio clamped to [-20, 20]);
    tau_t = tau_pos if A_t > 0 else tau_neg;  f_t = sigmoid(tau_t (r_t - 1)) * 4 / tau_t;
    L_t = -f_t A_t.
    A smooth, temperature-controlled gate in place of PPO's hard clip: the gradient weight
    df/dr = 4 sigma (1 - sigma) is 1 at r = 1 (the on-policy gradient, as PPO's) and decays
    smoothly as r leaves 1, faster for larger tau. The paper's defaults, tau_pos = 1.0 and
    tau_neg = 1.05 (tau_neg > tau_pos damps negative-advantage updates faster), are verl's
    (``actor.tau_pos``/``tau_neg``). The objective is GRPO's form (per-response token mean,
    then mean over responses): ``POLICY_LOSSES.info("sapo")`` requires seq-mean-token-mean, which
    verl's sapo loss applies whatever its ``loss_agg_mode``. No token is clipped: ``clipped`` is all False.
    Checked against verl ``compute_policy_loss_sapo`` (``core_algos.py``, commit b178a3cd),
    value and gradient.

    Args:
        logprobs, old_logprobs, advantages: (B, T) float; action_mask: (B, T) bool.
        weights: optional (B, T) float (``apply_token_weights``).
        tau_pos, tau_neg: gate temperatures (> 0) for A > 0 and A <= 0.
    Raises:
        ValueError: a temperature <= 0, or ``weights`` of another shape.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    tau = torch.full_like(ratio, tau_neg).masked_fill(advantages > 0, tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    token_loss = apply_token_weights(-gate * advantages, weights)
    return _masked_output(token_loss, torch.zeros_like(action_mask), log_ratio, action_mask)


@POLICY_LOSSES.register("gpg", info=_ANY_AGG)
def gpg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GPG, group policy gradient (Chu et al. 2025, arXiv:2504.02546), per token: L_t = -A_t * logprobs_t.

    The plain policy gradient, no surrogate, ratio or clip: its gradient is the on-policy
    REINFORCE gradient -A_t grad log pi only while the policy is the one that sampled (first
    mini-batch of one epoch); later steps get no importance correction. ``old_logprobs`` is
    used only for the reported ``log_ratio``. GPG's corrected group advantage is an advantage
    estimator's job, not this loss's. The paper normalises by the tokens of the batch
    (token-mean, the default); any aggregation is accepted, as in verl. ``clipped`` is all
    False. Checked against verl ``compute_policy_loss_gpg`` (``core_algos.py``, commit
    b178a3cd), value and gradient.

    Args:
        logprobs, old_logprobs, advantages: (B, T) float; action_mask: (B, T) bool.
        weights: optional (B, T) float (``apply_token_weights``).
    Raises:
        ValueError: ``weights`` of another shape.
    """
    token_loss = apply_token_weights(-advantages * logprobs, weights)
    return _masked_output(token_loss, torch.zeros_like(action_mask), logprobs - old_logprobs, action_mask)
