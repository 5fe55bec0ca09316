"""Exact recovery of a policy that lived only in memory (``checkpoint.every`` > 1).

Between checkpoints a ``ppo_update`` commits its metrics but no weights; its manifest records
the digest of the weights it produced (``weights_sha256``, ``rft_core.weightsync.trained.tensors_digest``)
and its own input (``update_input``: the ``PPOUpdateInput``, whose ``policy`` names the update
before it). So every such policy has a chain back to the last policy whose weights are on
storage (a checkpoint, or the initial model): ``policy_chain``. ``rebuild_trainer`` loads that
checkpoint with its AdamW state, exactly as ``workers=stage`` does, then re-applies each
committed update after it from its own committed input shards (rollout, advantages, log-probs:
no rollout is regenerated) through the same training code, and checks each result against the
committed digest (``rft_core.workers.policy.rebuild_trainer``; this module only reads
manifests: the stage programs own it, the workers import it). On the CPU the updates are
deterministic, so the rebuilt weights and AdamW state are those of the uninterrupted run, bit
for bit; a digest that differs (a nondeterministic
GPU kernel) stops with ``RecoveryError`` unless the caller accepts the difference.
"""
from __future__ import annotations

from rft_core.stages.contracts import PPOUpdateInput
from rft_core.training.checkpoint import POLICY_FOLDER_SUFFIX
from schemas import PolicyRef, ShardRef, read_manifest
from schemas.shards import ShardNotCommittedError

WEIGHTS_DIGEST_KEY = "weights_sha256"
UPDATE_INPUT_KEY = "update_input"


class RecoveryError(RuntimeError):
    """A policy could not be rebuilt exactly: a committed update in its chain is missing its
    recorded input, or re-applying it gave other weights than the committed digest."""


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


def update_input_of(ref: ShardRef):
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
    updates after it, oldest first, ending with ``ref`` (empty when ``ref`` is the base)."""
    chain: list[ShardRef] = []
    while isinstance(ref, ShardRef) and not has_weights(ref):
        chain.append(ref)
        ref = update_input_of(ref).policy
    return ref, chain[::-1]


def weights_base(ref: PolicyRef) -> PolicyRef:
    """The policy whose stored weights ``ref`` descends from (``ref`` itself when it has them)."""
    return policy_chain(ref)[0]


def committed_digest(ref: ShardRef) -> str:
    """The weights digest a weightless update recorded."""
    return read_manifest(ref.uri)[0].summary[WEIGHTS_DIGEST_KEY]
