"""KL estimators between the policy and the reference, per token.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html), with
log_ratio = logprobs - ref_logprobs = log pi(a|s) - log pi_ref(a|s), sampled from pi:

- k1 = log_ratio                         (unbiased, can be negative; for a reward penalty)
- k2 = 0.5 * log_ratio ** 2              (biased, low variance; as a loss its gradient is KL's)
- k3 = exp(-log_ratio) - 1 + log_ratio   (unbiased, always >= 0; "low_var_kl")
- k1+ / k3+: the value of k1 / k3 with the gradient of k2 (straight-through; verl's
  ``kl_penalty`` in ``verl/trainer/ppo/core_algos.py``, names ending in "+").
- abs = |log_ratio|                      (verl's ``abs``; not a KL estimate: E_pi|log_ratio| >= KL(pi||ref);
  as a loss its expected gradient is that of the L1 distance ||pi - ref||_1 = 2 TV(pi, ref))
- abs+: the value of abs with the gradient of k2 (verl's ``abs+``).

verl's aliases are registered too: ``mse`` = k2, ``low_var_kl`` = k3, ``low_var_kl+`` = k3+.

What each gives depends on how it is used (``KL_ESTIMATORS.info(name)``, a ``KLEstimatorInfo``):
as a *loss* term (the estimator applied to the sampled token's differentiable ``logprobs`` and
fixed ``ref_logprobs``, no importance weight, tokens sampled from pi) the expected gradient is
E_pi[grad k]: 0 for k1 (E_pi[grad log pi] = 0), grad KL(pi||ref) for k2, k1+, k3+, and
grad KL(ref||pi) for k3 (grad k3 = (1 - pi_ref/pi) grad log pi). As a *reward* penalty (k
detached, its gradient comes through the score function) the single-token expected gradient is
E_pi[k grad log pi] = grad E_pi[k] - E_pi[grad k]: grad KL(pi||ref) for k1 and k1+, and
grad KL(pi||ref) - grad KL(ref||pi) for k3 and k3+. ``tests/rft_core/algorithms/test_kl_gradients.py``
checks every entry exactly on a 4-way categorical in float64.

All values are clamped to [-kl_clamp, kl_clamp] (default 10 nats) so that one token whose
reference log-prob underflows cannot dominate the loss; k3's log_ratio is also clamped to
[-20, 20] before the exp so it never overflows. For k1+ / k3+ (``kl_penalty``) the clamp acts on
the value only; the gradient is k2's, d/dlog pi of 0.5 * log_ratio**2 = log_ratio, saturating at
+-kl_clamp (``_k2_gradient_carrier``). Clamping the k2 term itself (the code before issue 29)
zeroed the gradient once 0.5 * log_ratio**2 > kl_clamp, i.e. |log_ratio| > sqrt(2 * kl_clamp)
~ 4.47: the penalty let go exactly where the policy had drifted most. verl's ``kl_penalty``
clamps no part of the straight-through k2 term (its gradient is log_ratio, unbounded); ours is
the same up to |log_ratio| = kl_clamp and saturates beyond it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rft_core.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

DEFAULT_KL_CLAMP = 10.0

GRAD_ZERO = "0"
GRAD_KL_PI_REF = "grad KL(pi||ref)"
GRAD_KL_REF_PI = "grad KL(ref||pi)"
GRAD_L1 = "grad ||pi - ref||_1"  # = 2 grad TV(pi, ref): the loss gradient of |log_ratio| (abs)
_SCHULMAN = 'Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html'
_VERL_ST = "verl, verl/trainer/ppo/core_algos.py: kl_penalty (straight-through, names ending in '+')"


@dataclass(frozen=True)
class KLEstimatorInfo:
    """What a KL estimator gives, by use (``KL_ESTIMATORS.info(name)``).

    Attributes:
        value_of: the estimator whose value this entry returns ("k1", "k2", "k3" or "abs").
        straight_through: the gradient is k2's, whatever the value (verl's "+" names).
        value: the per-token formula of the value (log_ratio = logprobs - ref_logprobs).
        value_estimates: what E_pi[value] is.
        loss_gradient: E_pi[grad k] for tokens sampled from pi, differentiable ``logprobs``,
            fixed ``ref_logprobs``, no importance weight: ``GRAD_ZERO``, ``GRAD_KL_PI_REF``,
            ``GRAD_KL_REF_PI`` or ``GRAD_L1`` (abs).
        reward_gradient: the single-token expected score-function gradient
            E_pi[sg(k) grad log pi] when the value is a reward penalty.
        source: paper / upstream file.
    """

    value_of: str
    straight_through: bool
    value: str
    value_estimates: str
    loss_gradient: str
    reward_gradient: str
    source: str


_K1 = KLEstimatorInfo("k1", False, "log_ratio", "KL(pi||ref), unbiased", GRAD_ZERO, GRAD_KL_PI_REF, _SCHULMAN)
_K2 = KLEstimatorInfo("k2", False, "0.5 * log_ratio**2", "KL(pi||ref), biased (exact to 2nd order)",
                      GRAD_KL_PI_REF, "grad E_pi[k2] - grad KL(pi||ref)", _SCHULMAN)
_K3 = KLEstimatorInfo("k3", False, "exp(-log_ratio) - 1 + log_ratio", "KL(pi||ref), unbiased, >= 0",
                      GRAD_KL_REF_PI, "grad KL(pi||ref) - grad KL(ref||pi)", _SCHULMAN)
_K1_PLUS = KLEstimatorInfo("k1", True, _K1.value, _K1.value_estimates, GRAD_KL_PI_REF, _K1.reward_gradient,
                           _SCHULMAN + "; " + _VERL_ST)
_K3_PLUS = KLEstimatorInfo("k3", True, _K3.value, _K3.value_estimates, GRAD_KL_PI_REF, _K3.reward_gradient,
                           _SCHULMAN + "; " + _VERL_ST)
_ABS = KLEstimatorInfo("abs", False, "abs(log_ratio)", "E_pi|log_ratio| >= KL(pi||ref): not a KL estimate",
                      GRAD_L1, "grad E_pi[abs] - grad ||pi - ref||_1",
                      "verl, verl/trainer/ppo/core_algos.py: kl_penalty_forward ('abs')")
_ABS_PLUS = KLEstimatorInfo("abs", True, _ABS.value, _ABS.value_estimates, GRAD_KL_PI_REF, _ABS.reward_gradient,
                           "verl, verl/trainer/ppo/core_algos.py (commit 1dda039b): kl_penalty('abs+'), the value of "
                           "abs with the straight-through gradient of k2")


@KL_ESTIMATORS.register("k1", info=_K1)
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref. Shapes (B, T) -> (B, T)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2", "mse", info=_K2)
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log pi_ref)^2. Shapes (B, T) -> (B, T)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3", "low_var_kl", info=_K3)
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi). Shapes (B, T) -> (B, T)."""
    neg_log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.expm1(neg_log_ratio) - neg_log_ratio


