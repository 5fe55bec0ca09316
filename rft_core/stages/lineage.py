"""Where a policy's weights are on storage, for a policy that may have lived only in memory
(``checkpoint.every`` > 1): what a weightless update's manifest records, and the chain of
committed updates back to the stored weights a policy descends from.

Between checkpoints a ``ppo_update`` commits its metrics but no weights; its manifest records
the digest of the weights it produced (``WEIGHTS_DIGEST_KEY``, ``trained_digest``) and its own
input (``UPDATE_INPUT_KEY``: the ``PPOUpdateInput``, whose ``policy`` names the update before it).
So every such policy has a chain back to the last policy whose weights are on storage (a
checkpoint, or the initial model): ``policy_chain``. This module only reads manifests and
computes the recorded digest, so the stage modules below the update program (checkpoints,
retention, the model sources) can ask it where weights are; re-applying the chain is
``rft_core.stages.recovery``, which sits above the update program it re-runs.
"""
from __future__ import annotations

from rft_core.stages.contracts import PPOUpdateInput
from rft_core.training.checkpoint import POLICY_FOLDER_SUFFIX
from rft_core.weightsync.plan import state_tensors
from rft_core.weightsync.digest import digest_like, weights_digest
from rft_core.weightsync.trained import SHARDED, trained_tensors
from schemas import PolicyRef, ShardRef, read_manifest
from schemas.shards import ShardNotCommittedError

WEIGHTS_DIGEST_KEY = "weights_sha256"
UPDATE_INPUT_KEY = "update_input"


class RecoveryError(RuntimeError):
    """A policy could not be rebuilt exactly: a committed update in its chain is missing its
    recorded input (``update_input_of``), or re-applying it gave other weights than the committed
    digest (``rft_core.stages.recovery.rebuild_trainer``)."""


def policy_checkpoint_uri(update: ShardRef) -> str:
    """URI of the sibling stage ``{update}-policy`` that holds the weights of a ``ppo_update``
    committed without them by a resident checkpoint iteration (``PPOUpdateInput.background_checkpoint``)."""
    return update.uri.rstrip("/") + POLICY_FOLDER_SUFFIX


def weights_stage(ref: ShardRef, subdir: str = "policy") -> ShardRef | None:
    """The committed stage whose ``subdir/`` folder holds the weights of the committed training
    stage ``ref``: ``ref`` itself when its manifest lists files there; for a ``ppo_update``
    committed without them (``WEIGHTS_DIGEST_KEY`` in its summary), its sibling
    ``policy_checkpoint_uri(ref)`` once committed with ``ref`` as its input (a background
    checkpoint that finished); else None (the weights live in a resident worker's memory, or
    their background write has not committed: a crash during it leaves the previous checkpoint
    the one a resume starts from)."""
    manifest, _ = read_manifest(ref.uri)
    if any(e.path.startswith(f"{subdir}/") for e in manifest.files):
        return ref
    if subdir != "policy" or WEIGHTS_DIGEST_KEY not in manifest.summary:
        return None
    try:
        sibling = ShardRef.from_manifest(policy_checkpoint_uri(ref))
    except ShardNotCommittedError:
        return None
    sib, _ = read_manifest(sibling.uri)
    return sibling if sib.inputs.get("ppo_update") == ref.manifest_sha256 else None


def has_weights(ref: ShardRef, subdir: str = "policy") -> bool:
    """Whether the weights of the committed training stage ``ref`` are on storage (``weights_stage``)."""
    return weights_stage(ref, subdir) is not None


def kept_in_memory(ref: PolicyRef) -> bool:
    """Whether ``ref`` is a committed update that kept its weights in memory by design (an
    iteration between checkpoints, ``checkpoint.every`` > 1: its manifest records their digest and
    an input with ``save_checkpoint`` false); not one whose background checkpoint is pending or
    was lost. Reads the manifest only."""
    if not isinstance(ref, ShardRef):
        return False
    summary = read_manifest(ref.uri)[0].summary
    recorded = summary.get(UPDATE_INPUT_KEY)
    return WEIGHTS_DIGEST_KEY in summary and isinstance(recorded, dict) and recorded.get("save_checkpoint") is False


def update_input_of(ref: ShardRef) -> PPOUpdateInput:
    """The ``PPOUpdateInput`` that produced the committed weightless update ``ref``.

    Raises:
        RecoveryError: the manifest records no input (an update that wrote its weights, or one
            written by an older version).
    """
    summary = read_manifest(ref.uri)[0].summary
    if UPDATE_INPUT_KEY not in summary:
        raise RecoveryError(f"{ref.uri}: this update kept its weights in memory but its manifest does not record its "
                            "input, so it cannot be re-applied; rerun from a fresh run root")
    return PPOUpdateInput.model_validate(summary[UPDATE_INPUT_KEY])


def policy_chain(ref: PolicyRef) -> tuple[PolicyRef, list[ShardRef]]:
    """(base, updates): ``base`` is the nearest policy at or before ``ref`` whose weights are on
    storage (a checkpoint, or an initial model path); ``updates`` are the committed weightless
    updates after it, oldest first, ending with ``ref`` (empty when ``ref`` is the base).

    Raises:
        RecoveryError: an update of the chain records no input (``update_input_of``).
    """
    chain: list[ShardRef] = []
    while isinstance(ref, ShardRef) and not has_weights(ref):
        chain.append(ref)
        ref = update_input_of(ref).policy
    return ref, chain[::-1]


def weights_base(ref: PolicyRef) -> PolicyRef:
    """The policy whose stored weights ``ref`` descends from (``ref`` itself when it has them)."""
    return policy_chain(ref)[0]


def trained_digest(strategy, *, like: str | None = None) -> str | None:
    """The weight digest (``rft_core.weightsync.digest.weights_digest``) a weightless update
    records (``WEIGHTS_DIGEST_KEY``) and recovery checks: of the trainer's own tensors in one
    process (a LoRA model's adapters and base, ``state_tensors``), of the gathered weights under
    DeepSpeed or FSDP2 (``trained_tensors``: a collective, every rank calls it; None on ranks
    above 0). By default ``device`` sums for weights on a GPU (they are read where they are),
    XXH3-128 on the host for CPU weights; ``like``: a recorded digest whose method to use
    (``digest_like``: recovery compares digests of one method, whichever device the run resumes
    on, and digests recorded before issue 46, sha256 on the host, still check).

    Raises:
        ValueError: ``like`` is not a digest.
    """
    tensors = state_tensors(strategy.model) if not isinstance(strategy, SHARDED) else trained_tensors(strategy)
    if tensors is None:
        return None
    return weights_digest(tensors) if like is None else digest_like(tensors, like)
