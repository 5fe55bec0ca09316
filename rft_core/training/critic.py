"""The critic update of one iteration: regress values on the returns with the clipped value loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.algorithms.value_loss import VALUE_LOSSES
from rft_core.models.critic import response_values
from rft_core.models.logprobs import build_token_batch
from rft_core.training.update import _pad_float, clip_and_step, minibatches


@dataclass(frozen=True)
class CriticData:
    """Per sample (unpadded lists, same order): token ids, the critic stage's values (old) and
    the advantage stage's returns (targets), one float per response token."""

    prompts: list[list[int]]
    responses: list[list[int]]
    old_values: list[list[float]]
    returns: list[list[float]]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class CriticStepMetrics:
    """One optimizer step of the critic."""

    step: int
    epoch: int
    value_loss: float
    value_clip_frac: float
    grad_norm: float
    lr: float
    num_tokens: int


def critic_update(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: CriticData,
    *,
    pad_token_id: int,
    value_loss: str = "clipped_mse",
    value_clip: float | None = 0.2,
    loss_agg: str = "token-mean",
    epochs: int = 1,
    train_batch_size: int | None = None,
    micro_batch_size: int = 4,
    max_grad_norm: float = 1.0,
    seed: int = 0,
) -> list[CriticStepMetrics]:
    """Train ``critic`` on ``data`` (mutates it and ``optimizer``); the same exact gradient
    accumulation over micro-batches as the policy update.

    Raises:
        ValueError: empty ``data``.
    """
    n = len(data)
    if n == 0:
        raise ValueError("critic_update got no samples")
    loss_fn, agg_fn = VALUE_LOSSES[value_loss], LOSS_AGGREGATIONS[loss_agg]
    norm_tokens = max(len(r) for r in data.responses) or 1
    metrics: list[CriticStepMetrics] = []
    critic.train()
    for epoch, mini in minibatches(n, epochs=epochs, batch_size=train_batch_size or n, seed=seed):
        n_tokens = sum(len(data.responses[i]) for i in mini)
        norm = {"num_tokens": n_tokens, "num_sequences": len(mini), "norm_tokens": norm_tokens}
        total, clipped = 0.0, 0.0
        for mstart in range(0, len(mini), micro_batch_size):
            idx = mini[mstart:mstart + micro_batch_size]
            batch = build_token_batch([data.prompts[i] for i in idx], [data.responses[i] for i in idx], pad_token_id=pad_token_id)
            T, mask = batch.num_actions, batch.action_mask
            old = _pad_float([data.old_values[i] for i in idx], T)
            ret = _pad_float([data.returns[i] for i in idx], T)
            values = response_values(critic, batch)
            loss = agg_fn(loss_fn(values, old, ret, mask, value_clip=value_clip), mask, **norm)
            loss.backward()
            total += float(loss.detach())
            if value_clip is not None:
                clipped += float(((values.detach() - old).abs() > value_clip)[mask].sum())
        grad_norm = clip_and_step(critic, optimizer, max_grad_norm)
        metrics.append(CriticStepMetrics(step=len(metrics), epoch=epoch, value_loss=total,
                                         value_clip_frac=clipped / max(n_tokens, 1), grad_norm=grad_norm,
                                         lr=float(optimizer.param_groups[0]["lr"]), num_tokens=n_tokens))
    critic.eval()
    return metrics
