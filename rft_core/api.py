"""The public surface of ``rft_core`` for the orchestration layers.

``flows/`` and ``tasks/`` import from ``rft_core`` only this module and ``rft_core.config``
(``tests/test_layers.py`` enforces it): the stage input models (the contract of every stage),
``run_stage`` (how a task runs a stage program, in-process or as a subprocess), and the few
helpers a flow needs around the stages (metrics lines, UI artifacts, checkpoint naming, replay
sources). Everything else in ``rft_core`` is internal to it and may change shape freely.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rft_core.agents.view import sample_text
from rft_core.config import RunnerConfig
from rft_core.data.check import check_config_data
from rft_core.data.mixture import dataset_fingerprint, heldout_fingerprint
from rft_core.data.prompts import DatasetError
from rft_core.data.validate import DataValidationError, validate_run_data
from rft_core.heap import freeze_grown_heap, thaw_heap
from rft_core.inspect import export_table, run_status, samples_view
from rft_core.metrics import format_metrics_line, iteration_metrics, write_metrics
from rft_core.observe import CurveSchedule, TensorBoardLog, WandbLogger, curve_outputs, samples_markdown
from rft_core.replay import replay_sources, write_replay_record
from rft_core.rewards.base import RewardError
from rft_core.rewards.judge import check_judge_keys
from rft_core.stages.advantages import next_state
from rft_core.stages.contracts import *  # noqa: F403 - every stage input model is public
from rft_core.stages.contracts import StageInput
from rft_core.stages.dynamic import count_signal_groups
from rft_core.stages.evaluate import checkpoint_label, default_eval_root, eval_markdown, eval_report_lines, resolve_checkpoint
from rft_core.stages.lineage import weights_stage
from rft_core.stages.memo import clear as _release_kept_models
from rft_core.stages.optimizer_state import release_host_staging
from rft_core.stages.retention import apply_retention, prune_checkpoints
from rft_core.stages.teacher import check_teacher_tokenizer
from rft_core.stages.writer import wait_for_optimizer_writes
from rft_core.storage import RunRootError, check_run_root, repair as repair_stage, verify_run
from rft_core.stages.runner import run_stage as _run_stage
from rft_core.workers.pool import run_counters, run_resident, start_run_workers, stop_workers, sync_rollout_ahead
from rft_core.models.loading import load_tokenizer
from schemas import PolicyRef, ShardError, ShardRef, local_path, stage_uri

from rft_core.stages import contracts as _contracts


def run_stage(inp: StageInput, runner: RunnerConfig | None = None, *, log: Callable[[str], None] | None = None) -> Any:
    """Run the program of ``inp`` where ``runner`` says (``rft_core.stages.runner.run_stage``):
    in this process, as a subprocess, or in its resident worker, for which this hands the
    runner the workers' launcher (``rft_core.workers.pool.run_resident``).

    Raises:
        StageProcessError: a stage subprocess failed; whatever the program raises in-process.
    """
    return _run_stage(inp, runner, log=log, resident=run_resident)

__all__ = [
    *_contracts.__all__, "CurveSchedule", "TensorBoardLog", "WandbLogger", "checkpoint_label",
    "check_config_data", "dataset_fingerprint", "heldout_fingerprint", "DatasetError", "DataValidationError",
    "validate_run_data",
    "count_signal_groups", "curve_outputs", "default_eval_root", "eval_markdown", "eval_report_lines", "export_table",
    "format_metrics_line", "freeze_grown_heap", "iteration_metrics", "next_state", "prune_checkpoints", "replay_sources",
    "release_run", "resolve_checkpoint", "run_counters", "run_stage", "run_status", "sample_transcript", "start_run_workers", "stop_workers", "samples_markdown", "sync_rollout_ahead", "samples_view",
    "wait_for_optimizer_writes", "policy_checkpoint_folder",
    "write_metrics", "write_replay_record",
    "RunRootError", "apply_retention", "check_run_root", "repair_stage", "verify_run", "check_teacher_tokenizer",
    "RewardError", "check_judge_keys",
]


def release_run(pool: str | None) -> None:
    """End what a run holds in memory, on success, an error or Ctrl-C alike: this process's
    background checkpoint writes (``wait_for_optimizer_writes``: a run that failed after an
    update returns once its writes have landed, so none outlives it into the next flow of the
    same process, or writes into a folder its caller has already removed), its resident workers
    (``pool``, None: none; ``stop_workers``, after their pending writes), the models stage mode
    kept between stages (``rft_core.stages.memo``), the page-locked copy of its last optimizer
    state (``release_host_staging``) and the frozen heap (``thaw_heap``: what the run froze is
    in the collector's reach again, as before the run), so a process that runs several flows
    holds nothing of an earlier one.

    Raises:
        OptimizerStateError: a pending write of this process or of a worker failed (see
            ``stop_workers``); the workers are stopped and the kept models released anyway.
    """
    try:
        try:
            wait_for_optimizer_writes()
        finally:
            if pool:
                stop_workers(pool)
    finally:
        thaw_heap()  # the next collections reach what the run froze
        _release_kept_models()
        release_host_staging()


def sample_transcript(run_root: str, iteration: int, sample_id: str) -> str:
    """``rft inspect RUN -i N --sample ID``: ``sample_text`` of the sample, each turn decoded with
    the tokenizer saved with iteration ``iteration``'s policy checkpoint (the folder
    ``weights_stage`` names: the update's own ``policy/``, or ``ppo_update-policy/policy`` for
    weights written in the background) when that is a local folder; else the transcript whole
    (no committed update, weights in a resident worker's memory, a remote run root).

    Raises:
        ShardError: the iteration's rollout is not committed or unreadable.
        KeyError: no sample ``sample_id`` in the rollout (the message lists a few).
    """
    tokenizer = None
    try:
        held = weights_stage(ShardRef.from_manifest(stage_uri(run_root, iteration, "ppo_update")))
    except ShardError:
        held = None
    local = local_path(f"{held.uri}/policy") if held is not None else None
    if local is not None and Path(local, "tokenizer_config.json").exists():
        tokenizer = load_tokenizer(local)
    return sample_text(run_root, iteration, sample_id, tokenizer=tokenizer)


def policy_checkpoint_folder(ref: PolicyRef) -> str:
    """The URI of the HF folder holding the committed policy ``ref``'s weights:
    ``{ppo_update}/policy``, or ``{ppo_update}-policy/policy`` for a checkpoint iteration
    written in the background (``weights_stage``); a model path as is; ``"(in memory)"`` for an
    update whose weights stayed in memory (``checkpoint.every`` > 1: the resident workers, or
    stage mode's kept trainer)."""
    if isinstance(ref, str):
        return ref
    held = weights_stage(ref)
    return f"{held.uri}/policy" if held is not None else f"{ref.uri} (in memory)"

