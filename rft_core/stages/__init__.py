"""Stage programs: read input shards, call the algorithms/models, write one committed shard.

Each ``run`` first checks for a committed manifest with the same config hash at its output URI
and returns that ShardRef without recomputing; otherwise it computes and commits. They never
import prefect: tasks call them in-process, and they can run in another environment.
"""
from rft_core.stages import advantages, critic, dynamic, logprobs, prompts, rewards, rollout, update

__all__ = ["advantages", "critic", "dynamic", "logprobs", "prompts", "rewards", "rollout", "update"]
