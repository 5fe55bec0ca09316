"""Rollout/trainer mismatch correction: importance weights against the rollout engine's log-probs.

The rollout engine (vLLM, or HF generate with top-p/top-k) samples from pi_rollout, which is
not exactly the trainer's pi_old (another kernel, another precision, a truncated sampling
distribution). The PPO update assumes the tokens came from pi_old; truncated importance
sampling re-weights each token's loss by pi_old / pi_rollout (Yao et al. 2025, "Your Efficient
RL Framework Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl):

    L = E_{a ~ pi_rollout}[ min(pi_old(a) / pi_rollout(a), C) * L_ppo(a) ]

With log_ratio_t = old_logprobs_t - rollout_logprobs_t (clamped to [-20, 20] before the exp,
as verl's ``SAFETY_BOUND``) and rho_t = exp(log_ratio_t), the modes are (``ROLLOUT_CORRECTIONS``):

- ``tis``: token-level truncated IS, w_t = min(rho_t, cap) (and max(., low) when ``low`` is given).
  Yao et al.; verl ``compute_rollout_correction_weights(rollout_is="token")``
  (verl/trainer/ppo/rollout_corr_helper.py); OpenRLHF ``vllm_is_correction_type="tis"``
  (openrlhf/models/loss.py, which clamps to [low, high]); TRL ``token_truncate``.
- ``icepop``: token-level masking, w_t = rho_t if low <= rho_t <= cap, else the token is masked
  (OpenRLHF ``icepop``; TRL ``token_mask``).
- ``seq-mask-tis``: OpenRLHF's ``seq-mask-tis``: a response is masked entirely when its geometric
  mean ratio exp(mean_t log_ratio_t) lies outside [low, cap]; kept responses get the token ratios
  w_t = rho_t, untruncated as OpenRLHF's code does (its comment says "token-level clamp"; the
  code applies none).
- ``sequence_mask``: TRL's ``sequence_mask`` (trl/trainer/grpo_trainer.py): the sequence ratio
  rho_i = exp(sum_t log_ratio_t) (a product of token ratios); a response whose rho_i lies outside
  [low, cap] is masked, the others get w_t = rho_i on every token.

The weights are detached (they change the measure, not the objective) and multiply only the
policy term (``weights=`` of the policy losses), never the KL term, as TRL and OpenRLHF do.
Masked tokens leave the loss mask; the normaliser should still count them (pass the
mini-batch's response-token count as ``num_tokens``), as OpenRLHF and TRL do, where a masked
token's loss is multiplied by 0.

The correction only means something when ``old_logprobs`` come from the trainer
(``logprobs.recompute_old_logprobs=true``): with the rollout's own log-probs every weight is 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rft_core.registry import Registry

SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class CorrectionInfo:
    """What a correction mode does (``ROLLOUT_CORRECTIONS.info(mode)``).

    Attributes:
        level: "token" or "sequence" (what one decision to mask covers).
        masks: it removes tokens or whole responses from the loss mask.
        truncates: it clips weights at ``cap`` (and ``low``) instead of masking.
        source: upstream implementation / paper.
    """

    level: str
    masks: bool
    truncates: bool
    source: str


@dataclass(frozen=True)
class RolloutCorrection:
    """Result of ``rollout_correction``.

    Attributes:
        weights: (B, T) float, detached, 0 where ``loss_mask`` is False; pass as the policy
            loss's ``weights``.
        loss_mask: (B, T) bool, ``action_mask`` minus masked tokens / responses; the mask of the
            policy term (the KL term keeps ``action_mask``).
        metrics: ``rollout_is_weight_mean`` (mean weight over ``loss_mask``),
            ``rollout_is_capped_frac`` (fraction of response tokens whose weight was truncated),
            ``rollout_is_token_masked_frac`` (fraction of response tokens masked),
            ``rollout_is_seq_masked_frac`` (fraction of non-empty responses masked entirely),
            ``rollout_kl`` (mean of rollout_logprobs - old_logprobs over response tokens: the k1
            estimate of KL(pi_rollout || pi_old), tokens being sampled from pi_rollout).
    """

    weights: torch.Tensor
    loss_mask: torch.Tensor
    metrics: dict[str, float]


ROLLOUT_CORRECTIONS: Registry[str] = Registry("rollout correction mode")
for _name, _info in {
    "tis": CorrectionInfo("token", False, True, "Yao et al. 2025 (fengyao.notion.site/off-policy-rl); verl "
                          "rollout_corr_helper.compute_rollout_correction_weights; OpenRLHF tis; TRL token_truncate"),
    "icepop": CorrectionInfo("token", True, False, "OpenRLHF openrlhf/models/loss.py icepop; TRL token_mask"),
    "seq-mask-tis": CorrectionInfo("sequence", True, False, "OpenRLHF openrlhf/models/loss.py seq-mask-tis"),
    "sequence_mask": CorrectionInfo("sequence", True, False, "TRL trl/trainer/grpo_trainer.py sequence_mask"),
}.items():
    ROLLOUT_CORRECTIONS.register(_name, info=_info)(_name)


def _check_inputs(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor,
                  cap: float, low: float | None) -> None:
    if not old_logprobs.shape == rollout_logprobs.shape == action_mask.shape or old_logprobs.dim() != 2:
        raise ValueError(
            f"rollout_correction: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)} and action_mask {tuple(action_mask.shape)} must all be one (B, T) shape"
        )
    if action_mask.dtype != torch.bool:
        raise ValueError(f"rollout_correction: action_mask must be bool, got {action_mask.dtype}")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"rollout_correction: cap must be a finite number > 0, got {cap}")
    if low is not None and not 0 <= low < cap:
        raise ValueError(f"rollout_correction: low must be in [0, cap={cap}), got {low}")
    for name, t in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        bad = action_mask & ~torch.isfinite(t)
        if bad.any():
            row, col = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(f"rollout_correction: {name}[{row}, {col}] = {t[row, col].item()} is not finite "
                             f"at a response token")


def _outside(x: torch.Tensor, low: float | None, cap: float) -> torch.Tensor:
    out = x > cap
    return out | (x < low) if low is not None else out


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    mode: str = "tis",
    cap: float = 2.0,
    low: float | None = None,
) -> RolloutCorrection:
    """Importance weights and loss mask correcting for the rollout engine's sampling distribution.

    See the module docstring for each mode's formula and source. ``cap`` is the upper bound
    (truncation for ``tis``, the masking threshold for the others), ``low`` the lower one
    (None: no lower bound). Upstream defaults: Yao et al. / verl cap 2 (one-sided); OpenRLHF
    [0.5, 5.0]; TRL cap 3, no low.

    Args:
        old_logprobs: (B, T) float, the trainer's log pi_old of the sampled tokens.
        rollout_logprobs: (B, T) float, the engine's log-probs of the same tokens.
        action_mask: (B, T) bool, response tokens.
        mode: a name in ``ROLLOUT_CORRECTIONS``.
    Returns:
        ``RolloutCorrection`` (weights, loss_mask, metrics), float tensors in old_logprobs' dtype.
    Raises:
        UnknownNameError: unknown ``mode``.
        ValueError: shapes differ or are not 2-D, a non-bool mask, cap <= 0 or not finite,
            low outside [0, cap), or a non-finite log-prob at a response token (named by row and column).
    """
    ROLLOUT_CORRECTIONS[mode]
    _check_inputs(old_logprobs, rollout_logprobs, action_mask, cap, low)
    zeros = torch.zeros_like(old_logprobs)
    log_ratio = torch.where(action_mask, (old_logprobs - rollout_logprobs).detach(), zeros)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    n_tok = action_mask.sum(-1)
    capped = torch.zeros_like(action_mask)
    if mode == "tis":
        weights = rho.clamp(min=low, max=cap) if low is not None else rho.clamp(max=cap)
        capped = _outside(rho, low, cap) & action_mask
        keep = action_mask
    elif mode == "icepop":
        weights, keep = rho, action_mask & ~_outside(rho, low, cap)
    else:
        if mode == "seq-mask-tis":
            seq_log = log_ratio.sum(-1) / n_tok.clamp(min=1).to(log_ratio.dtype)
            weights = rho
        else:  # sequence_mask
            seq_log = log_ratio.sum(-1)
            weights = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None].expand_as(rho)
        seq_out = _outside(torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)), low, cap)
        keep = action_mask & ~seq_out[:, None]
    weights = torch.where(keep, weights, zeros).detach()
    return RolloutCorrection(weights=weights, loss_mask=keep,
                             metrics=_metrics(weights, keep, capped, action_mask, log_ratio))


def _metrics(weights: torch.Tensor, keep: torch.Tensor, capped: torch.Tensor, action_mask: torch.Tensor,
             log_ratio: torch.Tensor) -> dict[str, float]:
    n = max(int(action_mask.sum()), 1)
    nonempty = action_mask.any(-1)
    seq_masked = nonempty & ~keep.any(-1)
    return {
        "rollout_is_weight_mean": float(weights[keep].mean()) if keep.any() else 0.0,
        "rollout_is_weight_max": float(weights[keep].max()) if keep.any() else 0.0,
        "rollout_is_capped_frac": float(capped.sum()) / n,
        "rollout_is_token_masked_frac": float((action_mask & ~keep).sum()) / n,
        "rollout_is_seq_masked_frac": float(seq_masked.sum()) / max(int(nonempty.sum()), 1),
        "rollout_kl": float(-log_ratio[action_mask].sum()) / n,
    }
