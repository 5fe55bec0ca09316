"""Exact recovery of a policy that lived only in memory (``checkpoint.every`` > 1).

Between checkpoints a ``ppo_update`` commits its metrics but no weights; its manifest records
the digest of the weights it produced (``weights_sha256``, ``rft_core.workers.sync.weights_digest``)
and its own input (``update_input``: the ``PPOUpdateInput``, whose ``policy`` names the update
before it). So every such policy has a chain back to the last policy whose weights are on
storage (a checkpoint, or the initial model): ``policy_chain``. ``rebuild_trainer`` loads that
checkpoint with its AdamW state, exactly as ``workers=stage`` does, then re-applies each
committed update after it from its own committed input shards (rollout, advantages, log-probs:
no rollout is regenerated) through the same training code, and checks each result against the
committed digest. On the CPU the updates are deterministic, so the rebuilt weights and AdamW
state are those of the uninterrupted run, bit for bit; a digest that differs (a nondeterministic
GPU kernel) stops with ``RecoveryError`` unless the caller accepts the difference.
"""
from __future__ import annotations

import logging
import time

from schemas import PolicyRef, ShardRef, read_manifest

log = logging.getLogger("rft_core.workers")

WEIGHTS_DIGEST_KEY = "weights_sha256"
UPDATE_INPUT_KEY = "update_input"


class RecoveryError(RuntimeError):
    """A policy could not be rebuilt exactly: a committed update in its chain is missing its
    recorded input, or re-applying it gave other weights than the committed digest."""


def has_weights(ref: ShardRef, subdir: str = "policy") -> bool:
    """Whether the committed training stage ``ref`` lists weight files under ``subdir``."""
    manifest, _ = read_manifest(ref.uri)
    return any(e.path.startswith(f"{subdir}/") for e in manifest.files)


def update_input_of(ref: ShardRef):
    """The ``PPOUpdateInput`` that produced the committed weightless update ``ref``.

    Raises:
        RecoveryError: the manifest records no input (an update that wrote its weights, or one
            written by an older version).
    """
    from rft_core.stages.contracts import PPOUpdateInput

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


def rebuild_trainer(ref: PolicyRef, inp, *, strict: bool = True):
    """The policy trainer (``rft_core.stages.update.PolicyTrainer``) holding exactly ``ref``,
    built for the update ``inp`` (its ``update`` config and ``dtype``): the base checkpoint of
    ``ref`` loaded with its AdamW state, then the committed updates after it re-applied.

    Args:
        strict: a re-applied update whose weights differ from its committed digest raises
            (otherwise it is logged and recovery goes on).
    Returns:
        (trainer, report): ``report`` has ``base`` (its URI or path), ``replayed`` (updates
        re-applied) and ``seconds``.
    Raises:
        RecoveryError: see the class; ``OptimizerStateError`` / ``CheckpointPrunedError`` when
            the base checkpoint's AdamW state or weights are gone.
    """
    from rft_core.stages.optimizer_state import optimizer_state_ref
    from rft_core.stages.update import build_trainer, replay_update
    from rft_core.workers.sync import state_tensors, weights_digest

    t0 = time.perf_counter()
    base, chain = policy_chain(ref)
    first = update_input_of(chain[0]) if chain else inp
    opt_ref = optimizer_state_ref(base) if first.update.deepspeed is None else None
    trainer = build_trainer(base, first.update, dtype=first.dtype, opt_ref=opt_ref)
    for u in chain:
        step_inp = update_input_of(u)
        replay_update(trainer, step_inp)
        got, want = weights_digest(state_tensors(trainer.strategy.model)), committed_digest(u)
        if got != want:
            msg = (f"re-applying the committed update {u.uri} gave other weights than it recorded (digest {got[:12]} "
                   f"vs {want[:12]}): nondeterministic kernels, or the input shards changed")
            if strict:
                raise RecoveryError(msg)
            log.warning("%s; recovery goes on with the recomputed weights", msg)
    report = {"base": base.uri if isinstance(base, ShardRef) else base, "replayed": len(chain),
              "seconds": time.perf_counter() - t0}
    if chain:
        log.info("rebuilt the policy of %s from %s by re-applying %d committed update(s) in %.1f s",
                 ref.uri if isinstance(ref, ShardRef) else ref, report["base"], len(chain), report["seconds"])
    return trainer, report
