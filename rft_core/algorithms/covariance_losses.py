"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv:2505.22617, sec. 4; verl ``clip_cov`` / ``kl_cov``): policy
losses that pick the tokens whose log-prob and advantage covary most and restrain them (no
gradient, or a KL term). Registered in ``POLICY_LOSSES`` when ``rft_core.algorithms`` is imported.
They select within each micro-batch (``PolicyLossInfo.batch_dependent``)."""
from __future__ import annotations

import hashlib

import torch

from rft_core.algorithms.masked import masked_mean
from rft_core.algorithms.policy_loss import (
    MAX_LOG_RATIO,
    POLICY_LOSSES,
    PolicyLossInfo,
    PolicyLossOutput,
    _masked_output,
    apply_token_weights,
    ppo_clip_loss,
)

_COV_INFO = PolicyLossInfo(batch_dependent=True)


def _token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A) * (logprobs_t - mean logprobs) over the unmasked tokens of the call
    (Cui et al. 2025, arXiv:2505.22617: the centred cross term whose sum drives the entropy
    change); detached, (B, T)."""
    lp = logprobs.detach()
    return (advantages - masked_mean(advantages, action_mask)) * (lp - masked_mean(lp, action_mask))


def _seeded_choice(candidates: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` of the flat indices ``candidates`` (1-D long) uniformly at random without
    replacement (all of them when there are no more than ``k``). The generator is seeded by the
    candidate indices themselves, so the same batch picks the same tokens on every run
    (verl draws from the global RNG)."""
    if len(candidates) <= k:
        return candidates
    cpu = candidates.cpu()
    seed = int.from_bytes(hashlib.blake2b(cpu.numpy().tobytes(), digest_size=8).digest(), "little") >> 1
    order = torch.randperm(len(cpu), generator=torch.Generator().manual_seed(seed))
    return candidates[order[:k].to(candidates.device)]


@POLICY_LOSSES.register("clip_cov", info=_COV_INFO)
def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 1.0,
    clip_high: float = 1.0,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> PolicyLossOutput:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617, sec. 4).

    Per token, Cov_t = (A_t - mean A)(logprobs_t - mean logprobs) over the unmasked tokens of
    the call (``_token_covariance``). Among the tokens with clip_cov_lb < Cov_t < clip_cov_ub
    that PPO's clip leaves unclipped, max(1, floor(clip_cov_ratio * N)) (N: unmasked tokens of
    the call) are chosen uniformly at random, and their gradient is detached: their loss is
    0 (the loss is multiplied by 0 there, as verl's ``corr``). The other tokens get the PPO
    clip loss with ``clip_low``/``clip_high`` (log-ratio clamped to [-20, 20]; verl leaves it
    unclamped). High-covariance tokens are the ones whose update lowers the entropy most;
    dropping a few of them keeps the entropy from collapsing. Defaults: the authors' runs
    (``recipe/dapo/7b_clip_cov.sh`` of PRIME-RL/Entropy-Mechanism-of-RL: clip_cov_ratio 2e-4,
    bounds 1 and 5, clip ratios 1 and 1, i.e. no lower PPO clip); verl's ``clip_cov_*`` defaults
    are the same, its PPO clip is the actor's (0.2). The random pick is seeded by the
    candidates' positions (``_seeded_choice``), so it is reproducible. The selection is over the
    tokens of the call, i.e. per micro-batch, as in verl (``POLICY_LOSSES.info("clip_cov")
    .batch_dependent``). Checked against verl ``compute_policy_loss_clip_cov`` (``core_algos.py``,
    commit b178a3cd), value and gradient, on inputs where every candidate is chosen (verl's pick
    draws from the global RNG).

    Args:
        logprobs, old_logprobs, advantages: (B, T) float; action_mask: (B, T) bool.
        weights: optional (B, T) float (``apply_token_weights``); the selection ignores them.
        clip_low, clip_high: PPO clip range (0 <= clip_low <= 1, clip_high >= 0).
        clip_cov_ratio: fraction of the call's tokens to detach (0 < r <= 1).
        clip_cov_lb, clip_cov_ub: the covariance band of the candidates (lb < ub).
    Returns:
        PolicyLossOutput; ``clipped`` is True where PPO's clip was active or the token was detached.
    Raises:
        ValueError: a parameter out of range, or ``weights`` of another shape.
    """
    if not 0 < clip_cov_ratio <= 1:
        raise ValueError(f"clip_cov: clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov: clip_cov_lb ({clip_cov_lb}) must be below clip_cov_ub ({clip_cov_ub})")
    if not 0 <= clip_low <= 1 or clip_high < 0:
        raise ValueError(f"clip_cov: need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    base = ppo_clip_loss(logprobs, old_logprobs, advantages, action_mask, clip_low=clip_low, clip_high=clip_high)
    cov = _token_covariance(logprobs, advantages, action_mask)
    candidates = action_mask & ~base.clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n_pick = max(int(clip_cov_ratio * int(action_mask.sum())), 1)
    picked = torch.zeros(action_mask.numel(), dtype=torch.bool, device=action_mask.device)
    picked[_seeded_choice(torch.nonzero(candidates.reshape(-1)).squeeze(-1), n_pick)] = True
    picked = picked.view(action_mask.shape)
    token_loss = apply_token_weights(base.token_loss.masked_fill(picked, 0.0), weights)
    return _masked_output(token_loss, base.clipped | picked, base.log_ratio, action_mask)


@POLICY_LOSSES.register("kl_cov", info=_COV_INFO)
def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    kl_cov_ratio: float = 2e-3,
    ppo_kl_coef: float = 1.0,
) -> PolicyLossOutput:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617, sec. 4).

    r_t = exp(logprobs_t - old_logprobs_t) (log-ratio clamped to [-20, 20]; verl leaves it
    unclamped); Cov_t as in ``clip_cov_loss``. The k = max(1, floor(kl_cov_ratio * N)) tokens
    of the call with the largest Cov_t get a KL penalty to the old policy:
    L_t = -r_t A_t + ppo_kl_coef * |logprobs_t - old_logprobs_t| on them, L_t = -r_t A_t
    elsewhere (no clip). Defaults: the authors' 7B run (``recipe/dapo/7b_kl_cov.sh`` of
    PRIME-RL/Entropy-Mechanism-of-RL: k_percent 0.2, i.e. 0.2% of the tokens, ppo_kl_coef 1);
    their 32B run uses 0.02% (2e-4); verl's defaults are kl_cov_ratio 2e-4 and ppo_kl_coef 0.1. The top-k is over the tokens of the call, i.e. per micro-batch, as in
    verl (``POLICY_LOSSES.info("kl_cov").batch_dependent``). Checked against verl
    ``compute_policy_loss_kl_cov`` (``core_algos.py``, commit b178a3cd), value and gradient.

    Args:
        logprobs, old_logprobs, advantages: (B, T) float; action_mask: (B, T) bool.
        weights: optional (B, T) float (``apply_token_weights``); the selection ignores them.
        kl_cov_ratio: fraction of the call's tokens to penalise (0 < k <= 1).
        ppo_kl_coef: coefficient of |log r_t| on them (>= 0).
    Returns:
        PolicyLossOutput; ``clipped`` is True on the penalised tokens.
    Raises:
        ValueError: a parameter out of range, or ``weights`` of another shape.
    """
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"kl_cov: kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    if ppo_kl_coef < 0:
        raise ValueError(f"kl_cov: ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    surrogate = -advantages * torch.exp(log_ratio)
    picked = torch.zeros(action_mask.numel(), dtype=torch.bool, device=action_mask.device)
    n_valid = int(action_mask.sum())
    if n_valid > 0:
        valid = torch.nonzero(action_mask.reshape(-1)).squeeze(-1)
        cov = _token_covariance(logprobs, advantages, action_mask).reshape(-1)[valid]
        picked[valid[torch.topk(cov, max(1, int(n_valid * kl_cov_ratio))).indices]] = True
    picked = picked.view(action_mask.shape)
    token_loss = torch.where(picked, surrogate + ppo_kl_coef * log_ratio.abs(), surrogate)
    return _masked_output(apply_token_weights(token_loss, weights), picked, log_ratio, action_mask)
