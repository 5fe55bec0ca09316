"""Exact recovery of a policy that lived only in memory (``checkpoint.every`` > 1): the one
place that rebuilds it.

A weightless ``ppo_update`` records the digest of the weights it produced and its own input
(``rft_core.stages.lineage``, which also finds the chain of such updates back to stored
weights: ``policy_chain``). ``rebuild_trainer`` loads that chain's base checkpoint with its
AdamW state, exactly as ``workers=stage`` does, then re-applies each committed update after it
from its own committed input shards (rollout, advantages, log-probs: no rollout is regenerated)
through the same training code (``replay_update``: the update's seeds come from its recorded
input, ``update.seed`` and ``policy_version``, so it draws the masks and the order it drew the
first time), and checks each result against the committed digest (``check_digest``). On the CPU
the updates are deterministic, so the rebuilt weights and AdamW state are those of the
uninterrupted run, bit for bit, and a digest that differs stops with ``RecoveryError``; on a
GPU, whose kernels need not give the same bits twice, it is logged and counted
(``inexact_rebuilds``) and the run goes on with the rebuilt weights. The resident policy worker
(``rft_core.workers.policy.PolicyWorker``) calls ``rebuild_trainer`` when it does not hold the policy an update starts from; stage mode keeping
its models (``rft_core.stages.memo``) calls it through ``keep_rebuilt`` when a program asks for
such a policy in a process that does not hold it (a rerun after a crash, a retried update).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rft_core.counters import count
import rft_core.stages.memo as memo
from rft_core.stages.contracts import PPOUpdateInput
from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY, RecoveryError, policy_chain, trained_digest, update_input_of
from rft_core.stages.optimizer_state import optimizer_state_ref
from rft_core.stages.update import (
    PolicyTrainer,
    build_trainer,
    configure_trainer,
    run_update_steps,
    trainer_settings,
    update_correction,
    update_data,
)
from rft_core.stages.sources import version_key
from rft_core.weightsync.trained import strategy_device
from rft_core.training.update import StepMetrics
from schemas import PolicyRef, ShardRef, read_manifest

log = logging.getLogger("rft_core.stages")


def committed_digest(ref: ShardRef) -> str:
    """The weights digest the committed weightless update ``ref`` recorded (``WEIGHTS_DIGEST_KEY``)."""
    return read_manifest(ref.uri)[0].summary[WEIGHTS_DIGEST_KEY]


def replay_update(trainer: PolicyTrainer, inp: PPOUpdateInput) -> list[StepMetrics]:
    """Re-apply the committed update ``inp`` to ``trainer`` (which holds ``inp.policy``) from
    its committed input shards, as it ran the first time: its learning rate and clipping, its
    data, rollout correction and seeds. Commits nothing."""
    configure_trainer(trainer, inp.update)
    data = update_data(inp)
    correction, _ = update_correction(inp.update, data)
    return run_update_steps(trainer, inp, data, correction, quiet=True)[0]


def check_digest(trainer: PolicyTrainer, update: ShardRef) -> bool:
    """Check that ``trainer`` holds the weights the committed weightless ``update`` recorded
    (``trained_digest`` by the recorded digest's own method; a collective under DeepSpeed and
    FSDP2, where rank 0 checks). Returns whether they match (True on ranks above 0).

    On a CUDA device a mismatch is expected now and then: some kernels need not give the same
    bits twice (torch's "Reproducibility" notes: the memory-efficient attention's backward,
    atomic adds in reductions), so re-applying an update that ran on the GPU may differ from it
    in the last bits. There it is logged as a warning and counted (``inexact_rebuilds``, in the
    iteration's metrics), and the run goes on with the rebuilt weights, as a stage-mode rerun
    that recomputes a lost checkpoint does; a resume is then as close to the uninterrupted run as
    the kernels allow, not bit for bit. On the CPU the updates are deterministic, so a mismatch
    means the inputs changed.

    Raises:
        RecoveryError: the digests differ on a trainer that computes on the CPU (the input shards
            changed, or a bug).
    """
    want = committed_digest(update)
    got = trained_digest(trainer.strategy, like=want)
    if got is None or got == want:  # None: a DeepSpeed or FSDP2 rank above 0
        return True
    device = strategy_device(trainer.strategy)
    if device.type == "cuda":
        count("inexact_rebuilds")
        log.warning("re-applying the committed update %s on %s gave other weights than it recorded (digest %s vs %s): "
                    "the GPU kernels are not bitwise deterministic; the run goes on with the rebuilt weights",
                    update.uri, device, got[:12], want[:12])
        return False
    raise RecoveryError(f"re-applying the committed update {update.uri} gave other weights than it recorded (digest "
                        f"{got[:12]} vs {want[:12]}) on the CPU, where the updates are deterministic: its input shards "
                        "changed since it ran. Rerun from a checkpoint iteration (`rft inspect` lists them) in a fresh "
                        "run root")


def rebuild_trainer(ref: PolicyRef, inp: PPOUpdateInput | None) -> tuple[PolicyTrainer, dict[str, Any]]:
    """The policy trainer holding exactly ``ref``: the base checkpoint of ``ref``
    (``policy_chain``) loaded with its AdamW state, built for the first update of the chain (for
    ``ref`` with stored weights: for ``inp``, the update about to run, its ``update`` config and
    ``dtype``), then the committed updates after it re-applied (``replay_update``), each checked
    against its committed digest (``check_digest``).

    Returns:
        (trainer, report): ``report`` has ``base`` (its URI or path), ``replayed`` (updates
        re-applied), ``inexact`` (of them, those whose GPU re-run differed from the recorded
        digest: ``check_digest``) and ``seconds``.
    Raises:
        RecoveryError: a recorded input is missing, or a re-applied update's weights differ from
            its digest on the CPU (``check_digest``); ``ValueError``: ``ref`` has its weights on storage and ``inp`` is None;
            ``OptimizerStateError`` / ``CheckpointPrunedError`` when the base checkpoint's AdamW
            state or weights are gone.
    """
    t0 = time.perf_counter()
    base, chain = policy_chain(ref)
    first = update_input_of(chain[0]) if chain else inp
    if first is None:
        raise ValueError(f"rebuild_trainer: {ref} has its weights on storage: building its trainer needs the update's input")
    trainer = build_trainer(base, first.update, dtype=first.dtype, opt_ref=optimizer_state_ref(base))
    inexact = 0
    for u in chain:
        replay_update(trainer, update_input_of(u))
        inexact += not check_digest(trainer, u)
    report = {"base": base.uri if isinstance(base, ShardRef) else base, "replayed": len(chain), "inexact": inexact,
              "seconds": time.perf_counter() - t0}
    if chain:
        log.info("rebuilt the policy of %s from %s by re-applying %d committed update(s) in %.1f s",
                 ref.uri if isinstance(ref, ShardRef) else ref, report["base"], len(chain), report["seconds"])
    return trainer, report


_REBUILDING = threading.Lock()  # one rebuild at a time: the actor and reference passes run side by side


def keep_rebuilt(ref: ShardRef) -> None:
    """Stage mode keeping its models (``rft_core.stages.memo``, ``checkpoint.every`` > 1): make
    the memo hold the trainer of ``ref``, a committed update whose weights were kept in memory
    only (``kept_in_memory``), which this process does not hold (a rerun after a crash; an update
    retried after it failed with the trainer taken out): ``rebuild_trainer`` (the committed
    updates re-applied to the last checkpoint, each checked against its recorded digest), kept
    with the settings its last update recorded. The stage runner hands it to ``keeping_models``;
    the programs call it through ``memo.rebuild`` when they ask for such a policy. Nothing when
    the memo holds the trainer already (another thread rebuilt it meanwhile).

    Raises:
        RecoveryError, OptimizerStateError, CheckpointPrunedError: see ``rebuild_trainer``.
    """
    key = version_key(ref)
    with _REBUILDING:
        if memo.serves(key, None):
            return
        trainer, report = rebuild_trainer(ref, None)
        count("recovered_updates", report["replayed"])
        memo.keep_trainer(key, trainer_settings(update_input_of(ref)), trainer)
