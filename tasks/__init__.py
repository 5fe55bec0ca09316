"""Thin Prefect tasks, one per stage: they call rft_core.stages and return a ShardRef.

No math here. Result caching is off on purpose: the stage manifests are the source of truth
(Prefect's cache would not notice deleted shards), and each stage program returns its
committed shard at once when the config hash matches.
"""
from tasks.stages import (
    actor_logprobs,
    advantages,
    critic_update,
    critic_values,
    ppo_update,
    prompts,
    ref_logprobs,
    rewards,
    rollout,
    rollout_merge,
    rollout_shard,
    dynamic_merge,
    signal_groups,
)

__all__ = ["actor_logprobs", "advantages", "critic_update", "critic_values", "dynamic_merge", "ppo_update", "prompts",
           "ref_logprobs", "rewards", "rollout", "rollout_merge", "rollout_shard", "signal_groups"]
