"""Where a stage finds the checkpoint it starts from: a policy, critic or optimizer state named
by a ``PolicyRef`` (an initial model path, or a committed training stage whose sub-folder is an
HF checkpoint), as a local folder ``from_pretrained`` can load."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import fsspec

from rft_core.models.loading import cache_dir
from rft_core.stages.retention import require_unpruned
from rft_core.training.checkpoint import OPTIMIZER_FILE
from schemas import PolicyRef, ShardRef, local_path

POLICY_SUBDIR = "policy"
CRITIC_SUBDIR = "critic"


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
