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
    """Where metrics go besides metrics.jsonl, TensorBoard and the Prefect artifacts, and how often
    the metrics curve (metrics.png and the UI's ``metrics-curve`` artifact) is redrawn."""

    wandb: WandbConfig = WandbConfig()
    curve_every_s: float = Field(
        60.0, ge=0,
        description="seconds between two drawings of the metrics curve (``rft_core.observe.CurveSchedule``): an "
                    "iteration redraws it when at least this long has passed since the last drawing (or the run's "
                    "start), and the run's last iteration always does; 0 redraws it after every iteration. Drawing "
                    "takes 0.3-1 s of Python (matplotlib) on the thread that records metrics, which competes for the "
                    "interpreter with the next iteration's stages")


class CheckpointConfig(_Frozen):
    """How checkpoints are written and kept. Never part of a config hash.

    Retention (``rft_core.stages.retention``), applied after each iteration ``i`` commits:
    checkpoints of iterations ``<= i - keep_last`` lose their optimizer state; with ``prune:
    weights`` (the default) they also lose their weights, except the last ``keep_weights_last``
    iterations and every ``keep_weights_every``-th (10, 20, ...). Shards (Parquet parts) and
    manifests are always kept, so metrics, inspect, DuckDB and replay see every iteration.
    ``every`` (K): iteration ``i`` writes the policy's weights and AdamW state (a checkpoint)
    when ``i % K == 0`` or ``i`` is the run's last iteration (``is_checkpoint``); the other
    iterations commit their experience and update shards only. K > 1 needs a process that holds
    the policy between checkpoints: the resident workers (``orchestration.workers: resident``),
    or stage mode keeping its models (``TrainConfig.kept_policy_blockers`` says where it cannot);
    after a crash the policy is rebuilt from the last checkpoint by re-applying the committed
    updates after it (``rft_core.stages.recovery``). The defaults bound a run's disk: on SmolLM2-135M about 1.1 GB of optimizer state plus
    3 x 0.54 GB of weights, plus 54 MB per iteration for every 10th iteration's weights
    (``docs/reliability.md``). ``keep_last: null`` keeps everything.

    ``async_optimizer``: the policy's AdamW state (twice the weights) is written by a background
    thread while the next iteration's stages run (``rft_core.stages.optimizer_state``); a write
    lost to a crash is recomputed on resume. ``async_weights`` (default: under resident workers, and in stage
    mode when it keeps its models in memory; false: never): a checkpoint iteration's weights too,
    after its AdamW state; a write lost to a crash leaves the previous checkpoint the one a resume
    rebuilds from (exactly, by re-applying the updates after it; in stage mode by running the
    update again from its committed inputs, ``rft_core.stages.update``).
    """

    every: int = Field(1, ge=1, description="write the policy's weights and optimizer state every K iterations and at "
                       "the end of the run (K > 1: between checkpoints the policy lives in memory, in the resident "
                       "workers or in stage mode's kept trainer (orchestration.keep_models), and a rerun rebuilds it "
                       "from the last checkpoint)")
    async_optimizer: bool = Field(True, description="write the policy's optimizer state in the background")
    async_weights: bool = Field(
        True, description="a checkpoint iteration's policy weights (with its AdamW state) are written in the background "
        "while the next iteration runs, under workers=resident and in stage mode when it keeps its models in memory "
        "(orchestration.keep_models, auto with the hf engine); its ppo_update commits first with their digest, the "
        "weights commit as iter=N/ppo_update-policy. false: the update writes them itself, as iter=N/ppo_update/policy")
    keep_last: int | None = Field(1, ge=1, description="iterations whose checkpoints stay whole, optimizer state "
                                  "included (None: keep every checkpoint whole)")
    prune: Literal["optimizer", "weights"] = Field(
        "weights", description="what checkpoints older than keep_last lose: the optimizer state only, or also the "
                               "weights (except keep_weights_last / keep_weights_every)")
    keep_weights_last: int = Field(3, ge=1, description="with prune=weights: the last N iterations keep their weights")
    keep_weights_every: int | None = Field(10, ge=1, description="with prune=weights: every N-th iteration (N, 2N, ...) "
                                           "keeps its weights too (None: none)")

    def is_checkpoint(self, iteration: int, iterations: int) -> bool:
        """Whether ``iteration`` of a run of ``iterations`` writes the policy's weights and
        optimizer state: every ``every``-th iteration and the last one."""
        return iteration % self.every == 0 or iteration >= iterations
