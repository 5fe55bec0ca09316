"""Deployment entry point: a preset path plus dotted overrides, as prefect.yaml passes them."""
from __future__ import annotations

from typing import Any

from prefect import flow

from flows.train import TrainResult, train
from rft_core.config import load_config


@flow(name="rft-train-preset")
def train_from_preset(preset: str = "configs/grpo_demo.yaml", overrides: dict[str, Any] | None = None) -> TrainResult:
    """Load ``preset``, apply ``overrides`` (``{"rollout.temperature": 0.7}``) and train.

    A ``{timestamp}`` in run_root is filled with the flow run's start time.
    """
    cfg = load_config(preset, overrides or {}).with_resolved_run_root()
    return train(cfg)
