"""Masked reductions over (B, T) tensors; ``mask`` is bool, True = position counts."""
from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is True.

    Masked positions are replaced by 0 with ``torch.where`` (not multiplied), so a NaN or inf at a
    masked position cannot leak into the result.

    Args:
        values: (B, T) float.
        mask: (B, T) bool, same shape as ``values``.
        dim: reduce over this dim, or over everything when None.
    """
    zeroed = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is True.

    An empty selection (all masked) returns 0, not NaN: the count is clamped to at least 1.

    Args:
        values: (B, T) float.
        mask: (B, T) bool.
        dim: reduce over this dim (e.g. -1 for a per-sequence mean), or everything when None.
    Returns:
        scalar, or the reduced tensor when ``dim`` is given.
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked-in positions (Bessel-corrected when ``unbiased``).

    Returns 0 when fewer than 2 (unbiased) or 1 positions are selected.
    """
    mean = masked_mean(values, mask)
    sq = masked_sum((values - mean) ** 2, mask)
    n = mask.sum().to(values.dtype)
    denom = (n - 1) if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``values`` with the mean and unbiased std of the masked-in positions.

    (x - mean) / sqrt(var + eps), or x / sqrt(var + eps) when ``shift_mean`` is False.
    Masked positions are returned as 0.

    Args:
        values: (B, T) float.
        mask: (B, T) bool.
    Returns:
        (B, T) tensor of the same dtype.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    out = (values - mean) if shift_mean else values
    out = out * torch.rsqrt(var + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def high_entropy_mask(entropy: torch.Tensor, action_mask: torch.Tensor, *, top_fraction: float) -> torch.Tensor:
    """Keep only the top ``top_fraction`` of response tokens by entropy ("forking tokens";
    Wang et al. 2025, arXiv:2506.01939, sec. 5: train on the top 20% of tokens of each batch).

    The threshold is the (1 - top_fraction) quantile of the entropies of all unmasked tokens
    (linear interpolation, torch.quantile); tokens at or above it are kept.

    Args:
        entropy: (B, T) float, the policy's entropy at each token.
        action_mask: (B, T) bool.
        top_fraction: in (0, 1].
    Returns:
        (B, T) bool, a subset of action_mask.
    Raises:
        ValueError: top_fraction outside (0, 1].
    """
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    if top_fraction == 1.0 or not action_mask.any():
        return action_mask.clone()
    threshold = torch.quantile(entropy[action_mask].to(torch.float64), 1.0 - top_fraction)
    return action_mask & (entropy.to(torch.float64) >= threshold)
