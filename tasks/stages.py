"""One Prefect task per stage. The tasks carry no tags here: ``tasks.StageTasks`` adds ``gpu``
(stages that hold a model on the device) or ``cpu`` per run when concurrency tags are on, so a
Prefect tag concurrency limit (``prefect concurrency-limit create gpu 1``) lets only one
model-holding stage run at a time on one device."""
from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rft_core import stages
from rft_core.config import (
    AdvantageConfig,
    CriticConfig,
    DataConfig,
    EvalConfig,
    KLConfig,
    LogprobConfig,
    RewardConfig,
    RolloutConfig,
    ShapingConfig,
    TrainState,
    UpdateConfig,
)
from rft_core.stages import evaluate as evaluate_stages
from rft_core.config import CheckpointConfig, RunnerConfig
from rft_core.stages import retention
from rft_core.stages.common import PolicyRef
from rft_core.stages.runner import run_stage
from schemas import ShardRef

_opts = dict(cache_policy=NO_CACHE, persist_result=False)


def _stage_log():
    """Where a stage subprocess's output lines go: the task run's logger (module logger outside a run)."""
    try:
        return get_run_logger().info
    except Exception:  # MissingContextError: called as .fn() outside a task run
        return logging.getLogger("tasks.stages").info


@task(name="prompts", **_opts)
def prompts(cfg: DataConfig, tokenizer_path: str, iteration: int, out: str, attempt: int = 0) -> ShardRef:
    """Select and tokenize the iteration's prompts; writes the `prompts` column group."""
    return stages.prompts.run(cfg, tokenizer_path=tokenizer_path, iteration=iteration, out=out, attempt=attempt)


@task(name="rollout", retries=1, **_opts)
def rollout(prompts: ShardRef, policy: PolicyRef, cfg: RolloutConfig, iteration: int, out: str, dtype: str,
            attempt: int = 0, runner: RunnerConfig | None = None) -> ShardRef:
    """Sample a group of responses per prompt; writes the `rollout` column group."""
    return run_stage("rollout", runner, log=_stage_log(), prompts=prompts, policy=policy, cfg=cfg, iteration=iteration,
                     out=out, dtype=dtype, attempt=attempt)


@task(name="rollout_shard", retries=1, **_opts)
def rollout_shard(prompts: ShardRef, policy: PolicyRef, cfg: RolloutConfig, iteration: int, out: str, dtype: str,
                  attempt: int, shard: tuple[int, int], runner: RunnerConfig | None = None) -> ShardRef:
    """One shard (index, count) of the rollout: a share of its generation batches."""
    return run_stage("rollout", runner, log=_stage_log(), prompts=prompts, policy=policy, cfg=cfg, iteration=iteration,
                     out=out, dtype=dtype, attempt=attempt, shard=shard)


@task(name="rollout_merge", **_opts)
def rollout_merge(parts: list[ShardRef], prompts: ShardRef, policy: PolicyRef, cfg: RolloutConfig, iteration: int, out: str,
                  dtype: str, attempt: int = 0) -> ShardRef:
    """The rollout from its shards, as the single-worker rollout would have written it."""
    return stages.rollout.run_merge(parts, prompts, policy, cfg, iteration=iteration, out=out, dtype=dtype, attempt=attempt)


@task(name="signal_groups", **_opts)
def signal_groups(attempt_rewards: list[ShardRef]) -> int:
    """Dynamic sampling: how many distinct groups with reward spread the attempts hold."""
    return stages.dynamic.count_signal_groups(attempt_rewards)


@task(name="dynamic_merge", **_opts)
def dynamic_merge(attempts: list[tuple[ShardRef, ShardRef, ShardRef]], target_groups: int, out_prompts: str,
                  out_rollout: str, out_rewards: str) -> tuple[ShardRef, ShardRef, ShardRef]:
    """Dynamic sampling: the kept groups of all attempts as the iteration's prompts/rollout/rewards."""
    return stages.dynamic.run_merge(attempts, target_groups=target_groups, out_prompts=out_prompts,
                                    out_rollout=out_rollout, out_rewards=out_rewards)


@task(name="actor_logprobs", retries=1, **_opts)
def actor_logprobs(rollout: ShardRef, policy: PolicyRef, cfg: LogprobConfig, temperature: float, out: str, dtype: str,
                   runner: RunnerConfig | None = None) -> ShardRef:
    """Log-probs of the responses under the policy before the update (`old_logprobs`)."""
    return run_stage("actor_logprobs", runner, log=_stage_log(), rollout=rollout, model=policy, cfg=cfg,
                     temperature=temperature, out=out, dtype=dtype)


