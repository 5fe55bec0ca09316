"""DPPO, divergence proximal policy optimization (Qi et al. 2026, "Rethinking the Trust Region in
LLM Reinforcement Learning", arXiv:2602.04879; verl ``dppo_tv`` / ``dppo_kl``): PPO's ratio clip
replaced by a trust region on an estimate of the policy divergence at the sampled token.
Registered in ``POLICY_LOSSES`` when ``rft_core.algorithms`` is imported.

The paper's objective (its eq. 11, with the binary approximations of eq. 13-14):

    L = -E_{a ~ mu}[ M_t * r_t * A_t ],   r_t = pi_theta(a_t) / mu(a_t),

mu the policy that sampled the tokens (the rollout), M_t in {0, 1} a detached mask that drops a
token whose update has left the trust region in the direction its advantage pushes:

- ``dppo_tv`` (binary total variation, eq. 13): D_t = |pi(a_t) - mu(a_t)|; dropped when
  A_t > 0 and pi - mu > delta_high, or A_t <= 0 and pi - mu < -delta_low;
- ``dppo_kl`` (binary KL, eq. 14): D_t = mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi)),
  the KL between the Bernoulli distributions "a_t or not a_t" (the two logs guarded by 1e-8 as
  verl's code); dropped when D_t > delta_high and pi > mu (A_t > 0), or D_t > delta_low and
  pi < mu (A_t <= 0).

A token that moved against its advantage is never dropped (it is pulled back), as in PPO. The
gradient of a kept token is -r_t A_t grad log pi: REINFORCE with the importance ratio, no clip.
verl's implementation (``compute_policy_loss_dppo_tv`` / ``_kl``, ``verl/trainer/ppo/core_algos.py``,
verl commit 1dda039b) writes the loss as -A * sg(min(r, C)) * M * log pi: the same gradient,
another value; it truncates the ratio at C = ``actor.clip_ratio_c``, which is 3.0 in verl's
default actor config (the dual-clip constant; the function's own fallback, 20, applies only when
the field is absent, and verl's DPPO example sets 10000). The paper's eq. 11 has no truncation
(its sec. 5.4 discusses truncated IS and recommends a large threshold if one is used): here
``ratio_cap`` None (the default) is eq. 11; a number C gives verl's truncated gradient
-min(r, C) A grad log pi, with the value -r A kept.

The trust region is measured against the sampling policy mu, and the loss receives it as
``old_logprobs``. That is the paper's: the authors' ``dppo_binary_tv`` / ``dppo_binary_kl``
(github.com/sail-sg/Stable-RL, ``_compute_token_mask_for_policy_loss``) compare pi with the
rollout's log-probs; comparing with a recomputed pi_old is their ``*_recompute`` ablation (and
MiniRL's trust region for PPO, which the paper reports collapsing). verl passes its
``old_log_prob``: the rollout's in verl's bypass mode, the trainer's recomputed pi_old otherwise
(its example run). The training config therefore refuses DPPO with the actor pass
(``dppo-anchor-is-the-rollout``, rft_core/config/rules.py), so ``old_logprobs`` are the engine's.
"""
from __future__ import annotations

import torch

from rft_core.algorithms.policy_loss import (
    MAX_LOG_RATIO,
    POLICY_LOSSES,
    PolicyLossInfo,
    PolicyLossOutput,
    _masked_output,
    apply_token_weights,
)

BINARY_KL_EPS = 1e-8  # verl's guard inside the second log of the binary KL
_DPPO_INFO = PolicyLossInfo()  # any aggregation (verl's example run: seq-mean-token-sum-norm)


