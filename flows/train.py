"""Training: N iterations in order, each a subflow starting from the previous checkpoint."""
from __future__ import annotations

import contextvars
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from pydantic import BaseModel, ConfigDict, Field

import tasks
from flows.iteration import rl_iteration
from rft_core.api import (
    CurveSchedule,
    TensorBoardLog,
    WandbLogger,
    check_run_root,
    curve_outputs,
    format_metrics_line,
    freeze_grown_heap,
    policy_checkpoint_folder,
    run_counters,
    release_run,
    wait_for_optimizer_writes,
    write_metrics,
)
from rft_core.config import TrainConfig
from schemas import PolicyRef, ShardRef


def without_heartbeats():
    """The settings an iteration subflow runs under: no flow-run heartbeats (the training flow,
    in the same process, sends them at ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, default 180 s).

    Prefect 3.9.1 (``prefect/flow_engine.py``, ``_send_heartbeats``) sends a flow run's heartbeats
    from a thread that sleeps in 1 s steps, and a sync flow run's exit joins that thread, so every
    iteration ended 0-1 s late, on every step's critical path (``benchmarks/prefect_overhead.py``).
    A heartbeat says the process running the flow run is alive; the training flow's says it for
    its iterations too. A zombie-flow automation (Prefect's "detect zombie flows", armed for a flow
    run by its first heartbeat) marks the training flow run Crashed when its process dies; the
    iteration it was running stays Running in the UI (a rerun resumes it from storage).

    Entered once around the iterations: the training flow's heartbeat thread has read its
    frequency when it started, and a settings copy (pydantic-settings re-validating every
    section) takes ~0.2 s on 2 cores."""
    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


class TrainResult(BaseModel):
    """Where everything of a run is."""

    model_config = ConfigDict(frozen=True)
    run_root: str
    metrics_uri: str
    final_policy: ShardRef
    final_policy_folder: str = Field(description="the HF folder holding the final weights: ``{final_policy}/policy``, "
                                     "or ``{final_policy}-policy/policy`` when they were written in the background "
                                     "(checkpoint.async_weights; ``rft_core.api.policy_checkpoint_folder``)")
    final_critic: ShardRef | None = None
    metrics: list[dict[str, Any]]


class _Recorder:
    """Each iteration's metrics where a user looks (``record``), written on a thread of their own,
    in order, while the next iteration runs; a failed write fails the run at the next
    iteration's ``submit`` (or at ``result``). Opens the run's W&B run (``observe.wandb``; a
    warning when wandb is not installed) and keeps its ``CurveSchedule``."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.schedule = cfg, CurveSchedule(cfg.observe.curve_every_s)
        self.tensorboard = TensorBoardLog(cfg.run_root)
        self.recorded: Future[tuple[str, str | None]] | None = None
        try:
            self.wandb = WandbLogger.start(cfg.observe.wandb, run_root=cfg.run_root, name=cfg.name,
                                           config=cfg.model_dump(mode="json"))
        except ImportError as exc:
            get_run_logger().warning("%s", exc)
            self.wandb = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rft-record")

    def submit(self, rows: list[dict[str, Any]]) -> None:
        """Record ``rows`` (every iteration so far, the last one new) after the previous record."""
        if self.recorded is not None:
            self.recorded.result()
        self.recorded = self.pool.submit(contextvars.copy_context().run, self.record, list(rows))

    def record(self, rows: list[dict[str, Any]]) -> tuple[str, str | None]:
        """The metrics of every iteration so far (``rows``; the last one new) where a user looks:
        metrics.jsonl, TensorBoard, W&B (the new row), and when the ``CurveSchedule`` says it is due
        the reward/KL/length curve, drawn once for metrics.png and the UI's ``metrics-curve``
        artifact (a new version each time). Returns (metrics.jsonl's URI, metrics.png's path or None)."""
        cfg = self.cfg
        metrics_uri = write_metrics(cfg.run_root, rows)
        self.tensorboard.write(rows)
        if self.wandb:
            self.wandb.log(rows[-1])
        if not self.schedule.due(rows[-1]["iteration"], cfg.iterations):
            return metrics_uri, None
        curve, markdown = curve_outputs(cfg.run_root, rows)
        create_markdown_artifact(key="metrics-curve", markdown=markdown,
                                 description=f"Metrics of {cfg.run_root} after iteration {rows[-1]['iteration']}")
        return metrics_uri, curve

    def close(self) -> None:
        """Wait for the last record and finish the W&B run (also when the run failed)."""
        self.pool.shutdown(wait=True)
        self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()

    def result(self) -> tuple[str, str | None]:
        """The last record's (metrics.jsonl's URI, metrics.png's path or None); ("", None) before any."""
        return self.recorded.result() if self.recorded is not None else ("", None)


