"""Loss aggregations (``LOSS_AGGREGATIONS``): how a (B, T) per-token loss becomes one scalar,
the four modes of verl's ``agg_loss`` (token-mean; seq-mean-token-mean; seq-mean-token-sum;
seq-mean-token-sum-norm, Dr. GRPO's constant normaliser)."""
from __future__ import annotations

from typing import Callable

import torch

from rft_core.algorithms.masked import masked_mean, masked_sum
from rft_core.registry import Registry

LOSS_AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("loss aggregation")


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
