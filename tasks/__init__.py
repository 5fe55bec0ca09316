"""Thin Prefect tasks, one per stage: they call rft_core.stages and return a ShardRef.

No math here. Result caching is off on purpose: the stage manifests are the source of truth
(Prefect's cache would not notice deleted shards), and each stage program returns its
committed shard at once when the config hash matches.

Flows call the tasks through ``StageTasks``, which tags them for Prefect tag concurrency limits
only when that is wanted: a tagged task run costs a concurrency-slot round trip to the server
(acquire a lease, renew, release), about 0.5 s per task on a local server on 2 cores, ~4 s per
iteration (docs/benchmarks.md).
"""
from __future__ import annotations

import logging

from tasks import stages as _stages
from tasks.stages import (
    actor_logprobs,
    advantages,
    critic_update,
    critic_values,
    eval_generate,
    eval_prompts,
    eval_summary,
    ppo_update,
    prompts,
    prune_checkpoints,
    ref_logprobs,
    rewards,
    rollout,
    rollout_merge,
    rollout_shard,
    dynamic_merge,
    signal_groups,
)

STAGE_TASKS = ("actor_logprobs", "advantages", "critic_update", "critic_values", "dynamic_merge", "eval_generate",
               "eval_prompts", "eval_summary", "ppo_update", "prompts", "prune_checkpoints", "ref_logprobs", "rewards",
               "rollout", "rollout_merge", "rollout_shard", "signal_groups")
__all__ = [*STAGE_TASKS, "DEVICE_STAGES", "StageTasks", "resolve_concurrency_tags", "server_has_tag_limits"]


# stages that hold a model on the device: tagged `gpu`; the others `cpu`
DEVICE_STAGES = frozenset({"rollout", "rollout_shard", "actor_logprobs", "ref_logprobs", "critic_values", "critic_update",
                           "ppo_update", "eval_generate"})
CONCURRENCY_TAGS = ("gpu", "cpu")


def server_has_tag_limits(tags: tuple[str, ...] = CONCURRENCY_TAGS) -> bool:
    """True when the Prefect server holds a tag concurrency limit on one of ``tags`` (then the
    stage tasks must carry them). A server that cannot be asked counts as True (tags on: the
    behaviour that never breaks a limit)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            found = {lim.tag for lim in client.read_concurrency_limits(limit=200, offset=0)}
            found |= {g.name.removeprefix("tag:") for g in client.read_global_concurrency_limits(limit=200)
                      if g.name.startswith("tag:")}
    except Exception as exc:  # noqa: BLE001 - any client/server error: keep the tags
        logging.getLogger("tasks").warning("cannot read concurrency limits (%s); stage tasks keep their tags", exc)
        return True
    return bool(found & set(tags))


def resolve_concurrency_tags(setting: bool | None) -> bool:
    """``orchestration.concurrency_tags``: True/False as given; None (auto): whether the server
    has a `gpu` or `cpu` tag concurrency limit (one API call)."""
    return server_has_tag_limits() if setting is None else setting


class StageTasks:
    """The stage tasks of one run, tagged `gpu` (model-holding stages) / `cpu` (the others) when
    ``concurrency_tags`` is True, untagged otherwise. Attribute access returns the Prefect task:
    ``StageTasks(True).rollout.submit(...)``.

    Raises:
        AttributeError: a name that is not a stage task.
    """

    def __init__(self, concurrency_tags: bool) -> None:
        self.concurrency_tags = concurrency_tags

    def __getattr__(self, name: str):
        if name not in STAGE_TASKS:
            raise AttributeError(f"no stage task {name!r}; stage tasks: {', '.join(STAGE_TASKS)}")
        task = getattr(_stages, name)
        if not self.concurrency_tags:
            return task
        return task.with_options(tags={"gpu" if name in DEVICE_STAGES else "cpu"})
