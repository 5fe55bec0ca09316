"""One Prefect task per stage program: keyword-only, taking the stage's input model
(``rft_core.api``: ``PromptsInput``, ``RolloutInput``, ...) and returning what the program
committed. No math and no argument plumbing here: ``run_stage`` runs the program in this
process or, with a ``runner``, as ``python -m rft_core.stages <program>`` (another interpreter,
torchrun).

The tasks carry no tags: ``tasks.tagged`` adds ``gpu`` (stages that hold a model on the device)
or ``cpu`` per run when concurrency tags are on, so a Prefect tag concurrency limit
(``prefect concurrency-limit create gpu 1``) lets only one model-holding stage run at a time on
one device. Result caching is off on purpose: the stage manifests are the source of truth
(Prefect's cache would not notice deleted shards), and each program returns its committed
shard at once when the config hash matches.
"""
from __future__ import annotations

import logging
from typing import Callable, ParamSpec, TypeVar

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rft_core.api import (
    ActorLogprobsInput,
    AdvantagesInput,
    CriticUpdateInput,
    CriticValuesInput,
    DynamicMergeInput,
    EvalGenerateInput,
    EvalPromptsInput,
    EvalSummaryInput,
    PPOUpdateInput,
    PromptsInput,
    RefLogprobsInput,
    RewardsInput,
    RolloutInput,
    RolloutMergeInput,
    TeacherLogprobsInput,
    check_judge_keys,
    check_teacher_tokenizer,
    count_signal_groups,
    apply_retention,
    run_stage,
    start_run_workers,
    validate_run_data,
)
from rft_core.config import CheckpointConfig, RunnerConfig, TrainConfig
from schemas import ShardRef

P = ParamSpec("P")
R = TypeVar("R")


def _stage_task(name: str, *, retries: int = 0) -> Callable[[Callable[P, R]], Task[P, R]]:
    """The Prefect task decorator of a stage: named, without result caching or persistence."""
    return task(name=name, retries=retries, cache_policy=NO_CACHE, persist_result=False)


def _stage_log() -> Callable[[str], None]:
    """Where a stage subprocess's output lines go: the task run's logger (module logger outside a run)."""
    try:
        return get_run_logger().info
    except Exception:  # MissingContextError: called as .fn() outside a task run
        return logging.getLogger("tasks.stages").info


@_stage_task("prompts")
def prompts(*, inp: PromptsInput) -> ShardRef:
    """Select and tokenize the iteration's prompts; writes the `prompts` column group."""
    return run_stage(inp)


@_stage_task("rollout", retries=1)
def rollout(*, inp: RolloutInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Sample a group of responses per prompt (or one shard of them); writes the `rollout` column group."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("rollout_merge")
def rollout_merge(*, inp: RolloutMergeInput) -> ShardRef:
    """The rollout from its shards, as the single-worker rollout would have written it."""
    return run_stage(inp)


@_stage_task("signal_groups")
def signal_groups(*, attempt_rewards: list[ShardRef]) -> int:
    """Dynamic sampling: how many distinct groups with reward spread the attempts hold."""
    return count_signal_groups(attempt_rewards)


@_stage_task("dynamic_merge")
def dynamic_merge(*, inp: DynamicMergeInput) -> tuple[ShardRef, ShardRef, ShardRef]:
    """Dynamic sampling: the kept groups of all attempts as the iteration's prompts/rollout/rewards."""
    return run_stage(inp)


@_stage_task("actor_logprobs", retries=1)
def actor_logprobs(*, inp: ActorLogprobsInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Log-probs of the responses under the policy before the update (`old_logprobs`)."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("ref_logprobs", retries=1)
def ref_logprobs(*, inp: RefLogprobsInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Log-probs of the responses under the reference model (`ref_logprobs`)."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("teacher_logprobs", retries=1)
def teacher_logprobs(*, inp: TeacherLogprobsInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Log-probs of the responses under the teacher (`teacher_logprobs`; on-policy distillation)."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("rewards", retries=1)
def rewards(*, inp: RewardsInput) -> ShardRef:
    """Score every response of the rollout; writes the `rewards` column group."""
    return run_stage(inp)


@_stage_task("advantages")
def advantages(*, inp: AdvantagesInput) -> ShardRef:
    """Join the column groups on sample_id, shape rewards and estimate advantages."""
    return run_stage(inp)


@_stage_task("critic_values", retries=1)
def critic_values(*, inp: CriticValuesInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Critic values of every response token; writes the `critic_values` column group."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("critic_update")
def critic_update(*, inp: CriticUpdateInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Train the critic on the returns; commits metrics and the new critic checkpoint."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("ppo_update")
def ppo_update(*, inp: PPOUpdateInput, runner: RunnerConfig | None = None) -> ShardRef:
    """Update the policy; commits per-step metrics and the new checkpoint (the optimizer
    state, with ``inp.background_optimizer``, in a background thread: see
    ``rft_core.stages.optimizer_state``)."""
    return run_stage(inp, runner, log=_stage_log())


@_stage_task("eval_prompts")
def eval_prompts(*, inp: EvalPromptsInput) -> ShardRef:
    """Held-out prompts: a split of the training task disjoint from its data, or the rows of ``eval.path``."""
    return run_stage(inp)


@_stage_task("eval_generate", retries=1)
def eval_generate(*, inp: EvalGenerateInput) -> ShardRef:
    """One greedy response per held-out prompt; writes a `rollout` shard."""
    return run_stage(inp)


@_stage_task("eval_summary")
def eval_summary(*, inp: EvalSummaryInput) -> ShardRef:
    """Join prompts, responses and rewards into the `eval` shard (accuracy, mean reward)."""
    return run_stage(inp)


@_stage_task("prune_checkpoints")
def prune_checkpoints(*, run_root: str, iteration: int, checkpoint: CheckpointConfig,
                      max_staleness: int = 0) -> dict[str, list[str]]:
    """Checkpoint retention after ``iteration`` (``checkpoint.keep_last``, ``prune``,
    ``keep_weights_last``, ``keep_weights_every``, keeping what the rollouts of the next
    ``max_staleness`` iterations sample with; nothing when keep_last is None)."""
    return apply_retention(run_root, iteration, checkpoint, max_staleness=max_staleness)


@_stage_task("validate_data")
def validate_data(*, cfg: TrainConfig) -> str:
    """Every row of the run's data files (``data.path`` / ``data.sources``; not ``eval.path``, which
    training never reads) checked against what the run needs, before the first stage; remembered
    under the run root by the files' fingerprint, so a resume reads no row again. Raises
    ``DataValidationError`` listing the first bad rows (file, line or row, column, problem).
    With a teacher (on-policy distillation, ``teacher.path``) also its tokenizer against the
    policy's (``TeacherTokenizerError`` naming both paths), and the API key of every LLM judge
    (``SourceUnavailableError`` naming the source and the variable). Returns the one-line summary."""
    lines = [validate_run_data(cfg).summary(), check_judge_keys(cfg.reward)]
    if cfg.teacher.path is not None:
        lines.append(check_teacher_tokenizer(cfg.policy.path, cfg.teacher.path))
    return "; ".join(line for line in lines if line)


@_stage_task("start_workers")
def start_workers(*, cfg: TrainConfig) -> list[str]:
    """The resident workers of the run's first iteration, created together when the run starts
    (``start_run_workers``: Ray connected here, the workers' processes starting while the first
    stages run). Returns their roles ([] in stage mode)."""
    return start_run_workers(cfg)
