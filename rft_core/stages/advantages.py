"""Advantage stage: join the column groups on sample_id, shape rewards with KL, estimate advantages."""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rft_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    kl_penalized_outcome_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    overlong_filter_mask,
    rollout_correction,
)
from rft_core.algorithms.advantages import EstimatorInfo, clip_filter_like_weights, kl_shaped_token_rewards
from rft_core.algorithms.distill import distillation_advantages
from rft_core.algorithms.kl import next_kl_coef
from rft_core.algorithms.shaping import RunningMoments, clip_with_fraction, normalize_rewards, overlong_penalty
from rft_core.config import (AdvantageConfig, KLConfig, RolloutCorrectionConfig, ShapingConfig, TeacherConfig, TrainState,
                              estimator_kwargs)
from rft_core.stages.common import Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import AdvantagesInput, stage_program
from rft_core.stages.rewards import signal_prompt_ids
from schemas import ShardRef, read_manifest, read_shard
from schemas.batch import ColumnBatch, join_column_groups
from schemas.columns import ADVANTAGES


def compute_advantages(batch: ColumnBatch, *, kl_cfg: KLConfig, adv_cfg: AdvantageConfig, shaping: ShapingConfig | None = None,
                       state: TrainState | None = None, max_new_tokens: int | None = None,
                       greedy_baseline: tuple[torch.Tensor, torch.Tensor] | None = None,
                       correction: RolloutCorrectionConfig | None = None,
                       source_rewards: dict[str, torch.Tensor] | None = None,
                       teacher: TeacherConfig | None = None) -> dict[str, Any]:
    """Reward shaping, KL shaping and advantage estimation on a joined, padded batch (its
    ``rewards``, ``old_logprobs``, ``ref_logprobs``, ``values``, ``action_mask``, ``prompt_id``,
    ``finish_reason``).

    Order (``rft_core.algorithms.shaping``): overlong penalty, running reward normalisation
    (statistics of ``state`` updated with this batch's rewards), reward clipping
    (``_shape_rewards``, which also shapes ``greedy_baseline``), KL (``_token_kl``), the
    estimator with its inputs (``_estimator_inputs``: ``greedy_baseline``, ``correction``,
    ``source_rewards``), clip-filter-like weights, advantage whitening, the reward-mode KL
    penalty of outcome estimators (``_estimate``), advantage clipping, on-policy distillation
    with ``teacher`` and overlong filtering (``_finish_advantages``).

    KL per token k_t = estimator(old_logprobs_t, ref_logprobs_t) (zero without a reference), in
    ``reward`` mode:
    - outcome estimators (grpo, dr_grpo, rloo, cpgd): A_i = shape(estimator(r))_i - kl_coef * sum_t k_t
      (``kl_penalized_outcome_advantages``): the penalty after the group statistics and after
      clip-filter-like weights and whitening, so a group of equal task rewards gets
      |A_i| = kl_coef * |sum_t k_{i,t}| and never a normalised KL difference of size ~1;
    - token-level estimators (reinforce, reinforce_baseline, gae) see per-token rewards
      -kl_coef * k_t plus r on the last token (Ouyang et al. 2022, eq. 2; REINFORCE++).
    In ``loss`` mode rewards are left as they are (the update adds the KL term).

    Args:
        greedy_baseline: (rewards, response lengths), (B,) each: the reward and length of the
            greedy response of each sample's prompt, for an estimator with
            ``EstimatorInfo.greedy_baseline`` (remax; ``_shape_rewards``).
        correction: the update's rollout correction (``_estimator_inputs``: optimal_token_baseline).
        source_rewards: each reward source's score per sample, (B,) float, NaN where the
            sample's recipe has no such source (``reward_source_scores``; gdpo).
        teacher: on-policy distillation (``_finish_advantages``).
    Returns:
        dict with kl, advantages, returns (B, T) float32, shaped_rewards (B,) float32 (the
        reward minus the reward-mode KL penalty), the next ``state``, the shaping metrics and
        ``overlong_filtered`` ((B,) bool or None).
    Raises:
        ValueError: no rewards, an overlong penalty without ``max_new_tokens``, an estimator
            that needs critic values or a greedy baseline without them, or a finish reason other
            than stop/length (named with its row) under overlong filtering, or an estimator that
            needs ``sum_pi_squared`` without it (no actor stage, or one run without
            ``with_sum_pi_squared``), or one that needs per-source scores without them, or a
            ``teacher`` without the batch's ``teacher_logprobs``.
    """
    shaping = shaping or ShapingConfig()
    state = state or TrainState(kl_coef=kl_cfg.kl_coef)
    if batch.rewards is None:
        raise ValueError("compute_advantages needs the rewards column group")
    info = ADVANTAGE_ESTIMATORS.info(adv_cfg.estimator)
    if info.greedy_baseline and greedy_baseline is None:
        raise ValueError(f"advantage estimator {adv_cfg.estimator!r} needs the reward of a greedy response of every "
                         "prompt: run the rollout stage with greedy=true and the rewards stage on it (baseline_rollout, "
                         "baseline_rewards)")
    metrics: dict[str, float] = {}
    rewards, base, moments = _shape_rewards(batch.rewards.to(torch.float32), batch.action_mask, shaping, state,
                                            greedy_baseline=greedy_baseline, max_new_tokens=max_new_tokens,
                                            metrics=metrics)
    kl = _token_kl(batch, kl_cfg)
    coef = kl_cfg.kl_coef if kl_cfg.in_reward else 0.0
    kwargs = _estimator_inputs(batch, adv_cfg, info, base, correction=correction, source_rewards=source_rewards,
                               metrics=metrics)
    adv, ret = _estimate(batch, adv_cfg.estimator, info, rewards, kl, coef, kwargs, shaping=shaping, metrics=metrics)
    adv, ret, filtered = _finish_advantages(batch, adv, ret, shaping=shaping, teacher=teacher, metrics=metrics)
    shaped = rewards - coef * kl.sum(-1)
    seq_kl = float(kl.sum(-1).mean()) if kl.numel() else 0.0
    next_state = TrainState(
        kl_coef=next_kl_coef(kl_cfg.kl_coef, seq_kl, controller=kl_cfg.controller, target=kl_cfg.target,
                             horizon=kl_cfg.horizon, n_steps=len(rewards)),
        reward_count=moments.count, reward_mean=moments.mean, reward_m2=moments.m2)
    return {"kl": kl, "advantages": adv.to(torch.float32), "returns": ret.to(torch.float32), "shaped_rewards": shaped,
            "state": next_state, "metrics": metrics, "overlong_filtered": filtered}


