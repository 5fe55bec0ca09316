"""The policy's AdamW state as a stage of its own, written in a background thread.

Layout: next to ``iter=K/ppo_update`` (metrics parts + ``policy/`` weights) sits
``iter=K/ppo_update-optimizer`` with ``optimizer.pt`` and its own ``_MANIFEST.json`` (stage
``optimizer_state``, contract ``OptimizerStateInput``: its config hash is determined by the
``ppo_update`` ref alone).

Why a separate stage: the AdamW state is twice the float32 weights (1.03 GB on SmolLM2-135M)
and only the *next* ``ppo_update`` reads it, ~40 s later; the rollout, log-prob and reward
stages need only the weights. So ``ppo_update`` commits the weights synchronously and hands
the optimizer state to a background writer, which overlaps the next iteration's rollout
(measured in ``docs/benchmarks.md``). This is the asynchronous checkpointing of
TorchTitan/Megatron (``torch.distributed.checkpoint.async_save``), with the shard contract's
commit rule: the state counts only once its manifest is written.

Consumers: the next ``ppo_update`` waits for a pending write of its input
(``optimizer_state_ref``), and its config hash includes the optimizer stage's manifest
checksum. A write lost to a crash is recomputed when the run resumes: the committed
``ppo_update`` is reused, finds its optimizer stage missing (``optimizer_state_missing``) and
retrains from the same committed inputs and seeds, checking that the weights come out with the
committed checksums (``rft_core.stages.update``). A DeepSpeed update keeps no state (ZeRO
partitions it over the ranks), so it has no optimizer stage by design.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import fsspec
import torch

from rft_core.stages.checkpoints import policy_checkpoint_dir
from rft_core.stages.common import Commit, stage_commit
from rft_core.stages.contracts import OptimizerStateInput
from rft_core.training.checkpoint import OPTIMIZER_FILE, OPTIMIZER_FOLDER_SUFFIX
from schemas import ShardRef, commit_files, local_path, prepare_stage_dir, read_manifest, storage_errors
from schemas.columns import OPTIMIZER_STATE
from schemas.shards import ShardNotCommittedError, release_stage_lock

log = logging.getLogger("rft_core.stages")

OPTIMIZER_STAGE = OPTIMIZER_STATE.stage  # "optimizer_state"

_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: dict[str, Future] = {}


class OptimizerStateError(RuntimeError):
    """The optimizer state a ``ppo_update`` needs is missing, or its background write failed."""


def optimizer_state_uri(update: ShardRef) -> str:
    """URI of the optimizer stage belonging to the ``ppo_update`` stage ``update``: the sibling
    folder ``{name}-optimizer``."""
    return update.uri.rstrip("/") + OPTIMIZER_FOLDER_SUFFIX


def optimizer_commit(update: ShardRef) -> Commit:
    """Where and under what the optimizer stage of ``update`` commits: its config hash is
    determined by that update alone."""
    return stage_commit(OptimizerStateInput(update=update, out=optimizer_state_uri(update)))


def _write(update: ShardRef, state: dict, summary: dict) -> ShardRef:
    commit = optimizer_commit(update)
    uri = commit.uri
    t0 = time.perf_counter()
    token = prepare_stage_dir(uri)
    try:
        with storage_errors(uri):
            local = local_path(uri)
            if local is not None:
                torch.save(state, os.path.join(local, OPTIMIZER_FILE))
            else:
                with tempfile.TemporaryDirectory(prefix="rft-opt-") as tmp:
                    torch.save(state, os.path.join(tmp, OPTIMIZER_FILE))
                    fs, path = fsspec.core.url_to_fs(uri)
                    fs.put_file(os.path.join(tmp, OPTIMIZER_FILE), f"{path.rstrip('/')}/{OPTIMIZER_FILE}")
        ref = commit_files(uri, stage=OPTIMIZER_STAGE, config_hash=commit.config_hash, files=[OPTIMIZER_FILE],
                           inputs={"ppo_update": update}, summary={**summary, "seconds": time.perf_counter() - t0},
                           schema=OPTIMIZER_STATE, lock_token=token, contract=commit.contract)
    except BaseException:
        release_stage_lock(uri, token)
        raise
    log.info("optimizer_state: committed %s (%.2f s)", uri, time.perf_counter() - t0)
    return ref


def _lower_priority() -> None:
    """Run the writer thread at nice +10 (Linux: per thread). It has until the next update to
    finish; meanwhile the stages on the critical path (generation) get the CPU first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
        pass


