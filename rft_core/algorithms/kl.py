"""KL estimators between the policy and the reference, per token.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html), with
log_ratio = logprobs - ref_logprobs = log pi(a|s) - log pi_ref(a|s), sampled from pi:

- k1 = log_ratio                         (unbiased, can be negative; for a reward penalty)
- k2 = 0.5 * log_ratio ** 2              (biased, low variance; gradient equals KL's)
- k3 = exp(-log_ratio) - 1 + log_ratio   (unbiased, always >= 0; "low_var_kl")

All values are clamped to [-kl_clamp, kl_clamp] (default 10 nats) so that one token whose
reference log-prob underflows cannot dominate the loss; k3's log_ratio is also clamped to
[-20, 20] before the exp so it never overflows.
"""
from __future__ import annotations

from typing import Callable

import torch

from rft_core.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

DEFAULT_KL_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref. Shapes (B, T) -> (B, T)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log pi_ref)^2. Shapes (B, T) -> (B, T)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi). Shapes (B, T) -> (B, T)."""
    neg_log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.expm1(neg_log_ratio) - neg_log_ratio


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    estimator: str = "k1",
    kl_clamp: float = DEFAULT_KL_CLAMP,
) -> torch.Tensor:
    """Per-token KL estimate, clamped to [-kl_clamp, kl_clamp], zero where action_mask is False.

    Args:
        logprobs: (B, T) float, log pi(a_t|s_t) of the policy.
        ref_logprobs: (B, T) float, log pi_ref(a_t|s_t) of the reference.
        action_mask: (B, T) bool.
        estimator: "k1", "k2" or "k3" (see module docstring).
    Returns:
        (B, T) tensor, same dtype as ``logprobs``.
    Raises:
        UnknownNameError: unknown ``estimator`` (the message lists the valid names).
    """
    kl = KL_ESTIMATORS[estimator](logprobs, ref_logprobs).clamp(-kl_clamp, kl_clamp)
    return torch.where(action_mask, kl, torch.zeros_like(kl))


def next_kl_coef(
    kl_coef: float,
    current_kl: float,
    *,
    controller: str = "fixed",
    target: float | None = None,
    horizon: int = 10_000,
    n_steps: int = 1,
) -> float:
    """The KL coefficient for the next iteration.

    ``fixed``: unchanged. ``adaptive`` (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2):
    e = clip(current_kl / target - 1, -0.2, 0.2);  kl_coef <- kl_coef * (1 + e * n_steps / horizon).

    Args:
        current_kl: the iteration's mean per-sequence KL (nats).
        n_steps: samples in the iteration (the rollout batch size).
    Raises:
        ValueError: unknown controller, or adaptive without a positive target / horizon.
    """
    if controller == "fixed":
        return kl_coef
    if controller != "adaptive":
        raise ValueError(f"unknown KL controller {controller!r}; valid: adaptive, fixed")
    if target is None or target <= 0 or horizon <= 0:
        raise ValueError(f"the adaptive KL controller needs target > 0 and horizon > 0, got {target}, {horizon}")
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)