def binary_kl(old_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(mu) || Bernoulli(pi)) of the sampled token (arXiv:2602.04879, eq. 14):
    mu (log mu - log pi) + (1 - mu) log((1 - mu + 1e-8) / (1 - pi + 1e-8)), mu = exp(old_logprobs),
    pi = exp(logprobs); 1 - p is computed as -expm1(log p). Shapes (B, T) -> (B, T), detached
    inputs expected (the mask it feeds is a constant)."""
    mu = old_logprobs.exp()
    one_minus_mu = -torch.expm1(old_logprobs)
    one_minus_pi = -torch.expm1(logprobs)
    return mu * (old_logprobs - logprobs) + one_minus_mu * torch.log(
        (one_minus_mu + BINARY_KL_EPS) / (one_minus_pi + BINARY_KL_EPS))


def dppo_trust_region_mask(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                           divergence: str, clip_low: float, clip_high: float) -> torch.Tensor:
    """The tokens DPPO keeps, (B, T) bool, detached (arXiv:2602.04879, eq. 11-14; see the module
    docstring). ``divergence``: "tv" or "kl"; ``clip_low`` / ``clip_high``: delta for A <= 0 / A > 0.

    Raises:
        ValueError: unknown ``divergence`` or a negative threshold.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"dppo: clip_low and clip_high (the divergence thresholds) must be >= 0, got "
                         f"clip_low={clip_low}, clip_high={clip_high}")
    lp, old = logprobs.detach(), old_logprobs.detach()
    diff = lp.exp() - old.exp()
    if divergence == "tv":
        out_pos, out_neg = diff > clip_high, diff < -clip_low
    elif divergence == "kl":
        d = binary_kl(old, lp)
        out_pos, out_neg = (d > clip_high) & (diff > 0), (d > clip_low) & (diff < 0)
    else:
        raise ValueError(f"dppo: unknown divergence {divergence!r}; valid: tv, kl")
    return ~torch.where(advantages > 0, out_pos, out_neg)


def _dppo_loss(logprobs, old_logprobs, advantages, action_mask, weights, *, divergence: str, clip_low: float,
               clip_high: float, ratio_cap: float | None) -> PolicyLossOutput:
    if ratio_cap is not None and ratio_cap <= 0:
        raise ValueError(f"dppo: ratio_cap must be > 0 or None, got {ratio_cap}")
    keep = dppo_trust_region_mask(logprobs, old_logprobs, advantages, divergence=divergence, clip_low=clip_low,
                                  clip_high=clip_high)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.detach().exp()
    grad_weight = ratio if ratio_cap is None else ratio.clamp(max=ratio_cap)
    # value r_t (eq. 11), gradient grad_weight * grad log pi (= grad r_t without a cap)
    surrogate = ratio + grad_weight * (logprobs - logprobs.detach())
    token_loss = apply_token_weights(-surrogate * advantages * keep.to(logprobs.dtype), weights)
    return _masked_output(token_loss, ~keep, log_ratio, action_mask)


@POLICY_LOSSES.register("dppo_tv", info=_DPPO_INFO)
def dppo_tv_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.15,
    clip_high: float = 0.15,
    ratio_cap: float | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV (Qi et al. 2026, arXiv:2602.04879, eq. 11 and 13), per token:
    L_t = -M_t r_t A_t with r_t = pi(a_t) / mu(a_t) and M_t = 0 where pi(a_t) - mu(a_t) > clip_high
    (A_t > 0) or < -clip_low (A_t <= 0). See the module docstring for mu (= ``old_logprobs``),
    ``ratio_cap`` and where verl departs.

    Args:
        logprobs: (B, T) float, log pi_theta of the sampled tokens (requires grad).
        old_logprobs: (B, T) float, log mu of the same tokens (the rollout's).
        advantages: (B, T) float; action_mask: (B, T) bool.
        weights: optional (B, T) float multiplying each token's loss (``apply_token_weights``).
        clip_low, clip_high: the TV thresholds delta for A <= 0 and A > 0, probabilities in [0, 1]
            (0.15 both: the authors' run in verl's example, ``examples/dppo_trainer``).
        ratio_cap: None (eq. 11) or C > 0: the gradient's ratio truncated at C (verl's clip_ratio_c).
    Returns:
        PolicyLossOutput: ``clipped`` marks the tokens the trust region dropped; ``log_ratio`` is
        log pi - log mu (clamped to [-20, 20]).
    Raises:
        ValueError: a negative threshold, ``ratio_cap`` <= 0, or ``weights`` of another shape.
    """
    return _dppo_loss(logprobs, old_logprobs, advantages, action_mask, weights, divergence="tv", clip_low=clip_low,
                      clip_high=clip_high, ratio_cap=ratio_cap)


@POLICY_LOSSES.register("dppo_kl", info=_DPPO_INFO)
def dppo_kl_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.05,
    clip_high: float = 0.05,
    ratio_cap: float | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879, eq. 11 and 14), per token:
    L_t = -M_t r_t A_t with M_t = 0 where the binary KL(mu || pi) of the token (``binary_kl``)
    exceeds clip_high and pi > mu (A_t > 0), or exceeds clip_low and pi < mu (A_t <= 0).
    Arguments, returns and errors as ``dppo_tv_loss``; the thresholds are in nats (0.05 both: the
    authors' run in verl's example)."""
    return _dppo_loss(logprobs, old_logprobs, advantages, action_mask, weights, divergence="kl", clip_low=clip_low,
                      clip_high=clip_high, ratio_cap=ratio_cap)
