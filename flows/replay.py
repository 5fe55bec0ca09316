"""Offline replay: rerun the downstream stages (advantages, update) of a saved run with other
settings, into a new run folder, without generating anything."""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

import tasks
from flows.iteration import train_on
from rft_core.api import (
    check_run_root,
    format_metrics_line,
    freeze_grown_heap,
    iteration_metrics,
    next_state,
    policy_checkpoint_folder,
    release_run,
    replay_sources,
    wait_for_optimizer_writes,
    write_metrics,
    write_replay_record,
)
from rft_core.config import TrainConfig, TrainState
from schemas import PolicyRef, ShardRef, stage_uri


class ReplayResult(BaseModel):
    """Where the replayed run is."""

    model_config = ConfigDict(frozen=True)
    run_root: str
    source_run_root: str
    final_policy: ShardRef
    final_policy_folder: str = Field(description="the HF folder holding the final weights (``policy_checkpoint_folder``)")
    metrics: list[dict[str, Any]]


@flow(name="rft-replay", flow_run_name="replay-{cfg.name}")
def replay(source_run_root: str, cfg: TrainConfig) -> ReplayResult:
    """For iterations 1..cfg.iterations, read the source run's prompts, rollout, log-prob and
    reward shards and run advantages + ppo_update with ``cfg`` under ``cfg.run_root``.

    The update of iteration i starts from the replay's own checkpoint of iteration i-1 (the
    initial policy for i = 1); old log-probs are the source's, so for i > 1 the ratio corrects
    for the policy difference like any off-policy PPO step. The stages run where
    ``cfg.runners`` says (``flows.iteration.train_on``, as in training); the critic is not
    trained (its values, when the estimator needs them, are the source's).

    Raises:
        ShardNotCommittedError / ValueError: the source lacks a needed shard (e.g. ref_logprobs
            for a KL coefficient > 0), named in the message.
    """
    logger = get_run_logger()
    check_run_root(cfg.run_root)  # bad storage fails here, naming the URI, before anything is written
    write_replay_record(cfg.run_root, source_run_root, cfg)
    policy: PolicyRef = cfg.policy.path
    state: TrainState = cfg.initial_state
    tags = tasks.resolve_concurrency_tags(cfg.orchestration.concurrency_tags)
    rows = []
    try:
        for i in range(1, cfg.iterations + 1):
            src = replay_sources(source_run_root, i, cfg)
            kl = cfg.kl.model_copy(update={"kl_coef": state.kl_coef})

            def out(stage: str, i: int = i) -> str:
                return stage_uri(cfg.run_root, i, stage)

            adv, policy, _ = train_on(cfg, src, policy=policy, critic=None, state=state, kl=kl, out=out, tags=tags,
                                      background_optimizer=False, policy_version=i - 1)  # its seeds: iteration i's
            state = next_state(adv)
            m = iteration_metrics(i, {**src, "advantages": adv, "ppo_update": policy})
            rows.append(m)
            write_metrics(cfg.run_root, rows)
            logger.info("replay " + format_metrics_line(m))
            freeze_grown_heap()  # as the training flow (rft_core/heap.py); release_run thaws it
        wait_for_optimizer_writes()  # the last update's weights, when written in the background (checkpoint.async_weights)
    finally:
        release_run(None)  # the models kept between stages
    create_table_artifact(key="replay-metrics", table=rows, description=f"Replay of {source_run_root} into {cfg.run_root}")
    assert isinstance(policy, ShardRef)
    return ReplayResult(run_root=cfg.run_root, source_run_root=source_run_root, final_policy=policy,
                        final_policy_folder=policy_checkpoint_folder(policy), metrics=rows)