@KL_ESTIMATORS.register("abs", info=_ABS)
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """abs = |log pi - log pi_ref| (verl's ``abs``: ``kl_penalty_forward`` in
    ``verl/trainer/ppo/core_algos.py``, verl commit b178a3cd, ``(logprob - ref_logprob).abs()``).

    Shapes (B, T) -> (B, T), dtype of the inputs; log-probs of the sampled tokens a ~ pi.

    Not an estimate of KL(pi||ref): E_pi[|log_ratio|] >= |E_pi[log_ratio]| = KL(pi||ref). As a
    loss term (differentiable ``logprobs``, fixed ``ref_logprobs``) its gradient is
    sign(log_ratio) grad log pi(a), whose expectation under pi is
    sum_a sign(pi(a) - ref(a)) grad pi(a) = grad ||pi - ref||_1 = 2 grad TV(pi, ref) exactly
    (``GRAD_L1``; checked in float64 on a 4-way categorical in
    ``tests/rft_core/algorithms/test_kl_gradients.py``): it pulls pi towards ref in total
    variation, not in KL. The gradient at log_ratio = 0 is 0 (torch's subgradient of |x|). In
    ``kl_penalty`` the value is clamped to kl_clamp like every non-straight-through entry, so the
    gradient is 0 beyond |log_ratio| = kl_clamp (verl clamps no part of ``abs``).
    """
    return (logprobs - ref_logprobs).abs()


