"""The policy update of one iteration: PPO epochs over the rollout in micro-batches.

Gradient accumulation is exact: each micro-batch's loss is normalised by the token (or
sequence) count of its whole mini-batch, so the accumulated gradient equals the gradient of the
mini-batch loss computed in one piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import torch

from rft_core.algorithms import KL_ESTIMATORS, POLICY_LOSSES, kl_penalty
from rft_core.algorithms.masked import high_entropy_mask
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.models.logprobs import build_packed_batch, build_token_batch, model_device, response_logprobs, with_vision

OPTIMIZER_FILE = "optimizer.pt"
# the policy's optimizer state is the stage "{ppo_update folder}-optimizer" (rft_core.stages.optimizer_state)
OPTIMIZER_FOLDER_SUFFIX = "-optimizer"


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


def _pad_float(rows: list[list[float]], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def minibatches(n: int, *, epochs: int, batch_size: int, seed: int):
    """Yield (epoch, sample indices of one optimizer step): each epoch a fresh permutation
    (torch.Generator seeded with ``seed``, independent of the global RNG), cut into batches."""
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, batch_size):
            yield epoch, order[start:start + batch_size]


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip the gradient norm, then step; a step whose gradient norm is not finite is skipped
    (gradients dropped). Returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def make_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (Loshchilov & Hutter 2019, arXiv:1711.05101)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
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
    max_grad_norm: float = 1.0,
    temperature: float = 1.0,
    seed: int = 0,
    packing: bool = False,
    progress=None,
    strategy=None,
    processor=None,
) -> list[StepMetrics]:
    """Run PPO epochs over ``data``; mutates ``model`` and ``optimizer``.

    Per token: loss_t = policy_loss_t + kl_coef * KL_t(pi || pi_ref) (the KL term only when
    ``kl_coef`` > 0 and ``data.ref_logprobs`` is given), aggregated by ``loss_agg``.

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
        strategy: how losses become steps (``rft_core.training.strategy``); None:
            ``SingleProcess(model, optimizer)``. With ``DeepSpeedStrategy`` (``model`` and
            ``optimizer`` are then ignored) each rank runs its share of every mini-batch's
            micro-batches and the metrics are summed over ranks.
        processor: a vision-language policy's ``VLProcessor``; each micro-batch then gets the
            vision inputs of ``data.images`` (``with_vision``).
    Returns:
        One StepMetrics per optimizer step (the same on every rank).
    Raises:
        ValueError: empty ``data`` or a KL term requested without ref_logprobs.
    """
    n = len(data)
    if n == 0:
        raise ValueError("ppo_update got no samples")
    keep: list[torch.Tensor] | None = None
    if entropy_top_fraction is not None:
        if data.entropies is None:
            raise ValueError("entropy_top_fraction needs data.entropies (the actor stage's action_entropy)")
        T_all = max(len(r) for r in data.responses) or 1
        full_mask = _pad_float([[1.0] * len(r) for r in data.responses], T_all).bool()
        kept = high_entropy_mask(_pad_float(data.entropies, T_all), full_mask, top_fraction=entropy_top_fraction)
        keep = [kept[i, : len(r)] for i, r in enumerate(data.responses)]
    use_kl = kl_coef > 0 and data.ref_logprobs is not None
    loss_fn = POLICY_LOSSES[policy_loss]
    agg_fn = LOSS_AGGREGATIONS[loss_agg]
    KL_ESTIMATORS[kl_estimator]  # fail before any work on an unknown name
    bs = train_batch_size or n
    # a constant for seq-mean-token-sum-norm: the longest response of the whole rollout
    norm_tokens = loss_norm_tokens or max(len(r) for r in data.responses) or 1
    metrics: list[StepMetrics] = []
    if strategy is None:
        from rft_core.training.strategy import SingleProcess

        strategy = SingleProcess(model, optimizer, max_grad_norm=max_grad_norm)
    model = strategy.model
    rank, world = strategy.rank, strategy.world_size
    device = model_device(model)
    total_steps = epochs * -(-n // bs)
    model.train()
    for epoch, mini in minibatches(n, epochs=epochs, batch_size=bs, seed=seed):
        n_tokens = (sum(len(data.responses[i]) for i in mini) if keep is None
                    else sum(int(keep[i].sum()) for i in mini))
        norm = {"num_tokens": n_tokens, "num_sequences": len(mini), "norm_tokens": norm_tokens}
        sums = {"policy_loss": 0.0, "kl_loss": 0.0, "clipped": 0.0, "approx_kl": 0.0}
        strategy.zero_grad()
        chunks = [mini[i:i + micro_batch_size] for i in range(0, len(mini), micro_batch_size)]
        # this rank's micro-batches, weight 1; zero-weight repeats so every rank runs as many passes
        mine = [(c, 1.0) for c in chunks[rank::world]]
        mine += [(chunks[0], 0.0)] * (-(-len(chunks) // world) - len(mine))
        for idx, weight in mine:
            ps, rs = [data.prompts[i] for i in idx], [data.responses[i] for i in idx]
            batch = build_packed_batch(ps, rs) if packing else build_token_batch(ps, rs, pad_token_id=pad_token_id)
            if processor is not None:
                batch = with_vision(batch, processor, [data.images[i] if data.images else [] for i in idx])
            T = batch.num_actions
            mask = batch.action_mask
            if keep is not None:
                mask = mask & _pad_float([keep[i].float().tolist() for i in idx], T).bool()
            mask = mask.to(device)
            old = _pad_float([data.old_logprobs[i] for i in idx], T).to(device)
            adv = _pad_float([data.advantages[i] for i in idx], T).to(device)
            logprobs, entropy = response_logprobs(model, batch, temperature=temperature, with_entropy=entropy_coef > 0)
            out = loss_fn(logprobs, old, adv, mask, **(policy_loss_kwargs or {}))
            pg = agg_fn(out.token_loss, mask, **norm)
            loss = pg
            if entropy_coef > 0:
                loss = loss - entropy_coef * agg_fn(entropy, mask, **norm)
            if use_kl:
                ref = _pad_float([data.ref_logprobs[i] for i in idx], T).to(device)
                kl = kl_penalty(logprobs, ref, mask, estimator=kl_estimator, kl_clamp=kl_clamp)
                kl_term = agg_fn(kl, mask, **norm)
                loss = loss + kl_coef * kl_term
                sums["kl_loss"] += float(kl_term.detach()) * weight
            strategy.backward(loss * weight if weight != 1.0 else loss)
            if weight == 0.0:
                continue
            sums["policy_loss"] += float(pg.detach())
            sums["clipped"] += float(out.clipped.sum())
            sums["approx_kl"] += float((0.5 * out.log_ratio.detach() ** 2)[mask].sum())
        sums = dict(zip(sums, strategy.all_reduce_sum(list(sums.values()))))
        grad_norm = strategy.step()
        m = StepMetrics(
            step=len(metrics), epoch=epoch, policy_loss=sums["policy_loss"], kl_loss=sums["kl_loss"],
            clip_frac=sums["clipped"] / max(n_tokens, 1), approx_kl=sums["approx_kl"] / max(n_tokens, 1),
            grad_norm=grad_norm, lr=strategy.lr, num_tokens=n_tokens,
        )
        metrics.append(m)
        if progress is not None:
            progress(len(metrics), total_steps)
    model.eval()
    return metrics


def save_checkpoint(model, tokenizer, optimizer: torch.optim.Optimizer | None, out_dir: str | Path) -> None:
    """Write an HF ``save_pretrained`` folder plus the optimizer state (none when ``optimizer``
    is None: a DeepSpeed update, whose state is partitioned over the ranks).

    No RNG state is saved: every random draw of a run comes from a generator seeded with
    (config seed, iteration, stage), so a resumed run draws the same numbers without it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)


def load_optimizer_state(optimizer: torch.optim.Optimizer, ckpt_dir: str | Path | None, *, lr: float | None = None) -> bool:
    """Restore the optimizer state saved by ``save_checkpoint`` in ``ckpt_dir``.

    ``lr``: the configured learning rate replaces the saved one (the state keeps its moments).
    Returns False, leaving the optimizer as it is, when ``ckpt_dir`` is None or has no state.
    """
    path = Path(ckpt_dir) / OPTIMIZER_FILE if ckpt_dir else None
    if path is None or not path.exists():
        return False
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return True