def _prune(cfg: TrainConfig, iteration: int) -> None:
    """Checkpoint retention after ``iteration`` (a task run only when it is on)."""
    if cfg.checkpoint.keep_last is not None and iteration:
        tags = tasks.resolve_concurrency_tags(cfg.orchestration.concurrency_tags)  # resolved by train: as it is
        tasks.tagged(tasks.prune_checkpoints, tags)(
            run_root=cfg.run_root, iteration=iteration, checkpoint=cfg.checkpoint,
            max_staleness=cfg.rollout.max_staleness)


@flow(name="rft-train", flow_run_name="{cfg.name}")
def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) ``cfg.iterations`` iterations under ``cfg.run_root``.

    Rerunning with the same config and run root reuses every committed stage, so a crashed or
    cancelled run resumes where it stopped.

    Raises:
        RunRootError: before any stage starts, when the run root cannot be written (a missing
            bucket, refused credentials, an unreachable endpoint, a read-only bucket or folder).
        DataValidationError: before any stage, when data rows cannot be used (file, line, column).
    """
    logger = get_run_logger()
    logger.info("%s; %s; %s", check_run_root(cfg.run_root), tasks.validate_data(cfg=cfg), cfg.workers_choice)
    # resolved once for the run (auto: one question to the server); the iterations inherit it
    tags = tasks.resolve_concurrency_tags(cfg.orchestration.concurrency_tags)
    cfg = cfg.model_copy(update={"orchestration": cfg.orchestration.model_copy(update={"concurrency_tags": tags})})
    policy: PolicyRef = cfg.policy.path
    rows: list[dict[str, Any]] = []
    state = cfg.initial_state
    critic: PolicyRef | None = None
    counters0 = run_counters(None)  # this process's model loads etc. before the run (counted from here)
    recorder = _Recorder(cfg)
    try:
        if cfg.first_resident_stages:  # Ray, then the first iteration's workers' processes, starting during its prompts
            tasks.start_workers(cfg=cfg)
        versions: dict[int, PolicyRef] = {0: policy}  # version v: the policy the update of iteration v made
        ahead_stages: dict[str, ShardRef] = {}  # the next iteration's stages committed during the last one
        with without_heartbeats():
            for i in range(1, cfg.iterations + 1):
                ahead = versions[cfg.rollout_policy_version(i + 1)] if cfg.rollout.max_staleness else None  # trained
                result = rl_iteration(cfg, i, policy, state, critic, versions[cfg.rollout_policy_version(i)], ahead,
                                      ahead_stages)
                policy, state, critic, ahead_stages = result.policy, result.next_state, result.critic, result.ahead_stages
                versions[i] = policy
                freeze_grown_heap()  # once warm, Python's collector stops walking every import (rft_core/heap.py)
                counters = run_counters(cfg.resident_pool)
                result.metrics.update({f"run/{k}": v - counters0.get(k, 0) for k, v in counters.items()})
                _prune(cfg, i)
                rows.append(result.metrics)
                recorder.submit(rows)
                logger.info(format_metrics_line(result.metrics))  # shown in the terminal and the Prefect UI
        # the last iteration's optimizer state may still be being written (checkpoint.async_optimizer)
        wait_for_optimizer_writes()
    finally:
        try:
            recorder.close()  # the last iteration's files, also when the run failed
        finally:  # the workers (after their pending writes), stage mode's kept models, the frozen heap
            release_run(cfg.resident_pool)
    _prune(cfg, cfg.iterations)  # the last pass again, now that every write landed (it ran while they were pending)
    metrics_uri, curve = recorder.result()
    create_table_artifact(key="training-metrics", table=rows, description=f"Metrics of {cfg.run_root}")
    if curve:
        logger.info("metrics curve: %s; TensorBoard: tensorboard --logdir %s/tensorboard", curve, cfg.run_root)
    return TrainResult(run_root=cfg.run_root, metrics_uri=metrics_uri, final_policy=policy,
                       final_policy_folder=policy_checkpoint_folder(policy),
                       final_critic=critic if isinstance(critic, ShardRef) else None, metrics=rows)
