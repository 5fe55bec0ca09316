"""Reward and advantage shaping steps, applied by the advantages stage in this order:

1. overlong-buffer penalty on the outcome reward (DAPO);
2. running reward normalisation (Welford statistics carried across iterations);
3. reward clipping;
4. the advantage estimator (``advantages.py``; token-level ones with the per-token KL rewards);
5. clip-filter-like weights, then advantage whitening over the whole rollout;
6. the reward-mode KL penalty of outcome estimators (``kl_penalized_outcome_advantages``);
7. advantage clipping;
8. overlong filtering (``overlong_filter_mask``: truncated responses get zero advantages and
   leave the update's loss entirely; DAPO sec. 3.4).

The advantages stage sees the whole rollout of an iteration, so LightRFT's "cross-batch"
advantage normalisation (over all micro-batches of a step) is step 5's whitening.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import torch


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_new_tokens: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment (DAPO, Yu et al. 2025, arXiv:2503.14476, eq. 13).

    expected = max_new_tokens - buffer_len;  p = min(0, -(len - expected) / buffer_len * penalty_factor)
    so p is 0 up to ``expected`` tokens and falls linearly to -penalty_factor at max_new_tokens.

    Args:
        response_lengths: (B,) int or float, tokens in each response.
    Returns:
        (B,) float32 penalties (<= 0), to add to the rewards.
    Raises:
        ValueError: buffer_len not in (0, max_new_tokens].
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    exceed = response_lengths.to(torch.float32) - (max_new_tokens - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


FINISH_REASONS = ("stop", "length", "max_turns", "env_error")  # the last two: multi-turn agent rollouts


def overlong_filter_mask(action_mask: torch.Tensor, finish_reasons: Sequence[str]) -> torch.Tensor:
    """Overlong filtering (DAPO, Yu et al. 2025, arXiv:2503.14476, sec. 3.4): a truncated response
    (``finish_reason == "length"``) is masked out of the loss entirely, so a possibly correct but
    unfinished reasoning is not punished (its reward is noise).

    Args:
        action_mask: (B, T) bool, response tokens.
        finish_reasons: B strings, "stop" (EOS) or "length" (hit max_new_tokens), the rollout
            shard's ``finish_reason`` column.
    Returns:
        (B, T) bool: ``action_mask`` with the rows of truncated responses all False. The
        fraction filtered is ``sum(f == "length") / B``.
    Raises:
        ValueError: ``action_mask`` not 2-D bool, a length other than B, or a finish reason other
            than "stop" / "length" (named with its row).
    """
    if action_mask.dim() != 2 or action_mask.dtype != torch.bool:
        raise ValueError(f"overlong_filter_mask: action_mask must be (B, T) bool, got {tuple(action_mask.shape)} "
                         f"{action_mask.dtype}")
    reasons = list(finish_reasons)
    if len(reasons) != action_mask.shape[0]:
        raise ValueError(f"overlong_filter_mask: {len(reasons)} finish reasons for {action_mask.shape[0]} rows")
    for row, reason in enumerate(reasons):
        if reason not in FINISH_REASONS:
            raise ValueError(f"overlong_filter_mask: finish_reason[{row}] = {reason!r}; valid: stop, length")
    truncated = torch.tensor([r == "length" for r in reasons], dtype=torch.bool, device=action_mask.device)
    return action_mask & ~truncated[:, None]


@dataclass(frozen=True)
class RunningMoments:
    """Count, mean and sum of squared deviations (M2) of every reward seen so far.

    Merged batch by batch with Chan et al.'s parallel update (1979), the batch form of
    Welford's algorithm (1962); ``std`` is the unbiased standard deviation.
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor) -> "RunningMoments":
        """A new RunningMoments that also covers ``values`` ((N,) float)."""
        v = values.detach().to(torch.float64).flatten()
        n = int(v.numel())
        if n == 0:
            return self
        b_mean = float(v.mean())
        b_m2 = float(((v - b_mean) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.mean
        return RunningMoments(
            count=total,
            mean=self.mean + delta * n / total,
            m2=self.m2 + b_m2 + delta * delta * self.count * n / total,
        )

    @property
    def std(self) -> float:
        """Unbiased standard deviation (1.0 until two values were seen)."""
        return (self.m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 1.0


def normalize_rewards(rewards: torch.Tensor, moments: RunningMoments, *, minus_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / (std + eps), or r / (std + eps) without ``minus_mean``, with running statistics."""
    centred = rewards - moments.mean if minus_mean else rewards
    return centred / (moments.std + eps)


def clip_with_fraction(
    values: torch.Tensor, limit: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """Clamp to [-limit, limit]; also return the fraction of (unmasked) entries that were clipped.

    Raises:
        ValueError: limit <= 0.
    """
    if limit <= 0:
        raise ValueError(f"clip limit must be > 0, got {limit}")
    outside = values.abs() > limit
    if mask is not None:
        outside = outside & mask
        n = int(mask.sum())
    else:
        n = values.numel()
    return values.clamp(-limit, limit), float(outside.sum()) / max(n, 1)
