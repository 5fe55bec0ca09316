"""Where a stage finds the checkpoint it starts from: a policy, critic or optimizer state named
by a ``PolicyRef`` (an initial model path, or a committed training stage whose sub-folder is an
HF checkpoint), as a local folder ``from_pretrained`` can load.

Every checkpoint folder handed out is checked against its stage's manifest first (each file
present, same size, same checksum; ``schemas.verify_files``): a flipped byte in a committed
``model.safetensors`` or ``optimizer.pt`` stops the stage with an error that names the file and
the command that recomputes it (``rft repair``), instead of training on
from damaged weights. A local file hashed before by this process (the process that committed
it, or an earlier load), unchanged since, is not hashed again, so a run pays for the check
only when it resumes or loads a checkpoint another process wrote: about 0.5 s per GB.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import fsspec

from rft_core.models.loading import cache_dir
from rft_core.models.pretrained import building_shell
import rft_core.stages.writer as writer
from rft_core.stages.lineage import UPDATE_INPUT_KEY, WEIGHTS_DIGEST_KEY, policy_checkpoint_uri, weights_stage
from rft_core.stages.retention import WEIGHT_SUFFIXES, require_unpruned
from rft_core.stages.sharded_state import sharded_state_folder
from rft_core.stages.writer import wait_for_optimizer_writes
from rft_core.training.checkpoint import OPTIMIZER_FILE
from schemas import PolicyRef, ShardRef, local_path, pruned_files, read_manifest, verify_files

POLICY_SUBDIR = "policy"
CRITIC_SUBDIR = "critic"


def policy_model_path(policy: PolicyRef, subdir: str = POLICY_SUBDIR) -> str:
    """A path ``from_pretrained`` can load for ``policy`` (or a critic, with ``subdir="critic"``).

    A checkpoint on a non-local filesystem is downloaded once into the cache, keyed by its
    manifest checksum (atomic rename, so a partial download is never used).

    Raises:
        CheckpointPrunedError: the checkpoint's weights were pruned (``checkpoint.keep_last``).
        ShardCorruptError: a checkpoint file is missing or differs from the manifest (named).
    """
    if isinstance(policy, str):
        return policy
    stage = require_weights(policy, subdir)
    require_unpruned(stage, subdir, optimizer=False)
    return _checkpoint_folder(stage, subdir)


def check_policy_weights(policy: ShardRef, subdir: str = POLICY_SUBDIR) -> None:
    """What ``policy_model_path`` checks, without downloading anything: the weights are on
    storage, not pruned, and, in a local folder, match the manifest (a file this process wrote
    or checked before is not hashed again). For a model kept in memory
    (``rft_core.stages.memo``), whose weights need not be read again; nothing while this process
    writes them in the background (``rft_core.stages.writer``: the kept model is what it writes).

    Raises:
        WeightlessPolicyError, CheckpointPrunedError, ShardCorruptError: see ``policy_model_path``.
    """
    if subdir == POLICY_SUBDIR and writer.pending([policy_checkpoint_uri(policy)]):
        return  # the kept model is what this process is writing there now: no file to check yet
    stage = require_weights(policy, subdir)
    require_unpruned(stage, subdir, optimizer=False)
    if local_path(stage.uri) is not None:
        verify_files(stage.uri, under=subdir)


class WeightlessPolicyError(RuntimeError):
    """A policy was asked for from storage, but its update kept the weights in a resident
    worker's memory (``checkpoint.every`` > 1): only the resident workers can serve it; or its
    weights' background write (``checkpoint.async_weights``) never committed: a rerun writes them."""


def require_weights(policy: ShardRef, subdir: str = POLICY_SUBDIR) -> ShardRef:
    """The committed stage holding ``policy``'s ``subdir/`` weights (``weights_stage``: the stage
    itself, or the sibling a background checkpoint committed, after this process's pending write
    of it finished).

    Raises:
        WeightlessPolicyError: ``policy`` wrote no files under ``subdir`` because its weights
            stayed in memory (its manifest records their digest instead) and no background
            checkpoint of them committed (the message says which of the two cases it is).
        OptimizerStateError: this process's background write of those weights failed (named).
    """
    if subdir == POLICY_SUBDIR:  # written in the background by this process: joined first
        wait_for_optimizer_writes(policy_checkpoint_uri(policy))
    stage = weights_stage(policy, subdir)
    if stage is not None:
        return stage
    manifest, _ = read_manifest(policy.uri)
    if WEIGHTS_DIGEST_KEY in manifest.summary:
        recorded = manifest.summary.get(UPDATE_INPUT_KEY) or {}
        if recorded.get("save_checkpoint") and recorded.get("background_checkpoint"):
            raise WeightlessPolicyError(
                f"{policy.uri}: this update's weights were being written in the background "
                f"({policy_checkpoint_uri(policy)}, checkpoint.async_weights) and that write never committed (the run "
                "stopped during it). Rerun the training command (it trains this update again from its committed "
                "inputs and writes them), or use an earlier checkpoint (`rft inspect` lists them)")
        raise WeightlessPolicyError(
            f"{policy.uri}: this update kept its weights in memory (checkpoint.every > 1: the resident workers', or "
            "those of stage mode keeping its models), so they are not on storage. Resume the run with the same config "
            "(it rebuilds them from the last checkpoint), or use a checkpoint iteration (`rft inspect` lists them)")
    return policy


