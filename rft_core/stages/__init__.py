"""Stage programs: read input shards, call the algorithms/models, write one committed shard.

Each ``run`` first checks for a committed manifest with the same config hash at its output URI
and returns that ShardRef without recomputing; otherwise it computes and commits. Prefect is
never imported here: tasks call these programs in-process, and they can run elsewhere.
"""
from rft_core.stages import advantages, critic, dynamic, logprobs, prompts, rewards, rollout, update

__all__ = ["advantages", "critic", "dynamic", "logprobs", "prompts", "rewards", "rollout", "update"]
