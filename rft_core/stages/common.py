"""Shared plumbing of the stage programs: reuse-or-compute, timing, policy references."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Union

import fsspec

from rft_core.models.loading import cache_dir
from schemas import ShardRef, committed_ref, local_path

log = logging.getLogger("rft_core.stages")

# A policy is either a model path (the initial model: alias, folder or hub id) or the ShardRef
# of a committed ppo_update stage, whose ``policy/`` sub-folder is an HF checkpoint.
PolicyRef = Union[str, ShardRef]
POLICY_SUBDIR = "policy"


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


def policy_model_path(policy: PolicyRef) -> str:
    """A path ``from_pretrained`` can load for ``policy``.

    A checkpoint on a non-local filesystem is downloaded once into the cache, keyed by its
    manifest checksum (atomic rename, so a partial download is never used).
    """
    if isinstance(policy, str):
        return policy
    uri = f"{policy.uri.rstrip('/')}/{POLICY_SUBDIR}"
    local = local_path(uri)
    if local is not None:
        return local
    target = cache_dir() / "checkpoints" / policy.manifest_sha256
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=target.parent))
        fs, path = fsspec.core.url_to_fs(uri)
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
        if target.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    return str(target)


def policy_checkpoint_dir(policy: PolicyRef) -> str | None:
    """Local folder of a checkpointed policy (for its optimizer state), None for an initial model."""
    return None if isinstance(policy, str) else policy_model_path(policy)