def sharded_state_dir(stage: ShardRef, subdir: str) -> str:
    """Local folder of the sharded AdamW state (DeepSpeed's partitions or FSDP2's DCP shards)
    that the committed training stage ``stage`` holds beside its ``subdir/`` checkpoint
    (``sharded_state_folder``: a DeepSpeed or FSDP2 critic's ``critic-optimizer/``), checked
    against the manifest (a remote one downloaded once into the cache).

    Raises:
        CheckpointPrunedError: the state (or the weights) was pruned (``checkpoint.keep_last``).
        ShardCorruptError: a file is missing or differs from the manifest (named).
    """
    require_unpruned(stage, subdir, optimizer=True)
    return _checkpoint_folder(stage, sharded_state_folder(subdir))


# a downloaded checkpoint folder is complete once one of these is there (full model, LoRA
# adapter, optimizer stage, DeepSpeed optimizer stage, FSDP2 optimizer stage); the download is renamed into place atomically
_COMPLETE_MARKERS = ("config.json", "adapter_config.json", OPTIMIZER_FILE, "latest",  # latest: a DeepSpeed state
                     "dcp/.metadata")  # an FSDP2 state (torch.distributed.checkpoint)


def _shell_skips(path: str) -> bool:
    """A file of a checkpoint that a load inside ``meta_shell`` does not read: the model's weight
    files (``model*.safetensors``, ``pytorch_model*.bin``, a critic's value head) and a single
    process's AdamW state (``optimizer.pt``); a LoRA adapter's weights stay (peft opens them on
    the meta base, small)."""
    name = path.rsplit("/", 1)[-1]
    return name == OPTIMIZER_FILE or (name.endswith(WEIGHT_SUFFIXES) and not name.startswith("adapter_model"))


def _checkpoint_folder(policy: ShardRef, subdir: str) -> str:
    """Local folder of ``{policy.uri}/{subdir}`` (``subdir=""``: the stage folder itself),
    checked against the manifest: the folder itself, or a download into the cache keyed by the
    manifest checksum (checked before it is renamed into place, so the cache never holds a
    damaged copy; a cached copy is not checked again). Inside ``meta_shell`` (a rank of an FSDP2
    job that receives its shards from rank 0: ``rft_core.training.fsdp.weights_on_rank0``) the
    weight files (``_shell_skips``) are neither checked nor downloaded: a remote folder
    comes without them, into a cache folder of its own.

    Raises:
        ShardCorruptError: a file is missing or its size or checksum differs from the manifest.
    """
    uri = f"{policy.uri.rstrip('/')}/{subdir}" if subdir else policy.uri
    skip = _shell_skips if building_shell() else None
    local = local_path(uri)
    if local is not None:
        verify_files(policy.uri, under=subdir, skip=skip)
        return local
    target = cache_dir() / "checkpoints" / f"{policy.manifest_sha256}-{subdir or policy.stage}{'-shell' if skip else ''}"
    if not any((target / name).exists() for name in _COMPLETE_MARKERS):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=target.parent))
        try:
            fs, path = fsspec.core.url_to_fs(uri)
            if skip is None:
                fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
            else:
                prefix, pruned = (f"{subdir.strip('/')}/" if subdir.strip("/") else ""), pruned_files(policy.uri)
                names = [e.path[len(prefix):] for e in read_manifest(policy.uri)[0].files
                         if e.path.startswith(prefix) and not skip(e.path) and e.path not in pruned]
                for name in names:
                    (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get([f"{path.rstrip('/')}/{n}" for n in names], [str(tmp / n) for n in names])
            verify_files(policy.uri, under=subdir, local_copy=str(tmp), skip=skip)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.replace(tmp, target)
        except OSError:  # another process (a rank on this node) put its download there first
            shutil.rmtree(tmp, ignore_errors=True)
            if not any((target / name).exists() for name in _COMPLETE_MARKERS):
                raise
    return str(target)


def policy_checkpoint_dir(policy: PolicyRef, subdir: str = POLICY_SUBDIR) -> str | None:
    """Local folder of a checkpointed policy (for its optimizer state), None for an initial model.

    Raises:
        CheckpointPrunedError: the checkpoint's optimizer state or weights were pruned.
        ShardCorruptError: a checkpoint file is missing or differs from the manifest (named).
    """
    if isinstance(policy, str):
        return None
    stage = require_weights(policy, subdir) if subdir else policy
    require_unpruned(stage, subdir, optimizer=True)  # covers the weights too: one check
    return _checkpoint_folder(stage, subdir)