def _shape_rewards(rewards: torch.Tensor, mask: torch.Tensor, shaping: ShapingConfig, state: TrainState, *,
                   greedy_baseline: tuple[torch.Tensor, torch.Tensor] | None, max_new_tokens: int | None,
                   metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor | None, RunningMoments]:
    """The rewards ((B,) float32) shaped in order: overlong penalty, running normalisation (the
    statistics of ``state`` updated with them), clipping; metrics added to ``metrics``.

    The greedy baseline (rewards, response lengths; None: none) is shaped as the rewards are, so
    that the difference stays a difference of comparable rewards: the overlong penalty of its
    own length, the running normalisation with the statistics of this batch's sampled rewards
    (the baseline itself is not counted in them), reward clipping. It carries no KL penalty
    (verl's ``reward_baselines`` neither).

    Returns:
        (rewards, the shaped baseline (B,) float32 or None, the updated running moments).
    Raises:
        ValueError: an overlong penalty without ``max_new_tokens``.
    """
    base, base_len = (greedy_baseline[0].to(torch.float32), greedy_baseline[1]) if greedy_baseline else (None, None)
    if shaping.overlong_buffer_len is not None:
        if max_new_tokens is None:
            raise ValueError("shaping.overlong_buffer_len needs max_new_tokens")
        penalty = overlong_penalty(mask.sum(-1), max_new_tokens=max_new_tokens, buffer_len=shaping.overlong_buffer_len,
                                   penalty_factor=shaping.overlong_penalty_factor)
        rewards = rewards + penalty
        metrics["overlong_penalty_mean"] = float(penalty.mean())
        if base is not None:
            base = base + overlong_penalty(base_len, max_new_tokens=max_new_tokens, buffer_len=shaping.overlong_buffer_len,
                                           penalty_factor=shaping.overlong_penalty_factor)
    moments = RunningMoments(state.reward_count, state.reward_mean, state.reward_m2)
    if shaping.reward_running_norm:
        moments = moments.update(rewards)
        rewards = normalize_rewards(rewards, moments, minus_mean=shaping.reward_running_norm_minus_mean).to(torch.float32)
        if base is not None:
            base = normalize_rewards(base, moments, minus_mean=shaping.reward_running_norm_minus_mean).to(torch.float32)
    if shaping.reward_clip is not None:
        rewards, metrics["reward_clip_frac"] = clip_with_fraction(rewards, shaping.reward_clip)
        if base is not None:
            base, _ = clip_with_fraction(base, shaping.reward_clip)
    return rewards, base, moments


