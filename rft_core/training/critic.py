"""The critic update of one iteration: regress values on the returns with the clipped value loss,
through the shared training loop (``rft_core.training.loop``), like the policy update."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.algorithms.value_loss import VALUE_LOSSES
from rft_core.config import CriticConfig
from rft_core.models.critic import critic_batch, response_values
from rft_core.models.logprobs import model_device
from rft_core.training.loop import MicroBatching, Normaliser, Strategy, check_per_token_lists, pad_float, train_steps
from rft_core.training.update import dropout_disabled


@dataclass(frozen=True)
class CriticData:
    """Per sample (unpadded lists, same order): token ids, the critic stage's values (old) and
    the advantage stage's returns (targets), one float per response token; images / videos: a
    vision-language critic's encoded prompt media (one list per sample; None: none of that kind);
    action_masks: one bool per response token, True on the tokens the policy sampled (the
    rollout's ``action_mask``: a multi-turn response's observation tokens are not states the
    critic is trained on), None: every token.

    Raises:
        ValueError: a per-token list (old_values, returns, action_masks) of another length than
            the samples or their responses, naming the field and the sample.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    old_values: list[list[float]]
    returns: list[list[float]]
    images: list[list[bytes]] | None = None
    videos: list[list[bytes]] | None = None
    action_masks: list[list[bool]] | None = None

    def __post_init__(self) -> None:
        check_per_token_lists("CriticData", self, ("old_values", "returns", "action_masks"))

    def __len__(self) -> int:
        return len(self.prompts)

    def action_count(self, i: int) -> int:
        """Response tokens of sample ``i`` that the policy sampled."""
        return sum(self.action_masks[i]) if self.action_masks is not None else len(self.responses[i])


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


def critic_update(strategy: Strategy, data: CriticData, cfg: CriticConfig, *, pad_token_id: int, progress=None,
                  processor=None) -> list[CriticStepMetrics]:
    """Train the critic held by ``strategy`` (``rft_core.training.strategy.build_strategy``) on
    ``data`` as the ``critic`` config section ``cfg`` says, with the shared training loop (exact
    gradient accumulation, any strategy); mutates the critic. The value loss, its normaliser (the
    mini-batch's token count) and the clip fraction are over the tokens ``data.action_masks``
    marks (all response tokens without). The critic's dropout is off (``dropout_disabled``: e.g.
    the 0.1 classifier dropout transformers puts before a token-classification value head, which
    the critic_values stage, run in eval mode, does not apply to the old values).

    Args:
        cfg: what the update reads of it: ``value_loss`` (name in VALUE_LOSSES) and its
            ``value_clip`` (None: unclipped), ``loss_agg``, ``epochs``, ``train_batch_size``,
            ``micro_batch_size`` or ``max_tokens_per_micro_batch`` (``MicroBatching``), ``seed`` (the
            micro-batch shuffle) and ``packing`` (each
            micro-batch one packed row without padding); its optimizer fields are the
            strategy's.
        pad_token_id: the tokenizer's padding token (padded micro-batches).
        progress: optional callable(done, total) after each micro-batch (``train_steps``).
        processor: a vision-language critic's ``VLProcessor``: each micro-batch gets the vision
            inputs of ``data.images`` / ``data.videos`` (``rft_core.models.critic.critic_batch``).
    Raises:
        ValueError: empty ``data``, or a sample longer than ``critic.max_tokens_per_micro_batch``
            (before any step).
    """
    if len(data) == 0:
        raise ValueError("critic_update got no samples")
    loss_fn, agg_fn, value_clip = VALUE_LOSSES[cfg.value_loss], LOSS_AGGREGATIONS[cfg.loss_agg], cfg.value_clip
    norm_tokens = max(len(r) for r in data.responses) or 1
    device = model_device(strategy.model)

    def normaliser(mini: list[int]) -> Normaliser:
        return Normaliser(num_tokens=sum(data.action_count(i) for i in mini), num_sequences=len(mini),
                          norm_tokens=norm_tokens)

    def micro_step(idx: list[int], norm: Normaliser) -> tuple[torch.Tensor, dict[str, float]]:
        batch = critic_batch([data.prompts[i] for i in idx], [data.responses[i] for i in idx],
                             pad_token_id=pad_token_id, packing=cfg.packing, processor=processor,
                             images=[data.images[i] for i in idx] if data.images is not None else None,
                             videos=[data.videos[i] for i in idx] if data.videos is not None else None)
        T, mask = batch.num_actions, batch.action_mask
        if data.action_masks is not None:
            mask = mask & pad_float([[float(x) for x in data.action_masks[i]] for i in idx], T).bool()
        mask = mask.to(device)
        old = pad_float([data.old_values[i] for i in idx], T).to(device)
        ret = pad_float([data.returns[i] for i in idx], T).to(device)
        values = response_values(strategy.model, batch)
        loss = agg_fn(loss_fn(values, old, ret, mask, value_clip=value_clip), mask, **norm.as_kwargs())
        clipped = float(((values.detach() - old).abs() > value_clip)[mask].sum()) if value_clip is not None else 0.0
        return loss, {"value_loss": float(loss.detach()), "clipped": clipped}

    with dropout_disabled(strategy.model):
        steps = train_steps(strategy, len(data), micro_step=micro_step, stats=("value_loss", "clipped"),
                            normaliser=normaliser, epochs=cfg.epochs, train_batch_size=cfg.train_batch_size,
                            micro_batching=MicroBatching.of("critic", cfg, data.prompts, data.responses),
                            seed=cfg.seed, progress=progress)
    return [CriticStepMetrics(step=r.step, epoch=r.epoch, value_loss=r.sums["value_loss"],
                              value_clip_frac=r.sums["clipped"] / max(r.norm.num_tokens, 1), grad_norm=r.grad_norm,
                              lr=r.lr, num_tokens=r.norm.num_tokens) for r in steps]
