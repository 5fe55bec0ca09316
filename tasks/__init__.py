"""Thin Prefect tasks, one per stage (``tasks.stages``): each takes its stage's input model by
keyword and returns the committed ShardRef. No math here.

Flows call them as ``tasks.tagged(tasks.rollout, tags)(inp=RolloutInput(...))``: ``tagged``
returns the task itself when concurrency tags are off, else a copy tagged ``gpu`` (stages that
hold a model on the device) or ``cpu``. A tagged task run costs a concurrency-slot round trip
to the server (acquire a lease, renew, release), about 0.5 s per task on a local server on 2
cores, ~4 s per iteration (docs/benchmarks.md), so tags are on only where a limit exists.
"""
from __future__ import annotations

import logging
from typing import TypeVar

from prefect import Task

from tasks.stages import (
    actor_logprobs,
    advantages,
    critic_update,
    critic_values,
    dynamic_merge,
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
    signal_groups,
    start_workers,
    teacher_logprobs,
    validate_data,
)

STAGE_TASKS: tuple[Task, ...] = (
    actor_logprobs, advantages, critic_update, critic_values, dynamic_merge, eval_generate, eval_prompts, eval_summary,
    ppo_update, prompts, prune_checkpoints, ref_logprobs, rewards, rollout, rollout_merge, signal_groups, start_workers,
    validate_data, teacher_logprobs)
__all__ = ["CONCURRENCY_TAGS", "DEVICE_STAGES", "STAGE_TASKS", "actor_logprobs", "advantages", "critic_update",
           "critic_values", "dynamic_merge", "eval_generate", "eval_prompts", "eval_summary", "ppo_update", "prompts",
           "prune_checkpoints", "ref_logprobs", "resolve_concurrency_tags", "rewards", "rollout", "rollout_merge",
           "server_has_tag_limits", "signal_groups", "start_workers", "tagged", "teacher_logprobs", "validate_data"]

# task names of the stages that hold a model on the device: tagged `gpu`; the others `cpu`
DEVICE_STAGES = frozenset({"rollout", "actor_logprobs", "ref_logprobs", "critic_values", "critic_update", "ppo_update",
                           "eval_generate", "teacher_logprobs"})
CONCURRENCY_TAGS = ("gpu", "cpu")
T = TypeVar("T", bound=Task)


def tagged(task: T, enabled: bool) -> T:
    """``task`` as it is (``enabled`` False), or a copy tagged ``gpu`` when it is one of
    ``DEVICE_STAGES``, ``cpu`` otherwise."""
    if not enabled:
        return task
    return task.with_options(tags={"gpu" if task.name in DEVICE_STAGES else "cpu"})  # type: ignore[return-value]


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
