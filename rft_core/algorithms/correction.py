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
- ``seq-tis``: sequence-level truncated IS, w_t = min(rho_i, cap) on every token of response i,
  rho_i = exp(sum_t log_ratio_t) (the product of its token ratios; max(., low) with ``low``): the
  unbiased sequence weight, truncated. verl ``compute_rollout_correction_weights(rollout_is=
  "sequence")`` (verl/trainer/ppo/rollout_corr_helper.py, verl commit 1dda039b), "Seq-TIS" of
  Liu, Li et al. 2025 ("When Speed Kills Stability", richardli.xyz/rl-collapse, part 2).
- ``geo-tis``: sequence-level truncated IS with the geometric mean of the token ratios,
  w_t = min(exp(mean_t log_ratio_t), cap) on every token of the response (max(., low) with
  ``low``): the length-normalised sequence ratio of GSPO (Zheng et al. 2025, arXiv:2507.18071,
  eq. 7) as the weight, truncated. verl ``compute_rollout_importance_weights(rollout_is_level=
  "geometric", rollout_is_mode="truncate")`` (verl/trainer/ppo/mismatch_helper.py, verl commit
  4bf4bd32, the last commit before verl dropped geometric IS weights for geometric rejection;
  verl's mean divides by n + 1e-8, a relative 1e-8 / n from ours).
- ``none``: no importance weight (w_t = 1); only the ``rejection`` mask acts (verl ``rollout_is:
  null`` with a ``rollout_rs`` option).

Any mode combines with a rejection mask (``rejection``, ``REJECTION_MASKS``; the trust region
masking of Li et al. 2025, "Trust Region Masking for Long-Horizon LLM Reinforcement Learning",
arXiv:2512.23075; verl ``compute_rollout_rejection_mask``, ``rollout_rs``, verl commit 1dda039b):
a token, or a whole response, leaves the loss mask when a divergence statistic of the
old/rollout log-ratios lies outside its bounds. With lr_t = log_ratio_t clamped to [-20, 20]:

- k1 (ratio bounds [``rejection_low``, ``rejection_cap``], low defaulting to 1 / cap as verl's):
  ``token_k1`` keeps a token with low <= exp(lr_t) <= cap; ``seq_sum_k1`` a response with
  low <= exp(sum_t lr_t) <= cap (its product ratio); ``seq_mean_k1`` with low <= exp(mean_t lr_t)
  <= cap (its geometric-mean ratio, "Geo-RS").
- k3 (an upper bound ``rejection_cap`` in nats; k3_t = exp(lr_t) - 1 - lr_t >= 0, whose mean
  under the rollout estimates KL(pi_rollout || pi_old)): ``token_k3`` keeps a token with
  k3_t <= cap; ``seq_sum_k3``, ``seq_mean_k3``, ``seq_max_k3`` a response whose sum, mean or max
  of k3_t is <= cap.

verl states the k1 bounds on its statistic -lr (``token_k1 = -log_ratio``, "lower_upper" bounds
applied to exp(-lr) = pi_rollout / pi_old), i.e. on the inverse of the ratio its own math notes
(docs/algo/rollout_corr_math.md, sec. 3.3) write them on; here they bound rho = pi_old / pi_rollout
like every other bound of this section: verl's "lo_hi" is ``rejection_low = 1 / hi``,
``rejection_cap = 1 / lo`` (the same for symmetric bounds, verl's default 1 / cap).

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
    "seq-tis": CorrectionInfo("sequence", False, True, "Liu, Li et al. 2025 (richardli.xyz/rl-collapse) Seq-TIS; verl "
                              "rollout_corr_helper.compute_rollout_correction_weights(rollout_is='sequence')"),
    "geo-tis": CorrectionInfo("sequence", False, True, "GSPO's geometric-mean ratio (arXiv:2507.18071 eq. 7), truncated; "
                              "verl mismatch_helper.compute_rollout_importance_weights(rollout_is_level='geometric', "
                              "rollout_is_mode='truncate'), commit 4bf4bd32"),
    "none": CorrectionInfo("token", False, False, "no importance weight: the rejection mask alone (verl rollout_is: null)"),
}.items():
    ROLLOUT_CORRECTIONS.register(_name, info=_info)(_name)


@dataclass(frozen=True)
class RejectionInfo:
    """What a rejection mask looks at (``REJECTION_MASKS.info(name)``).

    Attributes:
        level: "token" (a token leaves the loss mask) or "sequence" (the whole response does).
        statistic: "k1" (log-ratios: bounds on a ratio, ``rejection_low`` and ``rejection_cap``) or
            "k3" (exp(lr) - 1 - lr >= 0: an upper bound ``rejection_cap`` in nats only).
        reduce: how the token statistics of a response are combined: "token" (not at all),
            "sum", "mean" or "max".
    """

    level: str
    statistic: str
    reduce: str


REJECTION_MASKS: Registry[str] = Registry("rollout rejection mask")
for _name, _rinfo in {
    "token_k1": RejectionInfo("token", "k1", "token"),
    "seq_sum_k1": RejectionInfo("sequence", "k1", "sum"),
    "seq_mean_k1": RejectionInfo("sequence", "k1", "mean"),
    "token_k3": RejectionInfo("token", "k3", "token"),
    "seq_sum_k3": RejectionInfo("sequence", "k3", "sum"),
    "seq_mean_k3": RejectionInfo("sequence", "k3", "mean"),
    "seq_max_k3": RejectionInfo("sequence", "k3", "max"),
}.items():
    REJECTION_MASKS.register(_name, info=_rinfo)(_name)


def check_rejection(rejection: str | None, cap: float | None, low: float | None) -> tuple[float | None, float | None]:
    """Validate a rejection mask's bounds; returns (cap, low) with a k1 mask's low filled in
    (1 / cap, verl's default).

    Raises:
        UnknownNameError: unknown ``rejection``.
        ValueError: bounds without a mask, a mask without ``cap``, a bound that is not a finite
            number > 0, a k1 ``low`` not below ``cap`` (or a ``cap`` not above 1 with low left out),
            or a k3 mask with ``low`` (k3 >= 0 has an upper bound only).
    """
    if rejection is None:
        if cap is not None or low is not None:
            raise ValueError("rollout_correction: rejection_cap / rejection_low need a rejection mask (rejection)")
        return None, None
    info = REJECTION_MASKS.info(rejection)
    if cap is None or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"rollout_correction: rejection={rejection} needs rejection_cap, a finite number > 0, got {cap}")
    if info.statistic == "k3":
        if low is not None:
            raise ValueError(f"rollout_correction: rejection={rejection} bounds k3 = exp(lr) - 1 - lr >= 0 from above "
                             f"only: rejection_low must be left out, got {low}")
        return cap, None
    low = 1.0 / cap if low is None else low
    if not (math.isfinite(low) and 0 < low < cap):
        raise ValueError(f"rollout_correction: rejection={rejection} keeps ratios in [rejection_low, rejection_cap]: "
                         f"need 0 < rejection_low < rejection_cap, got [{low}, {cap}] (rejection_low left out is "
                         "1 / rejection_cap, so rejection_cap must then be > 1)")
    return cap, low


def rejection_keep(log_ratio: torch.Tensor, action_mask: torch.Tensor, *, rejection: str, cap: float,
                   low: float | None = None) -> torch.Tensor:
    """The response tokens a rejection mask keeps, (B, T) bool (see the module docstring).

    Args:
        log_ratio: (B, T) float, old_logprobs - rollout_logprobs (anything at masked positions).
        action_mask: (B, T) bool.
        rejection: a name in ``REJECTION_MASKS``; cap, low: its bounds (``check_rejection``).
    Raises:
        UnknownNameError, ValueError: as ``check_rejection``.
    """
    cap_, low_ = check_rejection(rejection, cap, low)
    assert cap_ is not None
    info = REJECTION_MASKS.info(rejection)
    zeros = torch.zeros_like(log_ratio)
    lr = torch.where(action_mask, log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND), zeros)
    if info.statistic == "k1":
        stat, lo, hi = lr, math.log(low_), math.log(cap_)
    else:
        stat, lo, hi = torch.where(action_mask, torch.expm1(lr) - lr, zeros), None, cap_
    if info.reduce == "token":
        out = stat > hi
    else:
        if info.reduce == "sum":
            seq = stat.sum(-1)
        elif info.reduce == "mean":
            seq = stat.sum(-1) / action_mask.sum(-1).clamp(min=1).to(stat.dtype)
        else:
            seq = stat.max(-1).values  # k3 >= 0 and 0 at masked positions: the max over the response
        out = (seq > hi)[:, None].expand_as(stat)
        stat = seq[:, None].expand_as(out)
    if lo is not None:
        out = out | (stat < lo)
    return action_mask & ~out


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
    rejection: str | None = None,
    rejection_cap: float | None = None,
    rejection_low: float | None = None,
) -> RolloutCorrection:
    """Importance weights and loss mask correcting for the rollout engine's sampling distribution.

    See the module docstring for each mode's formula and source. ``cap`` is the upper bound
    (truncation for ``tis``, ``seq-tis`` and ``geo-tis``, the masking threshold for the others), ``low``
    the lower one (None: no lower bound). Upstream defaults: Yao et al. / verl cap 2 (one-sided);
    OpenRLHF [0.5, 5.0]; TRL cap 3, no low. ``rejection`` (a name in ``REJECTION_MASKS``, or None)
    with ``rejection_cap`` / ``rejection_low`` adds a rejection mask (``rejection_keep``) on top of
    the mode's: its tokens leave the loss mask and get weight 0.

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
            low outside [0, cap), a non-finite log-prob at a response token (named by row and
            column), bad rejection bounds (``check_rejection``), or mode ``none`` without a
            rejection mask (it would change nothing).
    """
    ROLLOUT_CORRECTIONS[mode]
    _check_inputs(old_logprobs, rollout_logprobs, action_mask, cap, low)
    check_rejection(rejection, rejection_cap, rejection_low)
    if mode == "none" and rejection is None:
        raise ValueError("rollout_correction: mode none applies no importance weight; it needs a rejection mask "
                         f"(rejection: one of {', '.join(REJECTION_MASKS.names())})")
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
    elif mode == "none":
        weights, keep = torch.ones_like(rho), action_mask
    elif mode in ("seq-tis", "geo-tis"):
        seq_log = log_ratio.sum(-1)
        if mode == "geo-tis":
            seq_log = seq_log / n_tok.clamp(min=1).to(log_ratio.dtype)
        seq_rho = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None].expand_as(rho)
        weights = seq_rho.clamp(min=low, max=cap) if low is not None else seq_rho.clamp(max=cap)
        capped = _outside(seq_rho, low, cap) & action_mask
        keep = action_mask
    else:
        if mode == "seq-mask-tis":
            seq_log = log_ratio.sum(-1) / n_tok.clamp(min=1).to(log_ratio.dtype)
            weights = rho
        else:  # sequence_mask
            seq_log = log_ratio.sum(-1)
            weights = torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None].expand_as(rho)
        seq_out = _outside(torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)), low, cap)
        keep = action_mask & ~seq_out[:, None]
    if rejection is not None:
        keep = keep & rejection_keep(log_ratio, action_mask, rejection=rejection, cap=rejection_cap, low=rejection_low)
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