def commit_optimizer_state(update: ShardRef, state: dict, *, background: bool,
                           summary: dict | None = None) -> ShardRef | None:
    """Write ``state`` (``optimizer.state_dict()``, tensors on CPU) as the optimizer stage of
    ``update`` and commit it.

    ``background``: return None at once and write in this process's writer thread (one at a
    time, in submission order, at a lower CPU priority); ``wait_for_optimizer_writes`` joins it. The caller must not
    modify the tensors of ``state`` afterwards. Otherwise write now and return the ShardRef.

    Raises:
        ShardExistsError: (not in the background) the optimizer stage is already committed.
    """
    summary = dict(summary or {})
    if not background:
        return _write(update, state, summary)
    global _EXECUTOR
    uri = optimizer_state_uri(update)
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rft-optimizer-state",
                                           initializer=_lower_priority)
        _PENDING[uri] = _EXECUTOR.submit(_write, update, state, summary)
    return None


def wait_for_optimizer_writes(uri: str | None = None) -> None:
    """Block until the pending background write of ``uri`` (None: of every optimizer stage)
    has finished. A no-op when none is pending.

    Raises:
        OptimizerStateError: a write failed (names the stage and the cause); it is reported
            once, and resuming the run recomputes that state.
    """
    with _LOCK:
        pending = {u: f for u, f in _PENDING.items() if uri is None or u == uri.rstrip("/")}
    first: tuple[str, BaseException] | None = None
    for u, fut in pending.items():
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the stage named
            first = first or (u, exc)
        finally:
            with _LOCK:
                if _PENDING.get(u) is fut:
                    del _PENDING[u]
    if first is not None:
        u, exc = first
        raise OptimizerStateError(f"{u}: the background write of the optimizer state failed: {exc!r}. Nothing "
                                  "committed is lost; rerunning the flow recomputes this state") from exc


def _committed(update: ShardRef) -> ShardRef | None:
    return optimizer_commit(update).committed(check_files=False)


def _kept_elsewhere(update: ShardRef) -> bool:
    """Whether ``update`` has no optimizer stage by design: a DeepSpeed update (no state kept),
    or an update between checkpoints whose state stayed in a resident worker's memory (its
    manifest records the weights' digest instead of weight files).

    Raises:
        ShardNotCommittedError: ``update`` is not a committed stage.
    """
    from rft_core.workers.recovery import WEIGHTS_DIGEST_KEY

    manifest, _ = read_manifest(update.uri)
    return "zero_stage" in manifest.summary or WEIGHTS_DIGEST_KEY in manifest.summary


def optimizer_state_missing(update: ShardRef) -> bool:
    """True when the committed ``ppo_update`` ``update`` should have a committed optimizer
    stage and has none: its background write was lost (a crash, or a failed write, which is
    logged). Waits for a pending write of that stage first."""
    try:
        wait_for_optimizer_writes(optimizer_state_uri(update))
    except OptimizerStateError as exc:
        log.warning("%s", exc)
    return _committed(update) is None and not _kept_elsewhere(update)


def optimizer_state_ref(policy: ShardRef | str) -> ShardRef | None:
    """The committed optimizer stage a ``ppo_update`` starting from ``policy`` loads, waiting
    for a pending background write of it. None: ``policy`` is an initial model or a DeepSpeed
    checkpoint (no state kept).

    Raises:
        OptimizerStateError: the state is missing (a lost background write), or its pending
            write failed.
    """
    if not isinstance(policy, ShardRef):
        return None
    wait_for_optimizer_writes(optimizer_state_uri(policy))
    ref = _committed(policy)
    if ref is not None:
        return ref
    try:
        if _kept_elsewhere(policy):
            return None
    except ShardNotCommittedError:
        return None  # not a ppo_update stage of ours: nothing to load
    raise OptimizerStateError(
        f"{optimizer_state_uri(policy)}: the optimizer state of {policy.uri} was never committed (the process "
        "stopped during its background write). Rerun the training flow on this run root: resuming that "
        "iteration recomputes it")


def optimizer_state_dir(ref: ShardRef) -> str:
    """Local folder holding ``optimizer.pt`` of the committed optimizer stage ``ref`` (a
    non-local one is downloaded once into the cache, keyed by its manifest checksum).

    Raises:
        CheckpointPrunedError: the state was pruned (``checkpoint.keep_last``).
    """
    return policy_checkpoint_dir(ref, subdir="")