def _token_kl(batch: ColumnBatch, kl_cfg: KLConfig) -> torch.Tensor:
    """(B, T) k_t = ``kl_cfg.estimator``(old_logprobs_t, ref_logprobs_t) (``kl_penalty``); zeros without a reference."""
    if batch.ref_logprobs is not None:
        return kl_penalty(batch.old_logprobs, batch.ref_logprobs, batch.action_mask, estimator=kl_cfg.estimator,
                          kl_clamp=kl_cfg.kl_clamp)
    return torch.zeros_like(batch.old_logprobs)


def _estimator_inputs(batch: ColumnBatch, adv_cfg: AdvantageConfig, info: EstimatorInfo, base: torch.Tensor | None, *,
                      correction: RolloutCorrectionConfig | None, source_rewards: dict[str, torch.Tensor] | None,
                      metrics: dict[str, float]) -> dict[str, Any]:
    """The keyword arguments of the advantage estimator (``estimator_kwargs``) plus the inputs
    its ``EstimatorInfo`` (``info``) asks for:

    - ``greedy_baseline`` (remax): ``reward_baselines``, the shaped greedy baseline ``base``.
    - ``needs_critic`` (gae): the batch's critic ``values``.
    - ``needs_sum_pi_squared`` (optimal_token_baseline): the batch's ``old_logprobs`` and
      ``sum_pi_squared`` (the actor stage's, (B, T) float32) and, with ``correction`` enabled
      (the update's rollout correction), ``rollout_is_weights``: the correction's weights of
      these old log-probs against the rollout's (0 on masked tokens), as verl's trainer passes
      its ``rollout_is_weights``; otherwise None.
    - ``needs_reward_sources`` (gdpo): ``source_rewards``, each reward source's score per sample.

    Raises:
        ValueError: an input the estimator needs is missing (named, with the stage that makes it).
    """
    kwargs = estimator_kwargs(adv_cfg)
    if info.greedy_baseline:
        assert base is not None
        kwargs["reward_baselines"] = base
        metrics["greedy_baseline_reward_mean"] = float(base.mean()) if len(base) else 0.0
    if info.needs_critic:
        if batch.values is None:
            raise ValueError(f"advantage estimator {adv_cfg.estimator!r} needs critic values: run the critic_values stage")
        kwargs["values"] = batch.values
    if info.needs_sum_pi_squared:
        if batch.sum_pi_squared is None:
            raise ValueError(f"advantage estimator {adv_cfg.estimator!r} needs sum_v pi_old(v)^2 at every token: run the "
                             "actor_logprobs stage with with_sum_pi_squared=true (logprobs.recompute_old_logprobs auto or "
                             "true)")
        kwargs["old_logprobs"], kwargs["sum_pi_squared"] = batch.old_logprobs, batch.sum_pi_squared
        kwargs["rollout_is_weights"] = None
        if correction is not None and correction.enabled:
            kwargs["rollout_is_weights"] = rollout_correction(
                batch.old_logprobs, batch.rollout_logprobs, batch.action_mask, **correction.correction_kwargs()).weights
    if info.needs_reward_sources:
        if source_rewards is None:
            raise ValueError(f"advantage estimator {adv_cfg.estimator!r} needs the score of each reward source: pass "
                             "source_rewards (reward_source_scores of the rewards shard)")
        kwargs["source_rewards"] = source_rewards
    return kwargs


