"""Where a test finds a committed policy's checkpoint files: the ``ppo_update`` folder, or, for a
checkpoint iteration written in the background (``checkpoint.async_weights``), the
sibling stage ``ppo_update-policy`` (``rft_core.stages.lineage.weights_stage``), once the
process's pending background writes have finished."""
from __future__ import annotations

from pathlib import Path

from rft_core.stages.lineage import weights_stage
from rft_core.stages.writer import wait_for_optimizer_writes
from schemas import ShardRef, read_manifest, stage_uri


def policy_files(ref: ShardRef, *, suffix: str = "") -> dict[str, str]:
    """{path: manifest checksum} of the ``policy/`` files (ending with ``suffix``) holding ``ref``'s weights.

    Raises:
        AssertionError: ``ref``'s weights are not on storage.
    """
    return {e.path: e.checksum for e in read_manifest(_held(ref).uri)[0].files
            if e.path.startswith("policy/") and e.path.endswith(suffix)}


def iteration_policy_files(run_root: str | Path, iteration: int, *, suffix: str = "") -> dict[str, str]:
    """``policy_files`` of the ``ppo_update`` of ``iteration`` under ``run_root``."""
    return policy_files(ShardRef.from_manifest(stage_uri(str(run_root), iteration, "ppo_update")), suffix=suffix)


def iteration_policy_folder(run_root: str | Path, iteration: int) -> Path:
    """The HF folder holding the weights the ``ppo_update`` of ``iteration`` under the local
    ``run_root`` made (``rft_core.api.policy_checkpoint_folder``), once the process's pending
    background writes have finished.

    Raises:
        AssertionError: those weights are not on storage.
    """
    return Path(_held(ShardRef.from_manifest(stage_uri(str(run_root), iteration, "ppo_update"))).uri) / "policy"


def _held(ref: ShardRef) -> ShardRef:
    """The committed stage holding ``ref``'s weights (``weights_stage``), after this process's
    pending background writes; AssertionError naming ``ref`` when they are not on storage."""
    wait_for_optimizer_writes()
    held = weights_stage(ref)
    assert held is not None, f"{ref.uri}: its weights are not on storage"
    return held
