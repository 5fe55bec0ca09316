"""Checkpoint retention: bound a run's storage by pruning the checkpoints of old iterations.

Every iteration commits a full HF checkpoint plus the AdamW state (``optimizer.pt``, twice the
weights in float32; the policy's in the stage ``ppo_update-optimizer``): about 1.6 GB per
iteration on SmolLM2-135M, ~84 GB on a 7B model. After each iteration ``i`` the flow prunes
the ``ppo_update`` (and its optimizer stage) and ``critic_update`` checkpoints of older
iterations (``CheckpointConfig``; the defaults in brackets):

- iterations ``<= i - keep_last`` [1] lose their optimizer state;
- with ``prune: weights`` [the default] they also lose their weight files (``*.safetensors``,
  ``*.bin``), except the last ``keep_weights_last`` [3] iterations and every
  ``keep_weights_every``-th [10] (iterations 10, 20, ...), which stay loadable for eval or as
  a reference; ``prune: optimizer`` keeps every iteration's weights.

A pruned folder keeps its config and tokenizer, and the stage keeps its metrics parts and its
manifest; the shards of every stage are never pruned (metrics, inspect, DuckDB, replay).

Resuming never needs a pruned file: iteration ``i + 1`` starts from iteration ``i``, which is
kept whole until ``i + 1`` has committed (``keep_last >= 1``). With ``rollout.max_staleness`` s,
the checkpoints the next rollouts sample with (versions ``>= i - s``) keep their weights, and
between checkpoints the one they are rebuilt from its optimizer state too (``staleness_floor``).
With ``checkpoint.every`` > 1 the last checkpoint (``latest_policy_checkpoint``) is also kept whole, whatever its age: a
resume rebuilds the policies after it from it; a checkpoint whose weights a background write
has not committed yet is not that one (``has_weights``), so its predecessor stays whole until a
later pass (the training flow runs the run's last pass again once its writes have landed).
Loading a pruned checkpoint
anyway (eval of an old iteration, or a later iteration deleted by hand) raises
``CheckpointPrunedError`` naming the files and why they went, instead of silently starting a
fresh optimizer. Manifests are never rewritten (``schemas.shards.prune_files``).

A pass reads the manifests of the iterations it may still prune; the first n it left in their
final state (``_final``) are remembered for the rest of the process, so later passes do not
read them again (the cost of a pass stays the same after iteration 1000 as after iteration 5).
"""
from __future__ import annotations

import logging
from typing import Literal

from rft_core.config import CheckpointConfig
from rft_core.stages.lineage import has_weights
from rft_core.training.checkpoint import OPTIMIZER_FILE, OPTIMIZER_FOLDER_SUFFIX, POLICY_FOLDER_SUFFIX
from schemas import ShardRef, prune_files, pruned_files, read_manifest, stage_uri
from schemas.shards import ShardNotCommittedError

log = logging.getLogger("rft_core.stages")

WEIGHT_SUFFIXES = (".safetensors", ".bin")
# stage folder -> checkpoint sub-folder ("": the folder itself; ppo_update-optimizer holds the
# policy's AdamW state, ppo_update-policy the weights a resident checkpoint iteration wrote in the
# background, rft_core.stages.optimizer_state)
OPTIMIZER_STAGE_FOLDER = f"ppo_update{OPTIMIZER_FOLDER_SUFFIX}"
POLICY_STAGE_FOLDER = f"ppo_update{POLICY_FOLDER_SUFFIX}"
CHECKPOINT_STAGES = {"ppo_update": "policy", OPTIMIZER_STAGE_FOLDER: "", POLICY_STAGE_FOLDER: "policy",
                     "critic_update": "critic"}


class CheckpointPrunedError(RuntimeError):
    """A checkpoint file needed now was removed by checkpoint retention (``checkpoint.keep_last``)."""


def _is_optimizer(name: str) -> bool:
    return name == OPTIMIZER_FILE


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".safetensors.index.json") or name.endswith(".bin.index.json")


def prunable_files(files: list[str], subdir: str, prune: Literal["optimizer", "weights"]) -> list[str]:
    """The paths among ``files`` (relative to a stage folder) that ``prune`` removes from the
    checkpoint folder ``subdir``: its optimizer state (``optimizer.pt``, or every file of a sharded
    trainer's state in the sibling folder ``{subdir}-optimizer/``: a DeepSpeed or FSDP2 critic's,
    ``rft_core.stages.sharded_state``), and with ``weights`` its weight files.

    Raises:
        ValueError: an unknown ``prune`` mode.
    """
    if prune not in ("optimizer", "weights"):
        raise ValueError(f"prune must be 'optimizer' or 'weights', got {prune!r}")
    out = []
    sharded = f"{subdir}{OPTIMIZER_FOLDER_SUFFIX}/" if subdir else None
    for rel in files:
        if sharded is not None and rel.startswith(sharded):
            out.append(rel)
            continue
        folder, _, name = rel.rpartition("/")
        if folder != subdir:
            continue
        if _is_optimizer(name) or (prune == "weights" and _is_weights(name)):
            out.append(rel)
    return sorted(out)


