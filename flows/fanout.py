"""Rollout fan-out: the rollout stage split into shards that run as parallel Prefect tasks on a
Ray cluster (prefect-ray's ``RayTaskRunner``), then merged into the ordinary rollout shard.

Each shard generates a share of the engine's batches with the seeds of a single-worker run, so
the merged rollout equals the single-worker rollout row for row (``rft_core.stages.rollout``).
Configured with ``runners.rollout.shards`` and the ``ray`` section (``ray.address``: None starts a
local cluster, ``auto`` or ``ray://host:10001`` joins one; ``ray.options.rollout_shard``: the Ray
resources of each shard task).
"""
from __future__ import annotations

import contextlib

from prefect import flow

import tasks
from rft_core.api import RolloutInput, RolloutMergeInput
from rft_core.config import ROLLOUT_SHARD, RayConfig, RunnerConfig
from schemas import ShardRef


def shard_uri(out: str, index: int, count: int) -> str:
    """Folder of rollout shard ``index`` of ``count`` next to the rollout's own folder."""
    return f"{out.rstrip('/')}-shard{index:02d}of{count:02d}"


def _remote_options(options: dict):
    """prefect-ray's ``remote_options`` context (Ray resources of the tasks submitted inside it)."""
    if not options:
        return contextlib.nullcontext()
    from prefect_ray.context import remote_options

    return remote_options(**options)


@flow(name="rollout-fanout", flow_run_name="rollout-fanout-iter-{inp.iteration:06d}")
def rollout_fanout(inp: RolloutInput, runner: RunnerConfig, ray: RayConfig, tags: bool = False) -> ShardRef:
    """Submit ``runner.shards`` shards of the rollout ``inp`` together (they run on the flow's
    task runner, each with the Ray options ``ray.options.rollout_shard``), then merge them into
    ``inp.out``."""
    n = runner.shards
    inner = runner.model_copy(update={"shards": 1})  # how each shard's program runs inside its worker
    with _remote_options(ray.options.get(ROLLOUT_SHARD, {})):  # e.g. one GPU per shard task
        futures = [tasks.tagged(tasks.rollout, tags).submit(
            inp=inp.model_copy(update={"shard": (i, n), "out": shard_uri(inp.out, i, n)}), runner=inner) for i in range(n)]
    parts = [f.result() for f in futures]
    return tasks.tagged(tasks.rollout_merge, tags)(inp=RolloutMergeInput(rollout=inp, parts=parts, out=inp.out))


def sharded_rollout(inp: RolloutInput, runner: RunnerConfig, ray: RayConfig, tags: bool = False) -> ShardRef:
    """``rollout_fanout`` as a subflow on a ``RayTaskRunner`` for ``ray.address`` (with
    ``ray.init_kwargs``).

    Raises:
        ImportError: prefect-ray is not installed (``pip install -e '.[ray]'``).
    """
    from prefect_ray import RayTaskRunner

    task_runner = RayTaskRunner(address=ray.address, init_kwargs=dict(ray.init_kwargs))
    return rollout_fanout.with_options(task_runner=task_runner)(inp=inp, runner=runner, ray=ray, tags=tags)


def rollout(*, inp: RolloutInput, runner: RunnerConfig, ray: RayConfig, tags: bool) -> ShardRef:
    """The rollout stage as the iteration flow runs it: one task, or shards on the Ray cluster of
    ``ray``. ``tags``: whether stage tasks carry concurrency tags this run."""
    if runner.shards > 1:
        return sharded_rollout(inp, runner, ray, tags)
    return tasks.tagged(tasks.rollout, tags)(inp=inp, runner=runner)
