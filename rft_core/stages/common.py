"""Shared plumbing of the stage programs: reuse-or-compute, timing, policy references."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from dataclasses import asdict
from typing import Callable, Mapping, Union

import fsspec
import pyarrow as pa

from rft_core.models.loading import cache_dir
from rft_core.stages.retention import require_unpruned
from rft_core.training.update import OPTIMIZER_FILE, save_checkpoint
from schemas import ShardRef, StageSchema, commit_files, committed_ref, local_path, prepare_stage_dir, write_parts
from schemas.shards import release_stage_lock

log = logging.getLogger("rft_core.stages")

# A policy is either a model path (the initial model: alias, folder or hub id) or the ShardRef
# of a committed ppo_update stage, whose ``policy/`` sub-folder is an HF checkpoint.
PolicyRef = Union[str, ShardRef]
POLICY_SUBDIR = "policy"
CRITIC_SUBDIR = "critic"


def reuse_or_compute(stage: str, uri: str, chash: str, compute: Callable[[], ShardRef]) -> ShardRef:
    """Return the committed ShardRef at ``uri`` if its config hash is ``chash``, else compute.

    Raises:
        StaleShardError: ``uri`` was committed with another config hash (never overwritten).
    """
    ref = committed_ref(uri, stage=stage, config_hash=chash)
    if ref is not None:
        log.info("%s: reusing committed shard %s (config %s)", stage, uri, chash)
        return ref
    return compute()


class Timer:
    """Context manager measuring wall seconds into ``.seconds``."""

    def __enter__(self) -> "Timer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0


def policy_model_path(policy: PolicyRef, subdir: str = POLICY_SUBDIR) -> str:
    """A path ``from_pretrained`` can load for ``policy`` (or a critic, with ``subdir="critic"``).

    A checkpoint on a non-local filesystem is downloaded once into the cache, keyed by its
    manifest checksum (atomic rename, so a partial download is never used).

    Raises:
        CheckpointPrunedError: the checkpoint's weights were pruned (``checkpoint.keep_last``).
    """
    if isinstance(policy, str):
        return policy
    require_unpruned(policy, subdir, optimizer=False)
    return _checkpoint_folder(policy, subdir)


# a downloaded checkpoint folder is complete once one of these is there (full model, LoRA
# adapter, optimizer stage); the download is renamed into place atomically
_COMPLETE_MARKERS = ("config.json", "adapter_config.json", OPTIMIZER_FILE)


def _checkpoint_folder(policy: ShardRef, subdir: str) -> str:
    """Local folder of ``{policy.uri}/{subdir}`` (``subdir=""``: the stage folder itself): the
    folder itself, or a cached download keyed by the manifest checksum."""
    uri = f"{policy.uri.rstrip('/')}/{subdir}" if subdir else policy.uri
    local = local_path(uri)
    if local is not None:
        return local
    target = cache_dir() / "checkpoints" / f"{policy.manifest_sha256}-{subdir or policy.stage}"
    if not any((target / name).exists() for name in _COMPLETE_MARKERS):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=target.parent))
        fs, path = fsspec.core.url_to_fs(uri)
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
        if target.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    return str(target)


def policy_checkpoint_dir(policy: PolicyRef, subdir: str = POLICY_SUBDIR) -> str | None:
    """Local folder of a checkpointed policy (for its optimizer state), None for an initial model.

    Raises:
        CheckpointPrunedError: the checkpoint's optimizer state or weights were pruned.
    """
    if isinstance(policy, str):
        return None
    require_unpruned(policy, subdir, optimizer=True)  # covers the weights too: one check
    return _checkpoint_folder(policy, subdir)


def commit_checkpoint(out: str, *, subdir: str, model, tokenizer, optimizer, steps: list, schema: StageSchema,
                      config_hash: str, inputs: Mapping[str, ShardRef], summary: dict) -> ShardRef:
    """Commit a training stage: per-step metric rows (dataclasses, one per optimizer step) as
    Parquet parts plus an HF checkpoint (with optimizer and RNG state) under ``{out}/{subdir}``,
    all under one manifest written last. Works on any fsspec URI (remote: saved to a local temp
    folder, then uploaded). ``summary`` gains ``checkpoint_seconds``."""
    token = prepare_stage_dir(out)
    try:
        with Timer() as t_save:
            local = local_path(out)
            if local is not None:
                save_checkpoint(model, tokenizer, optimizer, f"{local}/{subdir}")
            else:
                tmp = tempfile.mkdtemp(prefix="rft-ckpt-")
                try:
                    save_checkpoint(model, tokenizer, optimizer, tmp)
                    fs, path = fsspec.core.url_to_fs(out)
                    fs.put(tmp.rstrip("/") + "/", f"{path.rstrip('/')}/{subdir}", recursive=True)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        table = pa.table({k: [asdict(s)[k] for s in steps] for k in schema.schema.names}, schema=schema.arrow)
        rows = write_parts(table, out, schema=schema)
        return commit_files(out, stage=schema.stage, config_hash=config_hash, num_rows=table.num_rows, inputs=inputs,
                            summary={**summary, "checkpoint_seconds": t_save.seconds}, schema=schema, rows_per_file=rows,
                            lock_token=token)
    except BaseException:
        release_stage_lock(out, token)
        raise