_DEFAULTS = CheckpointConfig()


def keeps_weights(old: int, iteration: int, *, keep_weights_last: int, keep_weights_every: int | None) -> bool:
    """Whether iteration ``old``'s weights survive ``prune: weights`` after ``iteration``: it is
    one of the last ``keep_weights_last`` iterations, or a multiple of ``keep_weights_every``."""
    return old > iteration - keep_weights_last or (keep_weights_every is not None and old % keep_weights_every == 0)


def staleness_floor(run_root: str, iteration: int, max_staleness: int) -> int | None:
    """With ``rollout.max_staleness`` s > 0: the oldest policy checkpoint a rollout may still
    need after ``iteration`` (None: s = 0). The rollouts still to come sample with versions
    ``>= iteration - s`` (``TrainConfig.rollout_policy_version``; the one of iteration
    ``iteration + 1``, prefetched or not, and after a resume with more iterations), each read from
    its checkpoint or rebuilt from the last checkpoint before it (``checkpoint.every`` > 1):
    ``latest_policy_checkpoint(iteration - s)``, or 1 (every checkpoint) when there is none yet."""
    if max_staleness <= 0:
        return None
    base = iteration - max_staleness
    return (latest_policy_checkpoint(run_root, base) if base >= 1 else None) or 1


def prune_checkpoints(run_root: str, iteration: int, *, keep_last: int,
                      prune: Literal["optimizer", "weights"] = _DEFAULTS.prune,
                      keep_weights_last: int = _DEFAULTS.keep_weights_last,
                      keep_weights_every: int | None = _DEFAULTS.keep_weights_every,
                      max_staleness: int = 0, every: int = 1) -> dict[str, list[str]]:
    """After ``iteration`` has committed, prune the checkpoints of iterations ``1 .. iteration -
    keep_last``: their optimizer state, and with ``prune="weights"`` their weights unless
    ``keeps_weights`` (idempotent: already-pruned files are skipped; uncommitted stages are left
    alone). With ``max_staleness`` s > 0 (asynchronous RL) the policy checkpoints from
    ``staleness_floor`` on keep their weights whatever ``keep_weights_last`` says, and with
    ``every`` (``checkpoint.every``) > 1 their optimizer state too (a version between checkpoints
    is rebuilt from the checkpoint before it): the rollouts of the next s iterations sample with
    them. Without it, s above ``keep_weights_last`` made a prefetched rollout find its weights
    pruned (``CheckpointPrunedError`` in iteration s + 1, measured with s = 2 and
    ``keep_weights_last=1``).

    Returns:
        {stage URI: paths deleted now}, only for stages where something was deleted.
    Raises:
        ValueError: ``keep_last < 1`` (the checkpoint the next iteration starts from would go),
            ``keep_weights_last < 1`` or ``keep_weights_every < 1``.
    """
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
    if keep_weights_last < 1 or (keep_weights_every is not None and keep_weights_every < 1):
        raise ValueError(f"checkpoint.keep_weights_last and keep_weights_every must be >= 1, got {keep_weights_last}, "
                         f"{keep_weights_every}")
    done: dict[str, list[str]] = {}
    keep = latest_policy_checkpoint(run_root, iteration)  # what a resume rebuilds the policy from
    floor = staleness_floor(run_root, iteration, max_staleness)  # what the next rollouts sample with
    oldest_kept = keep if floor is None else min(floor, keep or floor)  # no iteration from here on is settled
    why_opt = f"checkpoint.keep_last={keep_last} after iteration {iteration}"
    why_weights = (f"checkpoint.prune=weights (keep_weights_last={keep_weights_last}, keep_weights_every="
                   f"{keep_weights_every}) after iteration {iteration}")
    memo = (run_root.rstrip("/"), keep_last, prune, keep_weights_last, keep_weights_every, max_staleness, every)
    settled, settled_sha = _settled(run_root, memo)
    for old in range(settled + 1, iteration - keep_last + 1):
        update_sha = None
        sampled = floor is not None and old >= floor  # a later rollout may sample with it (max_staleness)
        drop_weights = prune == "weights" and not sampled and not keeps_weights(
            old, iteration, keep_weights_last=keep_weights_last, keep_weights_every=keep_weights_every)
        for stage, subdir in CHECKPOINT_STAGES.items():
            if (old == keep or (sampled and every > 1)) and stage != "critic_update":
                continue
            uri = stage_uri(run_root, old, stage)
            try:
                manifest, sha = read_manifest(uri)
            except ShardNotCommittedError:
                continue
            update_sha = sha if stage == "ppo_update" else update_sha
            files = [e.path for e in manifest.files]
            # an optimizer stage is optimizer state through and through: optimizer.pt, or DeepSpeed's
            # partitions (zero/*_optim_states.pt, *_model_states.pt, latest)
            optimizer = sorted(files) if stage == OPTIMIZER_STAGE_FOLDER else prunable_files(files, subdir, "optimizer")
            weights = sorted(set(prunable_files(files, subdir, "weights")) - set(optimizer)) if drop_weights else []
            removed = prune_files(uri, optimizer, reason=why_opt) + prune_files(uri, weights, reason=why_weights)
            if removed:
                done[uri] = sorted(removed)
                log.info("pruned %d checkpoint file(s) of %s (%s)", len(removed), uri,
                         why_weights if weights else why_opt)
        if settled == old - 1 and update_sha is not None and _final(
                old, iteration, oldest_kept, prune=prune, keep_weights_last=keep_weights_last,
                keep_weights_every=keep_weights_every):
            settled, settled_sha = old, update_sha
    _SETTLED[memo] = (settled, settled_sha)
    return done


