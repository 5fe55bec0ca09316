"""How a run is observed and how its checkpoints are written and kept. Never part of a config
hash."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rft_core.config._base import _Frozen


class WandbConfig(_Frozen):
    """Optional Weights & Biases logging of the per-iteration metrics (needs ``pip install wandb``)."""

    enabled: bool = False
    project: str = "prefect-rft"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = Field(None, description="None: wandb's own default (WANDB_MODE)")
    tags: list[str] = Field(default_factory=list)


class ObserveConfig(_Frozen):
    """Where metrics go besides metrics.jsonl, TensorBoard and the Prefect artifacts."""

    wandb: WandbConfig = WandbConfig()


class CheckpointConfig(_Frozen):
    """How checkpoints are written and kept. Never part of a config hash.

    Retention (``rft_core.stages.retention``): after each iteration, prune the checkpoints of
    iterations older than the last ``keep_last``. ``async_optimizer``: the policy's AdamW state
    (twice the weights) is written by a background thread while the next iteration's stages
    run (``rft_core.stages.optimizer_state``); a write lost to a crash is recomputed on resume.
    """

    async_optimizer: bool = Field(True, description="write the policy's optimizer state in the background")
    keep_last: int | None = Field(None, ge=1, description="iterations whose checkpoints stay whole (None: keep all)")
    prune: Literal["optimizer", "weights"] = Field(
        "optimizer", description="what older checkpoints lose: the optimizer state only, or also the weights")