@task(name="ref_logprobs", retries=1, **_opts)
def ref_logprobs(rollout: ShardRef, reference: str, cfg: LogprobConfig, temperature: float, out: str, dtype: str,
                 runner: RunnerConfig | None = None) -> ShardRef:
    """Log-probs of the responses under the reference model (`ref_logprobs`)."""
    return run_stage("ref_logprobs", runner, log=_stage_log(), rollout=rollout, model=reference, cfg=cfg,
                     temperature=temperature, out=out, dtype=dtype)


@task(name="rewards", retries=1, **_opts)
def rewards(rollout: ShardRef, prompts: ShardRef, cfg: RewardConfig, out: str) -> ShardRef:
    """Score every response of the rollout; writes the `rewards` column group."""
    return stages.rewards.run(rollout, prompts, cfg, out=out)


@task(name="advantages", **_opts)
def advantages(rollout: ShardRef, rewards: ShardRef, actor: ShardRef | None, ref: ShardRef | None,
               critic: ShardRef | None, kl_cfg: KLConfig, adv_cfg: AdvantageConfig, shaping: ShapingConfig,
               state: TrainState, max_new_tokens: int, out: str) -> ShardRef:
    """Join the column groups on sample_id, shape rewards and estimate advantages."""
    return stages.advantages.run(rollout, rewards, actor=actor, ref=ref, critic=critic, kl_cfg=kl_cfg, adv_cfg=adv_cfg,
                                 out=out, shaping=shaping, state=state, max_new_tokens=max_new_tokens)


@task(name="critic_values", retries=1, **_opts)
def critic_values(rollout: ShardRef, critic: PolicyRef, cfg: CriticConfig, out: str,
                  runner: RunnerConfig | None = None) -> ShardRef:
    """Critic values of every response token; writes the `critic_values` column group."""
    return run_stage("critic_values", runner, log=_stage_log(), rollout=rollout, critic=critic, cfg=cfg, out=out)


@task(name="critic_update", **_opts)
def critic_update(rollout: ShardRef, advantages: ShardRef, values: ShardRef, critic: PolicyRef, cfg: CriticConfig,
                  out: str, runner: RunnerConfig | None = None) -> ShardRef:
    """Train the critic on the returns; commits metrics and the new critic checkpoint."""
    return run_stage("critic_update", runner, log=_stage_log(), rollout=rollout, advantages=advantages, values=values,
                     critic=critic, cfg=cfg, out=out)


@task(name="ppo_update", **_opts)
def ppo_update(rollout: ShardRef, advantages: ShardRef, actor: ShardRef | None, ref: ShardRef | None, policy: PolicyRef,
               cfg: UpdateConfig, kl_cfg: KLConfig, temperature: float, out: str, dtype: str,
               runner: RunnerConfig | None = None, background_optimizer: bool = False) -> ShardRef:
    """Update the policy; commits per-step metrics and the new checkpoint (the optimizer
    state, with ``background_optimizer``, in a background thread: see
    ``rft_core.stages.optimizer_state``)."""
    return run_stage("ppo_update", runner, log=_stage_log(), rollout=rollout, advantages=advantages, actor=actor, ref=ref,
                     policy=policy, cfg=cfg, kl_cfg=kl_cfg, temperature=temperature, out=out, dtype=dtype,
                     background_optimizer=background_optimizer)


@task(name="eval_prompts", **_opts)
def eval_prompts(data: DataConfig, cfg: EvalConfig, tokenizer_path: str, out: str) -> ShardRef:
    """Held-out prompts of the training task (question texts disjoint from the training data)."""
    return evaluate_stages.run_prompts(data, cfg, tokenizer_path=tokenizer_path, out=out)


@task(name="eval_generate", retries=1, **_opts)
def eval_generate(prompts: ShardRef, policy: PolicyRef, max_new_tokens: int, batch_size: int, out: str,
                  dtype: str) -> ShardRef:
    """One greedy response per held-out prompt; writes a `rollout` shard."""
    return evaluate_stages.run_generate(prompts, policy, max_new_tokens=max_new_tokens, batch_size=batch_size, out=out,
                                        dtype=dtype)


@task(name="eval_summary", **_opts)
def eval_summary(prompts: ShardRef, rollout: ShardRef, rewards: ShardRef, policy: PolicyRef, out: str) -> ShardRef:
    """Join prompts, responses and rewards into the `eval` shard (accuracy, mean reward)."""
    return evaluate_stages.run_summary(prompts, rollout, rewards, policy=policy, out=out)


@task(name="prune_checkpoints", **_opts)
def prune_checkpoints(run_root: str, iteration: int, cfg: CheckpointConfig) -> dict[str, list[str]]:
    """Checkpoint retention after ``iteration``: prune the checkpoints older than the last
    ``cfg.keep_last`` iterations (nothing when keep_last is None)."""
    if cfg.keep_last is None:
        return {}
    return retention.prune_checkpoints(run_root, iteration, keep_last=cfg.keep_last, prune=cfg.prune)