# (run root, settings) -> (n, sha256 of iteration n's ppo_update manifest): a pass of this process
# left iterations 1..n in their final state (``_final``), so later passes start after n instead
# of reading their manifests again (4 reads per old iteration per pass: O(n) per iteration, a GET
# each on object storage)
_SETTLED: dict[tuple, tuple[int, str]] = {}


def _settled(run_root: str, memo: tuple) -> tuple[int, str]:
    """(n, sha256) of ``_SETTLED[memo]``, or (0, "") when there is none or iteration n's
    ``ppo_update`` is no longer the manifest recorded (one read per pass): the run root was
    deleted and a new run started in it, or the run was rewound by hand past iteration n, so
    none of 1..n may be skipped."""
    n, sha = _SETTLED.get(memo, (0, ""))
    if n:
        try:
            if read_manifest(stage_uri(run_root, n, "ppo_update"))[1] == sha:
                return n, sha
        except ShardNotCommittedError:
            pass
    return 0, ""


def _final(old: int, iteration: int, keep: int | None, *, prune: str, keep_weights_last: int,
           keep_weights_every: int | None) -> bool:
    """Whether the pass after ``iteration`` left iteration ``old`` (<= iteration - keep_last,
    just pruned) as every later pass would: (1) ``old`` is older than the last checkpoint ``keep``,
    so it never becomes that checkpoint again (``latest_policy_checkpoint`` only moves forward),
    and every checkpoint stage it will ever commit has committed: its background writes were
    queued before ``keep``'s, on the same writer thread, which runs them in order, and the weights
    of ``keep`` commit last (``rft_core.stages.optimizer_state``); a stage-mode update also waits
    for the previous one's writes before it commits; and (2) whether it keeps its weights is
    decided for good: ``prune: optimizer``, a ``keep_weights_every``-th iteration, or older than
    the last ``keep_weights_last``. A missed case could only leave files unpruned, never remove
    one: the memo only skips work, and a new process starts with none (a resume prunes anew)."""
    if keep is None or old >= keep:
        return False
    return (prune != "weights" or old <= iteration - keep_weights_last
            or (keep_weights_every is not None and old % keep_weights_every == 0))


def latest_policy_checkpoint(run_root: str, iteration: int) -> int | None:
    """The last iteration ``<= iteration`` whose committed ``ppo_update`` has the policy's
    weights on storage (``has_weights``: in its folder, or in the sibling a background checkpoint
    committed; with ``checkpoint.every`` > 1 the iterations between checkpoints have none), or
    None. Retention never prunes it: a resume rebuilds the policies after it from it."""
    for old in range(iteration, 0, -1):
        try:
            ref = ShardRef.from_manifest(stage_uri(run_root, old, "ppo_update"))
        except ShardNotCommittedError:
            continue
        if has_weights(ref):
            return old
    return None


def apply_retention(run_root: str, iteration: int, checkpoint: CheckpointConfig, *,
                    max_staleness: int = 0) -> dict[str, list[str]]:
    """``prune_checkpoints`` with every setting of ``checkpoint`` and the run's
    ``rollout.max_staleness`` (nothing when ``keep_last`` is None); what the flow runs after each
    iteration.

    Returns:
        {stage URI: paths deleted now}.
    """
    if checkpoint.keep_last is None:
        return {}
    return prune_checkpoints(run_root, iteration, keep_last=checkpoint.keep_last, prune=checkpoint.prune,
                             keep_weights_last=checkpoint.keep_weights_last,
                             keep_weights_every=checkpoint.keep_weights_every, max_staleness=max_staleness,
                             every=checkpoint.every)


def require_unpruned(policy: ShardRef, subdir: str, *, optimizer: bool) -> None:
    """Raise when a checkpoint's weights (or, with ``optimizer``, its optimizer state) were pruned.

    Raises:
        CheckpointPrunedError: names the stage, the files and why they were pruned.
    """
    pruned = pruned_files(policy.uri)
    if optimizer and not subdir:  # an optimizer stage: any pruned file is its state gone
        gone = list(pruned)
    else:
        state = set(prunable_files(list(pruned), subdir, "optimizer"))
        gone = [rel for rel in prunable_files(list(pruned), subdir, "weights") if optimizer or rel not in state]
    if gone:
        reasons = "; ".join(dict.fromkeys(pruned[rel] for rel in sorted(gone)))
        raise CheckpointPrunedError(
            f"{policy.uri}: checkpoint file(s) {', '.join(sorted(gone))} were pruned ({reasons}); "
            "this checkpoint can no longer be trained from. Resume from the last iteration, or raise "
            "checkpoint.keep_last in new runs")
