"""Checkpoint retention: bound a run's storage by pruning the checkpoints of old iterations.

Every iteration commits a full HF checkpoint plus the AdamW state (``optimizer.pt``, twice the
weights in float32; the policy's in the stage ``ppo_update-optimizer``): about 1.6 GB per
iteration on SmolLM2-135M, ~84 GB on a 7B model. With ``checkpoint.keep_last = N`` the flow
prunes, after each iteration ``i``, the ``ppo_update`` (and its optimizer stage) and
``critic_update`` checkpoints of iterations ``<= i - N``:

- ``prune: optimizer`` (default) removes the optimizer state only: old iterations keep their
  weights, so they can still be evaluated or used as a reference;
- ``prune: weights`` also removes the weight files (``*.safetensors``, ``*.bin``); the folder
  keeps its config and tokenizer, and the stage keeps its metrics parts.

Resuming never needs a pruned file: iteration ``i + 1`` starts from iteration ``i``, which is
kept whole until ``i + 1`` has committed (``N >= 1``). Loading a pruned checkpoint anyway (a
later iteration deleted by hand) raises ``CheckpointPrunedError`` instead of silently starting
a fresh optimizer. Manifests are never rewritten (``schemas.shards.prune_files``).
"""
from __future__ import annotations

import logging
from typing import Literal

from rft_core.training.checkpoint import OPTIMIZER_FILE, OPTIMIZER_FOLDER_SUFFIX
from schemas import ShardRef, prune_files, pruned_files, read_manifest, stage_uri
from schemas.shards import ShardNotCommittedError

log = logging.getLogger("rft_core.stages")

WEIGHT_SUFFIXES = (".safetensors", ".bin")
# stage folder -> checkpoint sub-folder ("": the folder itself; ppo_update-optimizer holds the
# policy's AdamW state, rft_core.stages.optimizer_state)
CHECKPOINT_STAGES = {"ppo_update": "policy", f"ppo_update{OPTIMIZER_FOLDER_SUFFIX}": "", "critic_update": "critic"}


class CheckpointPrunedError(RuntimeError):
    """A checkpoint file needed now was removed by checkpoint retention (``checkpoint.keep_last``)."""


def _is_optimizer(name: str) -> bool:
    return name == OPTIMIZER_FILE


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".safetensors.index.json") or name.endswith(".bin.index.json")


def prunable_files(files: list[str], subdir: str, prune: Literal["optimizer", "weights"]) -> list[str]:
    """The paths among ``files`` (relative to a stage folder) that ``prune`` removes from the
    checkpoint folder ``subdir``: its optimizer state, and with ``weights`` its weight files.

    Raises:
        ValueError: an unknown ``prune`` mode.
    """
    if prune not in ("optimizer", "weights"):
        raise ValueError(f"prune must be 'optimizer' or 'weights', got {prune!r}")
    out = []
    for rel in files:
        folder, _, name = rel.rpartition("/")
        if folder != subdir:
            continue
        if _is_optimizer(name) or (prune == "weights" and _is_weights(name)):
            out.append(rel)
    return sorted(out)


def prune_checkpoints(run_root: str, iteration: int, *, keep_last: int,
                      prune: Literal["optimizer", "weights"] = "optimizer") -> dict[str, list[str]]:
    """After ``iteration`` has committed, prune the checkpoints of iterations ``1 .. iteration -
    keep_last`` (idempotent: already-pruned files are skipped; uncommitted stages are left alone).

    Returns:
        {stage URI: paths deleted now}, only for stages where something was deleted.
    Raises:
        ValueError: ``keep_last < 1`` (the checkpoint the next iteration starts from would go).
    """
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
    done: dict[str, list[str]] = {}
    for old in range(1, iteration - keep_last + 1):
        for stage, subdir in CHECKPOINT_STAGES.items():
            uri = stage_uri(run_root, old, stage)
            try:
                manifest, _ = read_manifest(uri)
            except ShardNotCommittedError:
                continue
            paths = prunable_files([e.path for e in manifest.files], subdir, prune)
            removed = prune_files(uri, paths, reason=f"checkpoint.keep_last={keep_last} (prune={prune}) after iteration {iteration}")
            if removed:
                done[uri] = removed
                log.info("pruned %d checkpoint file(s) of %s (keep_last=%d)", len(removed), uri, keep_last)
    return done


def require_unpruned(policy: ShardRef, subdir: str, *, optimizer: bool) -> None:
    """Raise when a checkpoint's weights (or, with ``optimizer``, its optimizer state) were pruned.

    Raises:
        CheckpointPrunedError: names the stage, the files and why they were pruned.
    """
    pruned = pruned_files(policy.uri)
    gone = [rel for rel in prunable_files(list(pruned), subdir, "weights")
            if optimizer or not _is_optimizer(rel.rpartition("/")[2])]
    if gone:
        raise CheckpointPrunedError(
            f"{policy.uri}: checkpoint file(s) {', '.join(sorted(gone))} were pruned ({pruned[gone[0]]}); "
            "this checkpoint can no longer be trained from. Resume from the last iteration, or raise "
            "checkpoint.keep_last in new runs")
