"""Rebuilding a policy trainer that lived only in memory (``checkpoint.every`` > 1): its base
checkpoint loaded with its AdamW (or ZeRO) state, then the committed updates after it re-applied
from their own input shards (``rft_core.stages.recovery`` finds the chain)."""
from __future__ import annotations

import logging
import time

from rft_core.stages.optimizer_state import optimizer_state_ref
from rft_core.stages.recovery import RecoveryError, committed_digest, policy_chain, update_input_of
from rft_core.stages.update import build_trainer, replay_update
from rft_core.weightsync.trained import trained_digest
from schemas import PolicyRef, ShardRef

log = logging.getLogger("rft_core.workers")


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
        RecoveryError: (``rft_core.stages.recovery``) a recorded input is missing, or a
            re-applied update's weights differ from its digest; ``OptimizerStateError`` / ``CheckpointPrunedError`` when
            the base checkpoint's AdamW state or weights are gone.
    """
    t0 = time.perf_counter()
    base, chain = policy_chain(ref)
    first = update_input_of(chain[0]) if chain else inp
    trainer = build_trainer(base, first.update, dtype=first.dtype, opt_ref=optimizer_state_ref(base))
    for u in chain:
        step_inp = update_input_of(u)
        replay_update(trainer, step_inp)
        got, want = trained_digest(trainer.strategy), committed_digest(u)
        if got is not None and got != want:  # None: a DeepSpeed rank above 0 (rank 0 checks)
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