def _estimate(batch: ColumnBatch, estimator: str, info: EstimatorInfo, rewards: torch.Tensor, kl: torch.Tensor, coef: float,
              kwargs: dict[str, Any], *, shaping: ShapingConfig,
              metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, T): the estimator on the shaped ``rewards`` over the groups of
    the batch's ``prompt_id``, then clip-filter-like weights and whitening (``shaping``), with the
    reward-mode KL penalty ``coef`` * k_t (``compute_advantages``'s docstring): on each token's
    reward for a token-level estimator, after the shaping for an outcome estimator."""
    mask = batch.action_mask
    _, group_np = np.unique(np.asarray(batch.prompt_id), return_inverse=True)
    group_ids = torch.as_tensor(group_np, dtype=torch.long)

    def shape(adv: torch.Tensor) -> torch.Tensor:  # clip-filter-like weights, then whitening
        if shaping.clip_filter_like_weight:
            w = clip_filter_like_weights(rewards, group_ids, clip_eps=shaping.clip_filter_like_clip_eps,
                                         lamda=shaping.clip_filter_like_lamda)
            adv = adv * w[:, None].to(adv.dtype)
            metrics["clip_filter_like_weight_mean"] = float(w.mean())
        return masked_whiten(adv, mask) if shaping.advantage_whiten else adv

    if info.token_level:  # the KL penalty goes on each token
        kwargs["token_rewards"] = kl_shaped_token_rewards(rewards, kl, mask, kl_coef=coef)
        adv, ret = ADVANTAGE_ESTIMATORS[estimator](rewards, group_ids, mask, **kwargs)
        return shape(adv), ret
    # outcome estimators: the KL penalty after the group statistics and the shaping steps
    return kl_penalized_outcome_advantages(estimator, rewards, group_ids, mask, kl=kl, kl_coef=coef, transform=shape,
                                           **kwargs)


def _finish_advantages(batch: ColumnBatch, adv: torch.Tensor, ret: torch.Tensor, *, shaping: ShapingConfig,
                       teacher: TeacherConfig | None,
                       metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The estimator's advantages after advantage clipping, on-policy distillation and overlong
    filtering, in that order: (advantages, returns, the (B,) bool overlong-filtered rows or None).

    On-policy distillation (``teacher``, its path set; ``rft_core.algorithms.distill``):
    A_t = A_t + teacher.coef * d_t with d_t = log nu(y_t) - log pi_old(y_t) (the batch's
    ``teacher_logprobs`` and ``old_logprobs``), or with ``teacher.use_task_rewards`` False
    A_t = teacher.coef * d_t alone (returns = A); the signal is not whitened, clipped or
    group-normalised (verl, Thinking Machines).

    Overlong filtering (``shaping.overlong_filter``; DAPO, arXiv:2503.14476, sec. 3.4): the
    advantages of truncated responses (finish_reason "length") are set to 0 after everything
    else (the group statistics still include their rewards, as DAPO's and TRL's masking of the
    loss does); the update leaves them out of the loss entirely.

    Raises:
        ValueError: a ``teacher`` without the batch's ``teacher_logprobs``, or a finish reason
            other than stop/length (named with its row) under overlong filtering.
    """
    mask = batch.action_mask
    if shaping.advantage_clip is not None:
        adv, metrics["advantage_clip_frac"] = clip_with_fraction(adv, shaping.advantage_clip, mask)
    if teacher is not None and teacher.enabled:  # on-policy distillation: the teacher's per-token signal
        if batch.teacher_logprobs is None:
            raise ValueError(f"teacher.path={teacher.path!r} (distillation) needs the teacher_logprobs column group: run "
                             "the teacher_logprobs stage")
        adv, ret, distill_metrics = distillation_advantages(adv, ret, batch.old_logprobs, batch.teacher_logprobs, mask,
                                                            coef=teacher.coef, use_task_rewards=teacher.use_task_rewards)
        metrics.update(distill_metrics)
    filtered = None
    if shaping.overlong_filter:
        kept = overlong_filter_mask(mask, batch.finish_reason)  # checks every finish reason
        filtered = torch.tensor([r == "length" for r in batch.finish_reason], dtype=torch.bool)
        adv = torch.where(kept, adv, torch.zeros_like(adv))
        metrics["overlong_filtered_frac"] = float(filtered.float().mean()) if len(filtered) else 0.0
    return adv, ret, filtered


@stage_program(AdvantagesInput)
def run(inp: AdvantagesInput) -> ShardRef:
    """Write the advantages column group for every sample of the rollout.

    ``actor_logprobs`` None: old log-probs are the rollout engine's own. ``ref_logprobs`` None:
    no KL. ``kl.kl_coef`` is this iteration's coefficient; the manifest summary records the
    next one and the whole next ``TrainState`` (``next_state``), so a resumed run continues
    exactly, and whether truncated responses were filtered (``overlong_filtered``).
    ``baseline_rollout`` / ``baseline_rewards``: the greedy response of each prompt and its
    reward (remax), matched to the samples by prompt_id (``greedy_baseline_of``).
    ``actor_logprobs`` with the optional ``sum_pi_squared`` column: the optimal token baseline's
    input (``compute_advantages``), weighted by ``rollout_correction``'s weights when given.
    ``teacher_logprobs`` with ``teacher``: on-policy distillation's per-token signal goes into the
    advantages (``compute_advantages``). An empty rollout (a partial rollout in which no group
    finished) gives an empty shard whose next ``TrainState`` is ``inp.state`` (``_empty_summary``).
    """
    commit = stage_commit(inp)

    def compute() -> ShardRef:
        r = read_shard(inp.rollout, stage="rollout")
        rewards_table = read_shard(inp.rewards, stage="rewards")
        if r.num_rows == 0:  # a partial rollout in which no group finished: nothing to train on
            return commit.write(ADVANTAGES.arrow.empty_table(), schema=ADVANTAGES, summary=_empty_summary(inp),
                                inputs={"rollout": inp.rollout, "rewards": inp.rewards})
        batch = join_column_groups(
            r, rewards=rewards_table,
            actor_logprobs=read_shard(inp.actor_logprobs, stage="actor_logprobs") if inp.actor_logprobs else None,
            ref_logprobs=read_shard(inp.ref_logprobs, stage="ref_logprobs") if inp.ref_logprobs else None,
            critic_values=read_shard(inp.critic_values, stage="critic_values") if inp.critic_values else None,
            teacher_logprobs=read_shard(inp.teacher_logprobs, stage="teacher_logprobs") if inp.teacher_logprobs else None)
        baseline = None
        if inp.baseline_rollout is not None and inp.baseline_rewards is not None:
            baseline = greedy_baseline_of(batch.prompt_id, read_shard(inp.baseline_rollout, stage="rollout"),
                                          read_shard(inp.baseline_rewards, stage="rewards"))
        sources = None
        if ADVANTAGE_ESTIMATORS.info(inp.advantage.estimator).needs_reward_sources:
            weights = getattr(inp.advantage, "reward_weights", None)
            sources = reward_source_scores(batch.sample_id, rewards_table, names=list(weights) if weights else None)
        with Timer() as t:
            res = compute_advantages(batch, kl_cfg=inp.kl, adv_cfg=inp.advantage, shaping=inp.shaping, state=inp.state,
                                     max_new_tokens=inp.max_new_tokens, greedy_baseline=baseline,
                                     correction=inp.rollout_correction, source_rewards=sources, teacher=inp.teacher)
        lengths = batch.response_length.tolist()

        def lists(x: torch.Tensor) -> pa.Array:
            return pa.array([x[i, :n].tolist() for i, n in enumerate(lengths)], pa.list_(pa.float32()))

        table = pa.table({
            "sample_id": r.column("sample_id"), "prompt_id": r.column("prompt_id"),
            "shaped_rewards": pa.array(res["shaped_rewards"].tolist(), pa.float32()),
            "kl": lists(res["kl"]), "advantages": lists(res["advantages"]), "returns": lists(res["returns"]),
        }, schema=ADVANTAGES.arrow)
        summary = {"seconds": t.seconds, **_summary(batch, res, inp.kl, rewards_table)}
        inputs = {name: ref for name, ref in (("rollout", inp.rollout), ("rewards", inp.rewards),
                                              ("actor_logprobs", inp.actor_logprobs), ("ref_logprobs", inp.ref_logprobs),
                                              ("critic_values", inp.critic_values),
                                              ("teacher_logprobs", inp.teacher_logprobs),
                                              ("baseline_rollout", inp.baseline_rollout),
                                              ("baseline_rewards", inp.baseline_rewards)) if ref}
        return commit.write(table, schema=ADVANTAGES, inputs=inputs, summary=summary)

    return reuse_or_compute(commit, compute)


def reward_source_scores(sample_ids: list[str], rewards: pa.Table, *,
                         names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Each reward source's score of every sample, from the rewards shard's ``reward_metrics``
    (``{source: score, 'source.extra': value}``; ``rft_core.rewards.engine``): source name ->
    (B,) float64 in the order of ``sample_ids``, NaN where a sample has no score of that source
    (its recipe does not use it).

    Args:
        sample_ids: the batch's samples, in order.
        rewards: the rewards shard (``sample_id``, ``reward_metrics``).
        names: the sources to read; None: every key without a "." (the source scores, not their
            extras or fallback counters).
    Raises:
        ValueError: a sample without a row in the rewards shard, or a named source that no
            sample has (the message lists the scores found).
    """
    metrics = dict(zip(rewards.column("sample_id").to_pylist(), rewards.column("reward_metrics").to_pylist()))
    missing = [sid for sid in sample_ids if sid not in metrics]
    if missing:
        raise ValueError(f"reward sources: sample {missing[0]!r} has no row in the rewards shard")
    rows = [dict(metrics[sid] or []) for sid in sample_ids]
    found = sorted({k for row in rows for k in row if "." not in k})
    wanted = found if names is None else list(names)
    absent = [n for n in wanted if not any(n in row for row in rows)]
    if absent:
        raise ValueError(f"reward sources: no sample of the rewards shard has a score of {absent[0]!r} in its "
                         f"reward_metrics (scores found: {', '.join(found) or 'none'})")
    return {n: torch.tensor([float(row.get(n, float("nan"))) for row in rows], dtype=torch.float64) for n in wanted}


def greedy_baseline_of(prompt_ids: list[str], rollout: pa.Table, rewards: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward and length of the greedy response of each sample's prompt: (rewards, lengths),
    (B,) float32 and int64, from a greedy rollout (one row per prompt) and its rewards.

    Raises:
        ValueError: a prompt with no greedy response or more than one, or a greedy sample
            without a reward.
    """
    reward_of = dict(zip(rewards.column("sample_id").to_pylist(), rewards.column("rewards").to_pylist()))
    by_prompt: dict[str, tuple[float, int]] = {}
    for sid, pid, mask in zip(rollout.column("sample_id").to_pylist(), rollout.column("prompt_id").to_pylist(),
                              rollout.column("action_mask").to_pylist()):
        if pid in by_prompt:
            raise ValueError(f"greedy baseline: prompt {pid!r} has more than one greedy response")
        if sid not in reward_of:
            raise ValueError(f"greedy baseline: sample {sid!r} has no reward in the baseline rewards")
        by_prompt[pid] = (float(reward_of[sid]), sum(mask))
    missing = sorted(set(prompt_ids) - set(by_prompt))
    if missing:
        raise ValueError(f"greedy baseline: no greedy response for prompt(s) {missing[:3]} of the rollout")
    return (torch.tensor([by_prompt[p][0] for p in prompt_ids], dtype=torch.float32),
            torch.tensor([by_prompt[p][1] for p in prompt_ids], dtype=torch.long))


def _summary(batch: ColumnBatch, res: dict[str, Any], kl_cfg: KLConfig, rewards_table: pa.Table) -> dict[str, Any]:
    """The advantages manifest summary: the KL coefficient, mode and estimator, the next
    coefficient and TrainState, reward, KL and advantage statistics, the fraction of groups with
    reward spread, and ``overlong_filter`` (True when truncated responses were filtered: the
    update reads it, ``overlong_filtered``)."""
    mask, rw = batch.action_mask, batch.rewards
    assert rw is not None
    seq_kl = res["kl"].sum(-1)
    n_groups = len(set(batch.prompt_id))
    return {
        "kl_coef": kl_cfg.kl_coef,
        "kl_mode": kl_cfg.mode, "kl_estimator": kl_cfg.estimator,
        **({"overlong_filter": True} if res["overlong_filtered"] is not None else {}),
        "next_kl_coef": res["state"].kl_coef,
        "next_state": res["state"].model_dump(),
        "shaped_reward_mean": float(res["shaped_rewards"].mean()),
        **res["metrics"],
        "reward_mean": float(rw.mean()), "reward_std": float(rw.std(unbiased=True)) if len(rw) > 1 else 0.0,
        "kl_mean": float(seq_kl.mean()), "kl_token_mean": float(masked_mean(res["kl"], mask)),
        "advantage_abs_mean": float(masked_mean(res["advantages"].abs(), mask)),
        "groups_with_signal": len(signal_prompt_ids(rewards_table)) / max(n_groups, 1),
    }


def _empty_summary(inp: AdvantagesInput) -> dict[str, Any]:
    """The summary of the advantages of an empty rollout (``rollout.partial``: no group finished
    in this iteration): the KL coefficient and ``TrainState`` carry over unchanged, ``empty``."""
    return {"seconds": 0.0, "kl_coef": inp.kl.kl_coef, "kl_mode": inp.kl.mode, "kl_estimator": inp.kl.estimator,
            "next_kl_coef": inp.state.kl_coef, "next_state": inp.state.model_dump(), "empty": True}


def next_state(advantages: ShardRef) -> TrainState:
    """The ``TrainState`` the iteration after ``advantages`` starts from (its manifest's
    ``next_state``).

    Raises:
        ShardNotCommittedError: ``advantages`` is not committed.
    """
    return TrainState.model_validate(read_manifest(advantages.uri)[0].summary["next_state"])


def overlong_filtered(advantages: ShardRef) -> bool:
    """Whether the committed ``advantages`` filtered truncated responses (``shaping.overlong_filter``):
    the update then leaves the rows with finish_reason "length" out of its loss.

    Raises:
        ShardNotCommittedError: ``advantages`` is not committed.
    """
    return bool(read_manifest(advantages.uri)[0].summary.get("overlong_filter", False))