def _straight_through(value: torch.Tensor, grad_source: torch.Tensor) -> torch.Tensor:
    """Value of ``value``, gradient of ``grad_source``."""
    return grad_source - grad_source.detach() + value.detach()


@KL_ESTIMATORS.register("k1+", info=_K1_PLUS)
def kl_k1_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of k1, gradient of k2 (verl ``k1+``). Shapes (B, T) -> (B, T)."""
    return _straight_through(kl_k1(logprobs, ref_logprobs), kl_k2(logprobs, ref_logprobs))


@KL_ESTIMATORS.register("k3+", "low_var_kl+", info=_K3_PLUS)
def kl_k3_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of k3, gradient of k2 (verl ``k3+`` / ``low_var_kl+``). Shapes (B, T) -> (B, T)."""
    return _straight_through(kl_k3(logprobs, ref_logprobs), kl_k2(logprobs, ref_logprobs))


@KL_ESTIMATORS.register("abs+", info=_ABS_PLUS)
def kl_abs_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of abs = |log pi - log pi_ref|, gradient of k2, log_ratio (verl ``abs+``: ``kl_penalty``
    in ``verl/trainer/ppo/core_algos.py``, verl commit 1dda039b, strips the "+" and binds the
    value of ``kl_penalty_forward(..., "abs")`` to the gradient of 0.5 * log_ratio**2). Shapes
    (B, T) -> (B, T).

    As a loss term its expected gradient is grad KL(pi||ref) (k2's), unlike plain ``abs``, whose
    gradient pulls pi towards ref in total variation; the value stays E_pi|log_ratio| >= KL, so the
    logged ``kl`` over-reports the KL. As a reward penalty it acts as ``abs``. In ``kl_penalty`` the
    clamp applies to the value only and the gradient saturates at +-kl_clamp, as for k1+ and k3+
    (verl clamps neither).
    """
    return _straight_through(kl_abs(logprobs, ref_logprobs), kl_k2(logprobs, ref_logprobs))


def _k2_gradient_carrier(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor, kl_clamp: float
) -> torch.Tensor:
    """A term whose value is exactly 0 and whose gradient w.r.t. ``logprobs`` is
    clamp(log_ratio, -kl_clamp, kl_clamp) (0 where ``action_mask`` is False).

    Up to |log_ratio| = kl_clamp that is the gradient of k2 = 0.5 * log_ratio**2, the
    straight-through gradient of verl's ``kl_penalty`` (``verl/trainer/ppo/core_algos.py``,
    ``backward_score = 0.5 * (logprob - ref_logprob).square()``); beyond it the gradient
    saturates at +-kl_clamp (the gradient of a Huber loss with threshold kl_clamp) instead of
    growing without bound on a token whose reference log-prob underflowed. The slope is a detached
    factor, so the carrier stays finite (and its value exactly 0) whatever the reference
    log-prob is, -inf included; ``ref_logprobs`` is treated as fixed data.
    """
    slope = (logprobs.detach() - ref_logprobs.detach()).clamp(-kl_clamp, kl_clamp)
    slope = torch.where(action_mask, slope, torch.zeros_like(slope))
    carrier = logprobs * slope
    return carrier - carrier.detach()


def kl_estimators_with_loss_gradient(gradient: str) -> list[str]:
    """Sorted names whose loss-mode expected gradient is ``gradient`` (``GRAD_*``)."""
    return [n for n in KL_ESTIMATORS if KL_ESTIMATORS.info(n).loss_gradient == gradient]


def check_kl_loss_estimator(name: str) -> KLEstimatorInfo:
    """Refuse a KL estimator that does nothing as a loss term (``kl.mode=loss``).

    Returns:
        the estimator's ``KLEstimatorInfo``.
    Raises:
        UnknownNameError: unknown ``name`` (the message lists the valid names).
        ValueError: its expected loss-mode gradient is zero (k1: E_pi[grad log pi] = 0, so the
            term only adds noise); the message names the estimators that give grad KL(pi||ref)
            and those that give grad KL(ref||pi).
    """
    info = KL_ESTIMATORS.info(name)
    if info.loss_gradient == GRAD_ZERO:
        raise ValueError(
            f"KL estimator {name!r} has zero expected gradient as a loss term (E_pi[grad log pi] = 0): "
            f"kl.mode=loss with it regularises nothing. For grad KL(pi||ref) use one of "
            f"{', '.join(kl_estimators_with_loss_gradient(GRAD_KL_PI_REF))}; for grad KL(ref||pi): "
            f"{', '.join(kl_estimators_with_loss_gradient(GRAD_KL_REF_PI))}. ({name!r} is for kl.mode=reward.)"
        )
    return info


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    estimator: str = "k1",
    kl_clamp: float = DEFAULT_KL_CLAMP,
) -> torch.Tensor:
    """Per-token KL estimate, clamped to [-kl_clamp, kl_clamp], zero where action_mask is False.

    For a straight-through entry (k1+, k3+; verl's ``kl_penalty``, names ending in "+") the clamp
    applies to the value only. The gradient w.r.t. ``logprobs`` is k2's, log_ratio =
    logprobs - ref_logprobs, up to |log_ratio| = kl_clamp and +-kl_clamp beyond it (saturating,
    never 0; ``_k2_gradient_carrier``): at log_ratio 6 it is 6, at 12 it is 10 with the default
    clamp. (Plain ``k2`` is clamped as a whole, value and gradient.)

    Args:
        logprobs: (B, T) float, log pi(a_t|s_t) of the policy.
        ref_logprobs: (B, T) float, log pi_ref(a_t|s_t) of the reference.
        action_mask: (B, T) bool.
        estimator: a name in ``KL_ESTIMATORS`` (see module docstring).
    Returns:
        (B, T) tensor, same dtype as ``logprobs``.
    Raises:
        UnknownNameError: unknown ``estimator`` (the message lists the valid names).
    """
    info = KL_ESTIMATORS.info(estimator)
    if info.straight_through:
        value = KL_ESTIMATORS[info.value_of](logprobs.detach(), ref_logprobs.detach()).clamp(-kl_clamp, kl_clamp)
        kl = value + _k2_gradient_carrier(logprobs, ref_logprobs, action_mask, kl_clamp)
    else:
        kl = KL_ESTIMATORS[estimator](logprobs, ref_logprobs).clamp(-kl_clamp, kl_clamp)
    return torch.where(action_mask, kl, torch.zeros_like(kl))


def cpgd_policy_drift(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl_clamp: float = DEFAULT_KL_CLAMP,
) -> torch.Tensor:
    """CPGD's policy-drift term per token: an estimate of KL(pi_old || pi_theta), the KL to the
    policy that generated the data (Liu et al. 2025, arXiv:2505.12504, the drift regulariser of
    the CPGD objective, weighted by its own coefficient), not to the reference.

    The tokens are sampled from pi_old, so with r_t = pi_theta(a_t) / pi_old(a_t):
        d_t = r_t - 1 - log r_t        (Schulman's k3 form for KL(pi_old || pi_theta))
    E_{pi_old}[d_t] = KL(pi_old || pi_theta) exactly, d_t >= 0, and its gradient
    (r_t - 1) grad log pi_theta(a_t) has expectation grad KL(pi_old || pi_theta) exactly (no
    importance weight needed). It is 0 with zero gradient at pi_theta = pi_old, so it acts from
    the second optimizer step on the same rollout (more than one mini-batch or epoch).
    log r is clamped to [-20, 20] before the exp and d_t to [0, kl_clamp].

    Args:
        logprobs: (B, T) float, log pi_theta of the sampled tokens (differentiable).
        old_logprobs: (B, T) float, log pi_old of the same tokens (the policy that sampled them).
        action_mask: (B, T) bool.
    Returns:
        (B, T) drift terms, 0 where action_mask is False; aggregate them like the KL term.
    Raises:
        ValueError: shapes differ.
    """
    if not logprobs.shape == old_logprobs.shape == action_mask.shape:
        raise ValueError(
            f"cpgd_policy_drift: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"action_mask {tuple(action_mask.shape)} must have one shape"
        )
    drift = kl_k3(old_logprobs.detach(), logprobs).clamp(0.0, kl_clamp)
    return torch.where(action_mask, drift, torch.zeros_like(drift))


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
