"""The policy update of one iteration: the PPO loss of a micro-batch, run over the rollout's
mini-batches by the shared training loop (``rft_core.training.loop``), which makes gradient
accumulation exact and runs under any strategy (one process, DeepSpeed ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rft_core.algorithms import KL_ESTIMATORS, POLICY_LOSSES, kl_penalty
from rft_core.algorithms.masked import high_entropy_mask
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.models.logprobs import build_packed_batch, build_token_batch, model_device, response_logprobs, with_vision
from rft_core.training.loop import Normaliser, Strategy, pad_float, train_steps


@dataclass(frozen=True)
class UpdateData:
    """Everything the update needs, per sample (unpadded lists, same order).

    prompts / responses: token ids; old_logprobs, advantages: one float per response token;
    ref_logprobs: same, or None when no KL loss term is used.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[list[float]]
    ref_logprobs: list[list[float]] | None = None
    entropies: list[list[float]] | None = None  # the actor stage's action_entropy (for filtering)
    images: list[list[bytes]] | None = None  # vision-language policies: each sample's encoded prompt images

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step's diagnostics (means over the step's unmasked tokens)."""

    step: int
    epoch: int
    policy_loss: float
    kl_loss: float
    clip_frac: float
    approx_kl: float
    grad_norm: float
    lr: float
    num_tokens: int


def _entropy_keep(data: UpdateData, top_fraction: float) -> list[torch.Tensor]:
    """Per sample, the (len(response),) bool mask of the tokens ``high_entropy_mask`` keeps,
    with the threshold over the whole of ``data``."""
    if data.entropies is None:
        raise ValueError("entropy_top_fraction needs data.entropies (the actor stage's action_entropy)")
    T_all = max(len(r) for r in data.responses) or 1
    full_mask = pad_float([[1.0] * len(r) for r in data.responses], T_all).bool()
    kept = high_entropy_mask(pad_float(data.entropies, T_all), full_mask, top_fraction=top_fraction)
    return [kept[i, : len(r)] for i, r in enumerate(data.responses)]


def ppo_update(
    strategy: Strategy,
    data: UpdateData,
    *,
    pad_token_id: int,
    policy_loss: str = "ppo_clip",
    policy_loss_kwargs: dict | None = None,
    loss_agg: str = "token-mean",
    loss_norm_tokens: int | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: float = 10.0,
    entropy_coef: float = 0.0,
    entropy_top_fraction: float | None = None,
    epochs: int = 1,
    train_batch_size: int | None = None,
    micro_batch_size: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    packing: bool = False,
    progress=None,
    processor=None,
) -> list[StepMetrics]:
    """Run PPO epochs over ``data`` with ``strategy`` (which holds the model and its optimizer:
    ``rft_core.training.strategy.build_strategy``); mutates the model.

    Per token: loss_t = policy_loss_t + kl_coef * KL_t (the KL term only when ``kl_coef`` > 0
    and ``data.ref_logprobs`` is given; its gradient depends on ``kl_estimator``, see
    docs/algorithms.md), aggregated by ``loss_agg``.

    Args:
        policy_loss, policy_loss_kwargs: name in POLICY_LOSSES and its keyword arguments.
        entropy_coef: weight of the entropy bonus, loss -= entropy_coef * agg(entropy_t).
        entropy_top_fraction: train only on this top fraction of tokens by ``data.entropies``
            (``high_entropy_mask``, over the whole of ``data``); None trains on every token.
        loss_agg: name in LOSS_AGGREGATIONS; ``loss_norm_tokens`` is the constant of
            seq-mean-token-sum-norm (default: the longest response in ``data``).
        train_batch_size: samples per optimizer step (None: all of ``data``).
        micro_batch_size: samples per forward/backward pass.
        seed: seeds the per-epoch shuffle (torch.Generator), independent of global RNG.
        packing: each micro-batch is one packed row without padding (``build_packed_batch``);
            the same loss up to float rounding.
        progress: optional callable(done, total) after each optimizer step (steps).
        processor: a vision-language policy's ``VLProcessor``; each micro-batch then gets the
            vision inputs of ``data.images`` (``with_vision``).
    Returns:
        One StepMetrics per optimizer step (the same on every rank).
    Raises:
        ValueError: empty ``data`` or entropy filtering without ``data.entropies``.
    """
    if len(data) == 0:
        raise ValueError("ppo_update got no samples")
    keep = _entropy_keep(data, entropy_top_fraction) if entropy_top_fraction is not None else None
    use_kl = kl_coef > 0 and data.ref_logprobs is not None
    loss_fn = POLICY_LOSSES[policy_loss]
    agg_fn = LOSS_AGGREGATIONS[loss_agg]
    KL_ESTIMATORS[kl_estimator]  # fail before any work on an unknown name
    # a constant for seq-mean-token-sum-norm: the longest response of the whole rollout
    norm_tokens = loss_norm_tokens or max(len(r) for r in data.responses) or 1
    device = model_device(strategy.model)

    def normaliser(mini: list[int]) -> Normaliser:
        n_tokens = (sum(len(data.responses[i]) for i in mini) if keep is None else sum(int(keep[i].sum()) for i in mini))
        return Normaliser(num_tokens=n_tokens, num_sequences=len(mini), norm_tokens=norm_tokens)

    def micro_step(idx: list[int], norm: Normaliser) -> tuple[torch.Tensor, dict[str, float]]:
        ps, rs = [data.prompts[i] for i in idx], [data.responses[i] for i in idx]
        batch = build_packed_batch(ps, rs) if packing else build_token_batch(ps, rs, pad_token_id=pad_token_id)
        if processor is not None:
            batch = with_vision(batch, processor, [data.images[i] if data.images else [] for i in idx])
        T = batch.num_actions
        mask = batch.action_mask
        if keep is not None:
            mask = mask & pad_float([keep[i].float().tolist() for i in idx], T).bool()
        mask = mask.to(device)
        old = pad_float([data.old_logprobs[i] for i in idx], T).to(device)
        adv = pad_float([data.advantages[i] for i in idx], T).to(device)
        logprobs, entropy = response_logprobs(strategy.model, batch, temperature=temperature, with_entropy=entropy_coef > 0)
        out = loss_fn(logprobs, old, adv, mask, **(policy_loss_kwargs or {}))
        agg = norm.as_kwargs()
        pg = agg_fn(out.token_loss, mask, **agg)
        loss = pg
        if entropy_coef > 0:
            loss = loss - entropy_coef * agg_fn(entropy, mask, **agg)
        stats = {"policy_loss": float(pg.detach()), "clipped": float(out.clipped.sum()),
                 "approx_kl": float((0.5 * out.log_ratio.detach() ** 2)[mask].sum())}
        if use_kl:
            ref = pad_float([data.ref_logprobs[i] for i in idx], T).to(device)
            kl_term = agg_fn(kl_penalty(logprobs, ref, mask, estimator=kl_estimator, kl_clamp=kl_clamp), mask, **agg)
            loss = loss + kl_coef * kl_term
            stats["kl_loss"] = float(kl_term.detach())
        return loss, stats

    steps = train_steps(strategy, len(data), micro_step=micro_step, stats=("policy_loss", "kl_loss", "clipped", "approx_kl"),
                        normaliser=normaliser, epochs=epochs, train_batch_size=train_batch_size,
                        micro_batch_size=micro_batch_size, seed=seed, progress=progress)
    return [StepMetrics(step=r.step, epoch=r.epoch, policy_loss=r.sums["policy_loss"], kl_loss=r.sums["kl_loss"],
                        clip_frac=r.sums["clipped"] / max(r.norm.num_tokens, 1),
                        approx_kl=r.sums["approx_kl"] / max(r.norm.num_tokens, 1), grad_norm=r.grad_norm, lr=r.lr,
                        num_tokens=r.norm.num_tokens) for r in steps]
