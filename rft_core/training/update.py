"""The policy update of one iteration: the PPO loss of a micro-batch, run over the rollout's
mini-batches by the shared training loop (``rft_core.training.loop``), which makes gradient
accumulation exact and runs under any strategy (one process, DeepSpeed ranks).

Per token t of response i (docs/algorithms.md, "Loss terms of the update"), with M the response
tokens of the rows in the loss (all rows but the overlong-filtered ones) that the policy sampled
(``UpdateData.action_masks``: a multi-turn response's observation tokens, written by the
environment, are not actions; they carry no loss, no KL, no entropy term, no gradient and do not
count in any normaliser or statistic):

    loss = agg_M(w_t * L_policy_t) + kl_coef * agg_M(k_t) + cpgd_drift_coef * agg_M(d_t)
           - entropy_coef * agg_M(e_t * H_t)

w_t = e_t * c_t: e_t is the high-entropy filter's 0/1 mask (1 without a filter), c_t the rollout
correction weight (1 without one; 0 on the tokens it masks). ``agg_M`` is ``update.loss_agg``
with the mini-batch's counts of M (tokens, sequences) as normalisers, so a filtered or masked
token still counts in the normaliser, as in TRL and OpenRLHF. With
``entropy_filter_norm="kept"`` M is the kept tokens instead (every term on them only).

The entropy term takes e_t and never c_t, with or without a filter: H_t is the policy's entropy
at the state before token t, a sum over the whole vocabulary computed from the logits, not a
function of the sampled token, so the correction (an importance weight of the sampled token:
pi_old / pi_rollout, AReaL's behaviour weight) neither weights nor masks it, as it leaves the
KL term alone (AReaL's ``grpo_loss_fn``, areal/engine/ppo/actor.py, has no entropy term in its
loss: it only logs the detached entropy).

Randomness: the update's own draws (LoRA dropout, ``update.dropout``; gradient checkpointing
saves and restores them) come from torch's global generator, seeded at the start of every update
(``update_rng``) and restored after it; the HF rollout engine never touches that generator
(``rft_core.engines.hf``), so a rollout running beside the update in another thread (the
asynchronous prefetch) and the update cannot change each other's draws. The seeds are those of
``update_seeds``: ``update.seed`` mixed with the policy version the update starts from (each
iteration its own micro-batch order and dropout masks) and, for the draws, the DeepSpeed or FSDP2
rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from rft_core.algorithms import POLICY_LOSSES, cpgd_policy_drift, kl_penalty, rollout_correction
from rft_core.algorithms.masked import high_entropy_mask
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.config import KLConfig, UpdateConfig, UpdateGrouping, policy_loss_kwargs
from rft_core.models.logprobs import build_packed_batch, build_token_batch, model_device, response_logprobs, with_vision
from rft_core.training.loop import (MicroBatching, Normaliser, StepResult, Strategy, check_per_token_lists,
                                    epoch_micro_batches, pad_float, train_steps)

SUM_NORM = "seq-mean-token-sum-norm"


@dataclass(frozen=True)
class UpdateData:
    """Everything the update needs, per sample (unpadded lists, same order).

    prompts / responses: token ids; old_logprobs, advantages: one float per response token;
    ref_logprobs: same, or None when no KL loss term is used; entropies: the actor stage's
    action_entropy (for filtering); images / videos: a vision-language policy's encoded prompt
    images and videos (one list per sample; None: no sample has that kind); rollout_logprobs:
    the rollout engine's log-probs (the rollout correction's denominator); excluded: per
    sample, True when it is out of the loss entirely (overlong filtering); action_masks: per
    sample one bool per response token, True on the tokens the policy sampled (the rollout's
    ``action_mask``; False on a multi-turn response's observation tokens), None: every token.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[list[float]]
    ref_logprobs: list[list[float]] | None = None
    entropies: list[list[float]] | None = None
    images: list[list[bytes]] | None = None
    rollout_logprobs: list[list[float]] | None = None
    excluded: list[bool] | None = None
    videos: list[list[bytes]] | None = None
    action_masks: list[list[bool]] | None = None

    def __post_init__(self) -> None:
        """Check that every per-token list has one entry per response token.

        Raises:
            ValueError: naming the field and the first sample whose list has another length.
        """
        check_per_token_lists("UpdateData", self, ("old_logprobs", "advantages", "ref_logprobs", "entropies", "rollout_logprobs", "action_masks"))

    def __len__(self) -> int:
        return len(self.prompts)

    def action_count(self, i: int) -> int:
        """Response tokens of sample ``i`` that the policy sampled."""
        return sum(self.action_masks[i]) if self.action_masks is not None else len(self.responses[i])

    def action_mask(self, idx: list[int], T: int) -> torch.Tensor:
        """(len(idx), T) bool: True on the sampled response tokens of samples ``idx`` (padding False)."""
        if self.action_masks is None:
            return pad_float([[1.0] * len(self.responses[i]) for i in idx], T).bool()
        return pad_float([[float(x) for x in self.action_masks[i]] for i in idx], T).bool()

    def included(self, i: int) -> bool:
        """Whether sample ``i`` is in the loss (not overlong-filtered)."""
        return self.excluded is None or not self.excluded[i]


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step's diagnostics. ``num_tokens``: response tokens in the policy term
    (after the entropy filter, rollout-correction masking and overlong filtering); clip_frac and
    approx_kl are means over them; policy_loss, kl_loss and cpgd_drift are the aggregated terms."""

    step: int
    epoch: int
    policy_loss: float
    kl_loss: float
    clip_frac: float
    approx_kl: float
    grad_norm: float
    lr: float
    num_tokens: int
    cpgd_drift: float = 0.0


@dataclass(frozen=True)
class SampleCorrection:
    """The rollout correction of every sample (``rollout_correction_weights``).

    weights: per sample a (len(response),) float32 tensor, the detached weight of each token's
        policy loss (0 on masked tokens); keep: per sample a (len(response),) bool tensor, the
        tokens the correction leaves in the policy term; metrics: ``RolloutCorrection.metrics``
        over the samples in the loss.
    """

    weights: list[torch.Tensor]
    keep: list[torch.Tensor]
    metrics: dict[str, float]


def _row_mask(data: UpdateData) -> torch.Tensor:
    """(B, T_all) bool: the sampled response tokens (``data.action_masks``) of the samples in the loss."""
    T_all = max((len(r) for r in data.responses), default=0) or 1
    mask = data.action_mask(list(range(len(data))), T_all)
    if data.excluded is not None:
        mask &= torch.tensor([not e for e in data.excluded], dtype=torch.bool)[:, None]
    return mask


def rollout_correction_weights(data: UpdateData, *, mode: str = "tis", cap: float = 2.0,
                               low: float | None = None, **rejection: float | str | None) -> SampleCorrection:
    """Truncated importance weights pi_old / pi_rollout of every response token
    (``rft_core.algorithms.correction.rollout_correction``; Yao et al. 2025): ``data.old_logprobs``
    are the trainer's log pi_old, ``data.rollout_logprobs`` the engine's. Computed once, before
    the update (both are fixed data); overlong-filtered samples get weight 0.

    Raises:
        ValueError: ``data.rollout_logprobs`` is None, a sample whose log-prob lists differ in
            length from its response, or what ``rollout_correction`` raises (named row/column).
    """
    if data.rollout_logprobs is None:
        raise ValueError("the rollout correction needs data.rollout_logprobs (the rollout shard's rollout_logprobs)")
    for i, (r, o, q) in enumerate(zip(data.responses, data.old_logprobs, data.rollout_logprobs)):
        if not len(r) == len(o) == len(q):
            raise ValueError(f"sample {i}: {len(r)} response tokens, {len(o)} old_logprobs, {len(q)} rollout_logprobs")
    mask = _row_mask(data)
    T = mask.shape[1]
    res = rollout_correction(pad_float(data.old_logprobs, T), pad_float(data.rollout_logprobs, T), mask,
                             mode=mode, cap=cap, low=low, **rejection)  # rejection, rejection_cap, rejection_low
    n = [len(r) for r in data.responses]
    return SampleCorrection(weights=[res.weights[i, :k] for i, k in enumerate(n)],
                            keep=[res.loss_mask[i, :k] for i, k in enumerate(n)], metrics=res.metrics)


def _entropy_keep(data: UpdateData, top_fraction: float) -> list[torch.Tensor]:
    """Per sample, the (len(response),) bool mask of the tokens ``high_entropy_mask`` keeps,
    with the threshold over the response tokens of all samples in the loss."""
    if data.entropies is None:
        raise ValueError("entropy_top_fraction needs data.entropies (the actor stage's action_entropy)")
    mask = _row_mask(data)
    kept = high_entropy_mask(pad_float(data.entropies, mask.shape[1]), mask, top_fraction=top_fraction)
    return [kept[i, : len(r)] for i, r in enumerate(data.responses)]


_LORA_DROPOUT = "lora_dropout"


@contextlib.contextmanager
def dropout_disabled(model: torch.nn.Module) -> Iterator[int]:
    """Dropout off inside the block, whatever ``model.train()`` says: every ``nn.Dropout*``
    module gets p = 0 and every float attribute of a module named ``*dropout*`` or ``*pdrop``
    (the functional attention dropout of HF models, e.g. Llama/Qwen2 ``attention_dropout``) is
    set to 0.0; the values are restored on exit. peft's ``lora_dropout`` modules keep theirs
    (``update.lora.dropout`` is the user's explicit choice). Gradient checkpointing, which HF
    models run only in train mode, is unaffected (``model.eval()`` would turn it off).

    With dropout the policy the loss differentiates is not the policy that produced
    old_logprobs, so the PPO ratio and the KL are off at the first step; TRL's PPO and RLOO
    trainers disable dropout in every model (``disable_dropout_in_model``, trl/trainer/utils.py).

    Yields:
        the number of dropout settings switched off.
    """
    saved: list[tuple[torch.nn.Module, str, float]] = []
    for name, module in model.named_modules():
        if _LORA_DROPOUT in name:
            continue
        for attr, value in list(vars(module).items()):
            is_rate = isinstance(value, float) and ("dropout" in attr or attr.endswith("pdrop"))
            is_p = attr == "p" and isinstance(module, torch.nn.modules.dropout._DropoutNd)
            if (is_rate or is_p) and value > 0:
                saved.append((module, attr, value))
                setattr(module, attr, 0.0)
    try:
        yield len(saved)
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


@contextlib.contextmanager
def update_rng(seed: int, device: torch.device) -> Iterator[None]:
    """torch's global generator seeded with ``seed`` inside the block (the CPU generator, and the
    default generator of ``device`` when it is a CUDA device), its state before the block restored
    on exit (``torch.random.fork_rng``).

    What draws from it in an update: peft's ``lora_dropout`` and, with ``update.dropout``, the
    model's dropout (``nn.Dropout`` takes no generator argument); gradient checkpointing saves its
    state in the forward and restores it for the recomputation, so the recomputed masks equal the
    forward's. Seeded per update, the masks depend on the update's seeds (``update_seeds``) and
    inputs only, not on what ran before in the process (a resumed run, another iteration order, a
    resident worker's earlier updates, the rollout engine: which draws from its own
    ``torch.Generator``).
    """
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        yield


# the update's seeds (``update_seeds``): the update that starts from policy version v (that of
# iteration v + 1) shuffles with update.seed + v * VERSION_STRIDE, and rank r of a DeepSpeed or FSDP2
# gang draws its dropout masks with that seed + r * RANK_STRIDE (the rollout's SEED_STRIDE and
# ATTEMPT_STRIDE, rft_core.stages.rollout; every rank must deal the same shuffle)
VERSION_STRIDE = 100_003
RANK_STRIDE = 7_919


def update_seeds(seed: int, policy_version: int, rank: int = 0) -> tuple[int, int]:
    """(shuffle seed, draw seed) of the update that starts from ``policy_version`` with
    ``update.seed`` = ``seed``, on DeepSpeed or FSDP2 rank ``rank`` (0 in one process): the
    shuffle seed ``seed + VERSION_STRIDE * policy_version`` orders the micro-batches (the same on
    every rank, which deal its micro-batches round-robin), the draw seed, that plus ``RANK_STRIDE * rank``,
    seeds the update's global-RNG draws (``update_rng``: LoRA / model dropout). The update of the
    first iteration (version 0) on rank 0 uses ``seed`` itself for both.

    Raises:
        ValueError: a negative ``policy_version`` or ``rank``.
    """
    if policy_version < 0 or rank < 0:
        raise ValueError(f"update_seeds: policy_version {policy_version} and rank {rank} must be >= 0")
    order = seed + VERSION_STRIDE * policy_version
    return order, order + RANK_STRIDE * rank


def first_epoch_rows(grouping: UpdateGrouping, prompts: list[list[int]], responses: list[list[int]]) -> list[list[int]]:
    """The micro-batches (sample indices) of the first epoch of the update of ``grouping``, the
    rows ``ppo_update`` trains on first: its shuffle (``update_seeds`` of ``grouping.seed`` and
    ``grouping.policy_version``) cut as ``ppo_update`` cuts it (``MicroBatching.of``); the log-prob passes take them
    below float32 (``TrainConfig.logprob_grouping_at``).

    Raises:
        ValueError: a sample longer than ``grouping.max_tokens_per_micro_batch``.
    """
    return epoch_micro_batches(len(prompts), train_batch_size=grouping.train_batch_size,
                               micro_batching=MicroBatching.of("update", grouping, prompts, responses),
                               seed=update_seeds(grouping.seed, grouping.policy_version)[0])


@dataclass(frozen=True)
class UpdateSettings:
    """What one policy update (``ppo_update``) runs with: the ``update`` and ``kl`` config
    sections as they are (no field copied: a new loss setting is a field of its section, read
    where the loss uses it), the rollout's temperature and the policy version it starts from.

    Attributes:
        update: the ``update`` section: the policy loss and its aggregation, the entropy and CPGD
            terms, ``dropout``, ``epochs``, ``train_batch_size``, ``micro_batch_size`` or
            ``max_tokens_per_micro_batch`` (``MicroBatching``),
            ``packing`` and ``seed`` (docs/config.md); its optimizer fields are the strategy's
            (``rft_core.training.strategy.OptimizerSettings``), not the loss's.
        kl: the ``kl`` section: a loss term when ``kl.in_loss`` (and ``data.ref_logprobs`` is
            given; its gradient by estimator: docs/algorithms.md), on every response token of
            the rows in the loss, without correction weights; ``kl.kl_clamp`` also bounds CPGD's
            drift term.
        temperature: the rollout's sampling temperature (the log-probs are of logits / temperature).
        policy_version: the version of the policy the update starts from (0: the initial policy;
            ``PPOUpdateInput.policy_version``): with ``update.seed`` it seeds the micro-batch
            shuffle and the update's random draws (``update_seeds``).
    Raises:
        ValueError: ``update.loss_agg`` seq-mean-token-sum-norm without ``update.loss_norm_tokens``
            (a training config fills it with ``rollout.max_new_tokens``), or a negative
            ``policy_version``.
    """

    update: UpdateConfig = field(default_factory=UpdateConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    temperature: float = 1.0
    policy_version: int = 0

    def __post_init__(self) -> None:
        if self.update.loss_agg == SUM_NORM and self.update.loss_norm_tokens is None:
            raise ValueError(f"update.loss_agg={SUM_NORM!r} needs update.loss_norm_tokens, its constant token budget "
                             "(Dr. GRPO: the generation budget, rollout.max_new_tokens)")
        if self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")


STEP_STATS = ("policy_loss", "kl_loss", "cpgd_drift", "clipped", "approx_kl", "policy_tokens")


class _TokenMasks(NamedTuple):
    """The (B, T) masks and weights of a micro-batch's loss terms, on the model's device.

    mask: the tokens in the loss (sampled, in a row in the loss; under the "kept" filter norm
    the filter's tokens only); policy_mask: those the policy term trains on (filter and
    correction applied); weights: w_t of the policy term (float32, None: 1); entropy_weights:
    e_t of the entropy bonus (float32, None: 1)."""

    mask: torch.Tensor
    policy_mask: torch.Tensor
    weights: torch.Tensor | None
    entropy_weights: torch.Tensor | None


class _PPOLoss:
    """The module docstring's loss of one micro-batch and the normaliser of a mini-batch, as
    ``train_steps`` calls them (``micro_step``, ``normaliser``).

    Raises:
        UnknownNameError: unknown policy loss or aggregation (on construction).
    """

    def __init__(self, model: torch.nn.Module, data: UpdateData, settings: UpdateSettings, *, pad_token_id: int,
                 keep: list[torch.Tensor] | None, correction: SampleCorrection | None, processor=None) -> None:
        cfg = settings.update
        self.model, self.data, self.cfg, self.kl, self.pad_token_id = model, data, cfg, settings.kl, pad_token_id
        self.temperature = settings.temperature
        self.keep, self.correction, self.processor = keep, correction, processor
        self.kept_norm = keep is not None and cfg.entropy_filter_norm == "kept"
        self.use_kl = settings.kl.in_loss and data.ref_logprobs is not None
        self.loss_fn, self.agg_fn = POLICY_LOSSES[cfg.policy_loss.name], LOSS_AGGREGATIONS[cfg.loss_agg]
        self.loss_kwargs = policy_loss_kwargs(cfg.policy_loss)
        self.norm_tokens = cfg.loss_norm_tokens or 1
        self.device = model_device(model)

    def normaliser(self, mini: list[int]) -> Normaliser:
        """The token and sequence counts of M over the mini-batch ``mini`` (module docstring)."""
        data, keep = self.data, self.keep
        rows = [i for i in mini if data.included(i)]
        n_tokens = sum(int(keep[i].sum()) if self.kept_norm and keep is not None else data.action_count(i) for i in rows)
        return Normaliser(num_tokens=n_tokens, num_sequences=len(rows), norm_tokens=self.norm_tokens)

    def _batch(self, idx: list[int]):
        """The model inputs of samples ``idx``: padded or packed, with their vision inputs."""
        data = self.data
        ps, rs = [data.prompts[i] for i in idx], [data.responses[i] for i in idx]
        batch = (build_packed_batch(ps, rs) if self.cfg.packing
                 else build_token_batch(ps, rs, pad_token_id=self.pad_token_id))
        if self.processor is not None:
            batch = with_vision(batch, self.processor, [data.images[i] for i in idx] if data.images is not None else None,
                                [data.videos[i] for i in idx] if data.videos is not None else None)
        return batch

    def _masks(self, idx: list[int], batch_mask: torch.Tensor, T: int) -> _TokenMasks:
        """The masks and weights of samples ``idx`` (``batch_mask``: the batch's (B, T) response tokens)."""
        data, keep, correction = self.data, self.keep, self.correction

        def padded(values: list[torch.Tensor]) -> torch.Tensor:
            return pad_float([values[i].float().tolist() for i in idx], T)

        mask = (batch_mask & data.action_mask(idx, T)
                & torch.tensor([data.included(i) for i in idx], dtype=torch.bool)[:, None])
        policy_mask, weights, entropy_weights = mask, None, None
        if keep is not None:
            kept = padded(keep).bool()
            policy_mask = mask & kept
            if self.kept_norm:
                mask = policy_mask
            else:
                weights = entropy_weights = kept.float()
        if correction is not None:
            policy_mask = policy_mask & padded(correction.keep).bool()
            cw = padded(correction.weights)
            weights = cw if weights is None else weights * cw
        device = self.device
        return _TokenMasks(mask.to(device), policy_mask.to(device), weights.to(device) if weights is not None else None,
                           entropy_weights.to(device) if entropy_weights is not None else None)

    def micro_step(self, idx: list[int], norm: Normaliser) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of samples ``idx`` under the mini-batch's ``norm`` and its statistics (``STEP_STATS``)."""
        data, cfg, kl, device, agg_fn = self.data, self.cfg, self.kl, self.device, self.agg_fn
        batch = self._batch(idx)
        T = batch.num_actions
        mask, policy_mask, weights, entropy_weights = self._masks(idx, batch.action_mask, T)
        old = pad_float([data.old_logprobs[i] for i in idx], T).to(device)
        adv = pad_float([data.advantages[i] for i in idx], T).to(device)
        logprobs, entropy = response_logprobs(self.model, batch, temperature=self.temperature,
                                              with_entropy=cfg.entropy_coef > 0)
        out = self.loss_fn(logprobs, old, adv, mask, weights, **self.loss_kwargs)
        agg = norm.as_kwargs()
        pg = agg_fn(out.token_loss, mask, **agg)
        loss = pg
        if cfg.entropy_coef > 0:  # e_t * H_t: the filter's tokens, never the correction's weights or mask (module doc)
            bonus = entropy if entropy_weights is None else entropy * entropy_weights.to(entropy.dtype)
            loss = loss - cfg.entropy_coef * agg_fn(bonus, mask, **agg)
        stats = {"policy_loss": float(pg.detach()), "clipped": float((out.clipped & policy_mask).sum()),
                 "approx_kl": float((0.5 * out.log_ratio.detach() ** 2)[policy_mask].sum()),
                 "policy_tokens": float(policy_mask.sum())}
        if self.use_kl:
            ref = pad_float([data.ref_logprobs[i] for i in idx], T).to(device)
            kl_term = agg_fn(kl_penalty(logprobs, ref, mask, estimator=kl.estimator, kl_clamp=kl.kl_clamp), mask, **agg)
            loss = loss + kl.kl_coef * kl_term
            stats["kl_loss"] = float(kl_term.detach())
        if cfg.cpgd_drift_coef > 0:
            drift = agg_fn(cpgd_policy_drift(logprobs, old, mask, kl_clamp=kl.kl_clamp), mask, **agg)
            loss = loss + cfg.cpgd_drift_coef * drift
            stats["cpgd_drift"] = float(drift.detach())
        return loss, stats


def _step_metrics(r: StepResult) -> StepMetrics:
    """The diagnostics of one optimizer step from its summed statistics (``STEP_STATS``)."""
    return StepMetrics(step=r.step, epoch=r.epoch, policy_loss=r.sums["policy_loss"], kl_loss=r.sums["kl_loss"],
                       clip_frac=r.sums["clipped"] / max(r.sums["policy_tokens"], 1.0),
                       approx_kl=r.sums["approx_kl"] / max(r.sums["policy_tokens"], 1.0), grad_norm=r.grad_norm,
                       lr=r.lr, num_tokens=round(r.sums["policy_tokens"]), cpgd_drift=r.sums["cpgd_drift"])


def ppo_update(strategy: Strategy, data: UpdateData, settings: UpdateSettings, *, pad_token_id: int,
               correction: SampleCorrection | None = None, progress=None, processor=None) -> list[StepMetrics]:
    """Run PPO epochs over ``data`` with ``strategy`` (which holds the model and its optimizer:
    ``rft_core.training.strategy.build_strategy``) as ``settings`` say; mutates the model. The
    loss is the module docstring's.

    The recipe: check the inputs; select the high-entropy tokens (over all of ``data``); then,
    with the update's seeded random draws (``update_seeds`` of ``update.seed``, the policy
    version and the rank) and the model's dropout off (unless ``update.dropout``),
    ``train_steps`` runs the optimizer steps, each accumulating the loss of its micro-batches
    (``_PPOLoss.micro_step``) under the normaliser of its mini-batch.

    Args:
        settings: the ``update`` and ``kl`` config sections, the rollout temperature and the
            policy version (``UpdateSettings``).
        pad_token_id: the tokenizer's padding token (padded micro-batches).
        correction: the rollout correction (``rollout_correction_weights``), or None.
        progress: optional callable(done, total) after each micro-batch (``train_steps``).
        processor: a vision-language policy's ``VLProcessor``; each micro-batch then gets the
            vision inputs of ``data.images`` and ``data.videos`` (``with_vision``).
    Returns:
        One StepMetrics per optimizer step (the same on every rank).
    Raises:
        ValueError: empty ``data``, entropy filtering without ``data.entropies``, a
            correction or exclusion list of another length than ``data``, or a sample longer
            than ``update.max_tokens_per_micro_batch`` (before any step).
    """
    if len(data) == 0:
        raise ValueError("ppo_update got no samples")
    for name, values in (("correction", correction.weights if correction else None), ("data.excluded", data.excluded)):
        if values is not None and len(values) != len(data):
            raise ValueError(f"ppo_update: {name} has {len(values)} entries for {len(data)} samples")
    cfg = settings.update
    keep = _entropy_keep(data, cfg.entropy_top_fraction) if cfg.entropy_top_fraction is not None else None
    loss = _PPOLoss(strategy.model, data, settings, pad_token_id=pad_token_id, keep=keep, correction=correction,
                    processor=processor)
    order_seed, draw_seed = update_seeds(cfg.seed, settings.policy_version, strategy.rank)
    with update_rng(draw_seed, loss.device), contextlib.nullcontext() if cfg.dropout else dropout_disabled(strategy.model):
        micro_batching = MicroBatching.of("update", cfg, data.prompts, data.responses)
        steps = train_steps(strategy, len(data), micro_step=loss.micro_step, stats=STEP_STATS,
                            normaliser=loss.normaliser, epochs=cfg.epochs, train_batch_size=cfg.train_batch_size,
                            micro_batching=micro_batching, seed=order_seed, progress=progress)
    return [_step_metrics(r) for r in steps]
