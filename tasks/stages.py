"""One Prefect task per stage. Tag ``gpu`` marks stages that hold a model on the device: a
Prefect tag concurrency limit (``prefect concurrency-limit create gpu 1``) then lets only one
of them run at a time on one device."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from rft_core import stages
from rft_core.config import (
    AdvantageConfig,
    CriticConfig,
    DataConfig,
    KLConfig,
    LogprobConfig,
    RewardConfig,
    RolloutConfig,
    ShapingConfig,
    TrainState,
    UpdateConfig,
)
from rft_core.stages.common import PolicyRef
from schemas import ShardRef

_opts = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="prompts", tags=["cpu"], **_opts)
def prompts(cfg: DataConfig, tokenizer_path: str, iteration: int, out: str, attempt: int = 0) -> ShardRef:
    """Select and tokenize the iteration's prompts; writes the `prompts` column group."""
    return stages.prompts.run(cfg, tokenizer_path=tokenizer_path, iteration=iteration, out=out, attempt=attempt)


@task(name="rollout", tags=["gpu"], retries=1, **_opts)
def rollout(prompts: ShardRef, policy: PolicyRef, cfg: RolloutConfig, iteration: int, out: str, dtype: str,
            attempt: int = 0) -> ShardRef:
    """Sample a group of responses per prompt; writes the `rollout` column group."""
    return stages.rollout.run(prompts, policy, cfg, iteration=iteration, out=out, dtype=dtype, attempt=attempt)


@task(name="signal_groups", tags=["cpu"], **_opts)
def signal_groups(attempt_rewards: list[ShardRef]) -> int:
    """Dynamic sampling: how many distinct groups with reward spread the attempts hold."""
    return stages.dynamic.count_signal_groups(attempt_rewards)


@task(name="dynamic_merge", tags=["cpu"], **_opts)
def dynamic_merge(attempts: list[tuple[ShardRef, ShardRef, ShardRef]], target_groups: int, out_prompts: str,
                  out_rollout: str, out_rewards: str) -> tuple[ShardRef, ShardRef, ShardRef]:
    """Dynamic sampling: the kept groups of all attempts as the iteration's prompts/rollout/rewards."""
    return stages.dynamic.run_merge(attempts, target_groups=target_groups, out_prompts=out_prompts,
                                    out_rollout=out_rollout, out_rewards=out_rewards)


@task(name="actor_logprobs", tags=["gpu"], retries=1, **_opts)
def actor_logprobs(rollout: ShardRef, policy: PolicyRef, cfg: LogprobConfig, temperature: float, out: str, dtype: str) -> ShardRef:
    """Log-probs of the responses under the policy before the update (`old_logprobs`)."""
    return stages.logprobs.run(rollout, policy, cfg, stage="actor_logprobs", temperature=temperature, out=out, dtype=dtype)


@task(name="ref_logprobs", tags=["gpu"], retries=1, **_opts)
def ref_logprobs(rollout: ShardRef, reference: str, cfg: LogprobConfig, temperature: float, out: str, dtype: str) -> ShardRef:
    """Log-probs of the responses under the reference model (`ref_logprobs`)."""
    return stages.logprobs.run(rollout, reference, cfg, stage="ref_logprobs", temperature=temperature, out=out, dtype=dtype)


@task(name="rewards", tags=["cpu"], retries=1, **_opts)
def rewards(rollout: ShardRef, prompts: ShardRef, cfg: RewardConfig, out: str) -> ShardRef:
    """Score every response of the rollout; writes the `rewards` column group."""
    return stages.rewards.run(rollout, prompts, cfg, out=out)


@task(name="advantages", tags=["cpu"], **_opts)
def advantages(rollout: ShardRef, rewards: ShardRef, actor: ShardRef | None, ref: ShardRef | None,
               critic: ShardRef | None, kl_cfg: KLConfig, adv_cfg: AdvantageConfig, shaping: ShapingConfig,
               state: TrainState, max_new_tokens: int, out: str) -> ShardRef:
    """Join the column groups on sample_id, shape rewards and estimate advantages."""
    return stages.advantages.run(rollout, rewards, actor=actor, ref=ref, critic=critic, kl_cfg=kl_cfg, adv_cfg=adv_cfg,
                                 out=out, shaping=shaping, state=state, max_new_tokens=max_new_tokens)


@task(name="critic_values", tags=["gpu"], retries=1, **_opts)
def critic_values(rollout: ShardRef, critic: PolicyRef, cfg: CriticConfig, out: str) -> ShardRef:
    """Critic values of every response token; writes the `critic_values` column group."""
    return stages.critic.run_values(rollout, critic, cfg, out=out)


@task(name="critic_update", tags=["gpu"], **_opts)
def critic_update(rollout: ShardRef, advantages: ShardRef, values: ShardRef, critic: PolicyRef, cfg: CriticConfig,
                  out: str) -> ShardRef:
    """Train the critic on the returns; commits metrics and the new critic checkpoint."""
    return stages.critic.run_update(rollout, advantages, values, critic, cfg, out=out)


@task(name="ppo_update", tags=["gpu"], **_opts)
def ppo_update(rollout: ShardRef, advantages: ShardRef, actor: ShardRef | None, ref: ShardRef | None, policy: PolicyRef,
               cfg: UpdateConfig, kl_cfg: KLConfig, temperature: float, out: str, dtype: str) -> ShardRef:
    """Update the policy; commits per-step metrics and the new checkpoint."""
    return stages.update.run(rollout, advantages, actor=actor, ref=ref, policy=policy, cfg=cfg, kl_cfg=kl_cfg,
                             temperature=temperature, out=out, dtype=dtype)
