"""Deployment entry points: a preset path plus dotted overrides, as prefect.yaml passes them.

``prefect.yaml`` points its deployments here (training, scheduled training, replay); the
evaluation deployment points at ``flows/eval.py:eval_from_preset``. Every parameter is plain
JSON so the UI's "Run" form and ``prefect deployment run -p key=value`` can fill it.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from flows.replay import ReplayResult, replay
from flows.train import TrainResult, train
from rft_core.config import load_config


@flow(name="rft-train-preset")
def train_from_preset(preset: str = "configs/grpo_demo.yaml", overrides: dict[str, Any] | None = None) -> TrainResult:
    """Load ``preset``, apply ``overrides`` (``{"rollout.temperature": 0.7}``) and train.

    A ``{timestamp}`` in run_root is filled with the flow run's start time, so a scheduled
    deployment writes each run to a new folder; pass ``{"run_root": "runs/x"}`` to resume one.

    Raises:
        ConfigError: missing preset, unknown key or bad value (the message names it).
    """
    cfg = load_config(preset, overrides or {}).with_resolved_run_root()
    return train(cfg)


@flow(name="rft-replay-preset")
def replay_from_preset(source_run_root: str, preset: str = "configs/grpo_demo.yaml",
                       overrides: dict[str, Any] | None = None,
                       run_root: str = "runs/replay-{name}-{timestamp}") -> ReplayResult:
    """Replay the saved shards of ``source_run_root`` (advantages + update only, nothing is
    generated) with the settings of ``preset`` + ``overrides`` into ``run_root``.

    ``run_root`` may hold ``{name}`` and ``{timestamp}``; a ``run_root`` key in ``overrides``
    is ignored in favour of the parameter.

    Raises:
        ConfigError: missing preset, unknown key or bad value.
        ShardNotCommittedError / ValueError: the source run lacks a shard the settings need.
    """
    cfg = load_config(preset, {**(overrides or {}), "run_root": run_root}).with_resolved_run_root()
    return replay(source_run_root, cfg)
