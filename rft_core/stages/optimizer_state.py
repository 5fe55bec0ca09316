"""The policy's AdamW state as a stage of its own, written in a background thread; and, for a
checkpoint iteration written in the background, the policy's weights too (``commit_policy_checkpoint``).

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

Consumers: the next ``ppo_update``'s config hash includes the optimizer stage's config hash
(``optimizer_state_key``, known before the write ends); it runs its forward and backward passes
while the write goes on and waits for it before its first optimizer step changes the tensors
being written (``SingleProcess.wait_before_step``), or before it reads the state from storage
(``optimizer_state_ref``). A CUDA state is written from a page-locked host copy (``stage_on_host``):
the next update then steps during the write too, and waits for it before it commits. A write
lost to a crash is recomputed when the run resumes: the committed ``ppo_update`` is reused, finds
its optimizer stage missing (``optimizer_state_missing``) and retrains from the same committed
inputs and seeds, checking that the weights come out with the committed checksums
(``rft_core.stages.update``).

A DeepSpeed update (ZeRO over the ranks of a torchrun job) writes the same stage in DeepSpeed's
own sharded format instead of ``optimizer.pt`` (``commit_sharded_optimizer_state``): every
rank writes its partition of the AdamW moments and float32 master weights with
``engine.save_checkpoint`` (tag ``DEEPSPEED_TAG``), and after a barrier rank 0 lists every file
with its checksum in ``_MANIFEST.json``, written last; the manifest's summary says
``format: deepspeed`` with the world size, ZeRO stage and dtype the next update must match
(``deepspeed_checkpoint``, ``rft_core.training.strategy.check_deepspeed_state``). It is written
synchronously (each rank holds its partition only until it exits).

A resident checkpoint iteration (``PPOUpdateInput.background_checkpoint``, issue 44), or a
stage-mode one keeping its models (both with ``checkpoint.async_weights``, the default), takes the weights off the
critical path as well (a CUDA model's from a pinned host copy, ``commit_policy_checkpoint``): its ``ppo_update`` commits as between checkpoints (the
weights' digest and its own input, no weights: ``rft_core.stages.lineage``), then the same
writer thread writes the optimizer stage and, after it, ``iter=K/ppo_update-policy`` (stage
``policy_checkpoint``: ``policy/``, the HF folder ``policy_model_path`` hands out, under its own
manifest), while the next iteration's rollout runs. The weights stage commits last, so a policy
whose weights are on storage always has its AdamW state there too; a crash before it leaves the
previous checkpoint the one a resume rebuilds from (the committed updates after it re-applied).
The next resident ``ppo_update`` waits for both writes before it starts, and writes them again if
one failed (``rft_core.stages.update._write_lost_checkpoint``): a resident run carries on after a
failed write, with every checkpoint it asked for on storage. The next stage-mode update trains
meanwhile, as it does during an optimizer write; a lost write is recomputed when the run resumes
(the update run again from its committed inputs, ``_retrain_lost``).

An FSDP2 update (``update.fsdp``) writes the stage the same way with its own sharded format
(``commit_sharded_optimizer_state``): every rank its shards of the float32 masters and AdamW
state through ``torch.distributed.checkpoint`` (``dcp/.metadata``, ``dcp/__{rank}_0.distcp``),
then rank 0's manifest with ``format: fsdp``, the world size and dtype (``fsdp_checkpoint``); the
next update loads it on any number of ranks (DCP reshards).
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import fsspec
import psutil
import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from rft_core.stages.checkpoints import policy_checkpoint_dir
import rft_core.stages.writer as writer
from rft_core.stages.common import Commit, stage_commit
from rft_core.stages.contracts import OptimizerStateInput, PolicyCheckpointInput
from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY, policy_checkpoint_uri
from rft_core.stages.sharded_state import (
    DEEPSPEED_FORMAT,
    FSDP_FORMAT,
    check_kind,
    continued_state,
    raise_if_any_failed,
    save_partitions,
    sharded_format,
)
from rft_core.stages.writer import OptimizerStateError, wait_for_optimizer_writes
from rft_core.training.checkpoint import OPTIMIZER_FILE, OPTIMIZER_FOLDER_SUFFIX, save_checkpoint, save_optimizer_state
from rft_core.training.strategy import (
    DeepSpeedCheckpoint,
    DeepSpeedStrategy,
    FSDPCheckpoint,
    FSDPStrategy,
)
from schemas import ShardRef, commit_files, local_path, prepare_stage_dir, read_manifest, storage_errors
from schemas.columns import OPTIMIZER_STATE, POLICY_CHECKPOINT
from schemas.shards import ShardNotCommittedError, release_stage_lock

log = logging.getLogger("rft_core.stages")

OPTIMIZER_STAGE = OPTIMIZER_STATE.stage  # "optimizer_state"

_LOCK = threading.Lock()
# the page-locked host copies of the last CUDA state of each kind staged for a background write, by
# the name of their buffers ("optimizer": an AdamW state; "policy": a model's weights): (its layout,
# the stager holding its buffers); a write still running may be reading them (writer.buffers_in_use)
_STAGED: dict[str, tuple[tuple, BlockingAsyncStager]] = {}


def optimizer_state_uri(update: ShardRef) -> str:
    """URI of the optimizer stage belonging to the ``ppo_update`` stage ``update``: the sibling
    folder ``{name}-optimizer``."""
    return update.uri.rstrip("/") + OPTIMIZER_FOLDER_SUFFIX


def optimizer_commit(update: ShardRef) -> Commit:
    """Where and under what the optimizer stage of ``update`` commits: its config hash is
    determined by that update alone."""
    return stage_commit(OptimizerStateInput(update=update, out=optimizer_state_uri(update)))


def _write_stage(commit: Commit, write: Callable[[str], None], *, schema, files: list[str] | None,
                 inputs: dict[str, ShardRef], summary: dict) -> ShardRef:
    """Commit a stage of files only: ``write(folder)`` writes them into the stage folder (or, on a
    non-local filesystem, into a local temporary folder that is then uploaded), then the manifest
    (``commit_files``: ``files``, None for every file written) with ``summary`` and its ``seconds``.
    The stage's writer lock is released if anything fails.

    Raises:
        StorageError: a write or the upload failed (names the URI).
    """
    uri, t0 = commit.uri, time.perf_counter()
    token = prepare_stage_dir(uri)
    try:
        with storage_errors(uri):
            local = local_path(uri)
            if local is not None:
                write(local)
            else:
                with tempfile.TemporaryDirectory(prefix="rft-stage-") as tmp:
                    write(tmp)
                    fs, path = fsspec.core.url_to_fs(uri)
                    fs.put(tmp.rstrip("/") + "/", path.rstrip("/") + "/", recursive=True)
        ref = commit_files(uri, stage=schema.stage, config_hash=commit.config_hash, files=files, inputs=inputs,
                           summary={**summary, "seconds": time.perf_counter() - t0}, schema=schema, lock_token=token,
                           contract=commit.contract)
    except BaseException:
        release_stage_lock(uri, token)
        raise
    log.info("%s: committed %s (%.2f s)", schema.stage, uri, time.perf_counter() - t0)
    return ref


def _write(update: ShardRef, state: dict, summary: dict) -> ShardRef:
    return _write_stage(optimizer_commit(update), lambda folder: save_optimizer_state(state, os.path.join(folder, OPTIMIZER_FILE)),
                        schema=OPTIMIZER_STATE, files=[OPTIMIZER_FILE], inputs={"ppo_update": update}, summary=summary)


def _write_policy(update: ShardRef, model, saver, digest: str, state: dict | None) -> ShardRef:
    """Write ``model`` (its weights from ``state``, a host copy of its ``state_dict``, when given)
    and ``saver`` (tokenizer or processor) as ``policy/`` of the sibling stage
    ``policy_checkpoint_uri(update)`` and commit it (its summary repeats the weights' ``digest``
    the update recorded). Runs only after ``update``'s optimizer stage committed (the writer's order)."""
    commit = stage_commit(PolicyCheckpointInput(update=update, out=policy_checkpoint_uri(update)))
    if _committed(update) is None:
        raise OptimizerStateError(f"{commit.uri}: not written, since the optimizer state of {update.uri} did not commit "
                                  "(a policy checkpoint always has its AdamW state)")
    return _write_stage(commit, lambda folder: save_checkpoint(model, saver, None, os.path.join(folder, "policy"),
                                                               state_dict=state),
                        schema=POLICY_CHECKPOINT, files=None, inputs={"ppo_update": update},
                        summary={WEIGHTS_DIGEST_KEY: digest})


def _layout(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """(path, shape, dtype, device type) of every tensor in a nested dict/list/tuple."""
    if isinstance(value, torch.Tensor):
        yield path, tuple(value.shape), value.dtype, value.device.type
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _layout(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _layout(v, (*path, i))


def stage_on_host(state: dict, *, device: str = "cuda", buffers: str = "optimizer") -> tuple[dict, bool]:
    """``state`` as a background write should read it: where it holds CUDA tensors, a copy in
    page-locked host memory made now (torch's ``BlockingAsyncStager(cache_staged_state_dict=True)``,
    what ``torch.distributed.checkpoint.async_save`` stages through; its buffers reused by the
    next call with the same layout), so the writer never touches the GPU: it neither waits on nor
    stalls the next rollout's kernels with one synchronous device-to-host copy per tensor, and
    the next update may step while it writes. Left as it is (False): no CUDA tensor, more bytes
    than half the host's available memory (``psutil.virtual_memory``), which the writer then reads
    from the device as before, or (a fresh, unpinned copy, False) a background write of this
    process still running, which may be reading the reused buffers.

    Args:
        device: the device type whose tensors are staged ("cuda"; the tests stage "cpu" ones).
        buffers: the name of the reused buffers ("optimizer", "policy"): one set per kind of state.
    Returns:
        (the state to write, whether it lies in the reused buffers).
    """
    layout = tuple(_layout(state))
    if not any(kind == device for *_, kind in layout):
        return state, False
    size = sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype, _ in layout)
    if size > psutil.virtual_memory().available // 2:
        log.info("optimizer_state: %.1f GB of CUDA %s state is written from the device (over half the host's "
                 "available memory)", size / 1e9, buffers)
        return state, False
    if writer.buffers_in_use(buffers):
        return BlockingAsyncStager().stage(state), False
    with _LOCK:
        if buffers not in _STAGED or _STAGED[buffers][0] != layout:
            _STAGED[buffers] = (layout, BlockingAsyncStager(cache_staged_state_dict=True))
        stager = _STAGED[buffers][1]
    return stager.stage(state), True


def release_host_staging() -> None:
    """Drop the page-locked buffers ``stage_on_host`` keeps (once the writes reading them are
    joined): what a run does when it ends (``rft_core.api.release_run``)."""
    with _LOCK:
        _STAGED.clear()


def _staged_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor] | None, bool]:
    """A model's ``state_dict`` ``weights`` staged on the host (``stage_on_host``, buffers
    "policy") with its tied tensors still one tensor (a tied ``lm_head.weight`` is the staged
    ``embed_tokens`` weight), so that ``save_pretrained(state_dict=...)`` drops the tied names as
    it does for the model's own tensors and writes the same file. (None, False): not staged."""
    first: dict[tuple, str] = {}
    alias: dict[str, str] = {}
    for name, t in weights.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        alias[name] = first.setdefault(key, name)
    unique = {name: weights[name] for name in weights if alias[name] == name}
    staged, reused = stage_on_host(unique, buffers="policy")
    if staged is unique:
        return None, False
    return {name: staged[alias[name]] for name in weights}, reused


def commit_policy_checkpoint(update: ShardRef, model, saver, *, digest: str) -> None:
    """Queue the write of ``model``'s weights (and ``saver``'s tokenizer or processor files) as the
    sibling stage ``{update}-policy`` on the writer thread, after the optimizer stage queued
    before it (the module docstring); ``wait_for_optimizer_writes`` joins it. CUDA weights are
    written from a page-locked host copy made now (``stage_on_host``, buffers "policy"; not a peft
    model's, which saves its adapters from its own tensors); otherwise the caller must not change
    the weights until the write has finished (``writes_reading_tensors``).

    Raises (from the writer, through ``wait_for_optimizer_writes``):
        OptimizerStateError: the optimizer stage of ``update`` did not commit (nothing written).
    """
    state, reused = None, False
    if not hasattr(model, "get_base_model"):
        state, reused = _staged_weights(model.state_dict())
    writer.submit(policy_checkpoint_uri(update), _write_policy, update, model, saver, digest, state,
                  copied=state is not None, buffers="policy" if reused else None)


def commit_optimizer_state(update: ShardRef, state: dict, *, background: bool,
                           summary: dict | None = None) -> ShardRef | None:
    """Write ``state`` (``optimizer.state_dict()``, tensors on CPU) as the optimizer stage of
    ``update`` and commit it.

    ``background``: return None at once and write in this process's writer thread (one at a
    time, in submission order, at a lower CPU priority), from a page-locked host copy of a CUDA
    state (``stage_on_host``); ``wait_for_optimizer_writes`` joins it. Unless it was copied so, the
    caller must not modify the tensors of ``state`` until then (``writes_reading_tensors``; the
    update then queues ``wait_for_writes_of`` before its strategy's next step). Otherwise write
    now and return the ShardRef.

    Raises:
        ShardExistsError: (not in the background) the optimizer stage is already committed.
    """
    summary = dict(summary or {})
    if not background:
        return _write(update, state, summary)
    staged, reused = stage_on_host(state)
    writer.submit(optimizer_state_uri(update), _write, update, staged, summary, copied=staged is not state,
                  buffers="optimizer" if reused else None)
    return None


def commit_sharded_optimizer_state(update: ShardRef, strategy: DeepSpeedStrategy | FSDPStrategy, *,
                                   summary: dict | None = None) -> ShardRef:
    """Write the sharded state of ``strategy`` as the optimizer stage of ``update`` and commit
    it: under DeepSpeed the ZeRO state (every rank its partition of the AdamW moments and float32
    master weights: DeepSpeed's ``engine.save_checkpoint``, tag ``DEEPSPEED_TAG``), under FSDP2
    the ``torch.distributed.checkpoint`` of the float32 master shards and AdamW state (folder
    ``FSDP_TAG``, every rank its shards); then, after every rank has written, rank 0 lists
    every file with its size and checksum in ``_MANIFEST.json`` (``commit_files``), written last.
    A collective: call it on every rank. On a non-local run root each rank saves into a local
    temporary folder and uploads what it wrote.

    Args:
        summary: extra manifest summary entries (rank 0's count).
    Returns:
        the committed stage's ref, on every rank.
    Raises:
        ShardExistsError: (rank 0; OptimizerStateError on the others) the stage is committed.
        ShardLockedError: another live writer holds the stage.
        StorageError: the storage refused a write (named stage and cause).
    """
    commit = optimizer_commit(update)
    uri = commit.uri
    t0 = time.perf_counter()
    token: str | None = None
    err: BaseException | None = None
    if strategy.rank == 0:
        try:
            token = prepare_stage_dir(uri)  # the lock, leftovers of an interrupted attempt cleared
        except BaseException as exc:  # noqa: BLE001 - every rank raises below
            err = exc
    try:
        raise_if_any_failed(strategy, err, f"{uri}: taking the writer lock")
        info = sharded_format(strategy)
        err = save_partitions(strategy, uri, info["tag"])
        raise_if_any_failed(strategy, err, f"{uri}: uploading the {info['format']} shards")
        ref: ShardRef | None = None
        if strategy.rank == 0:
            try:
                ref = commit_files(uri, stage=OPTIMIZER_STAGE, config_hash=commit.config_hash, inputs={"ppo_update": update},
                                   summary={**info, **(summary or {}), "seconds": time.perf_counter() - t0},
                                   schema=OPTIMIZER_STATE, lock_token=token, contract=commit.contract)
            except BaseException as exc:  # noqa: BLE001 - every rank raises below
                err = exc
        raise_if_any_failed(strategy, err, f"{uri}: committing the manifest")
    except BaseException:
        if token is not None:
            release_stage_lock(uri, token)
        raise
    if ref is None:
        ref = commit.committed(check_files=False)
        if ref is None:
            raise OptimizerStateError(f"{uri}: rank 0 reported the commit but no manifest is visible from rank "
                                      f"{strategy.rank} (is the run root shared by every node?)")
    if strategy.rank == 0:
        what = "FSDP2" if isinstance(strategy, FSDPStrategy) else f"DeepSpeed ZeRO-{strategy.zero_stage}"
        log.info("optimizer_state: committed %s (%s, %d ranks, %.2f s)", uri, what, strategy.world_size,
                 time.perf_counter() - t0)
    return ref


def recover_deepspeed_optimizer_state(strategy: DeepSpeedStrategy | FSDPStrategy, done: ShardRef, *,
                                      weights_match: Callable[[Any, ShardRef], bool]) -> ShardRef:
    """Commit the optimizer stage of the committed DeepSpeed (or FSDP2) update ``done`` from ``strategy``,
    which has just recomputed that update from the same committed inputs and seeds; the
    recomputed weights (gathered, a collective) are checked on rank 0 with
    ``weights_match(model_with_save_pretrained, done)`` against the committed checksums (a
    mismatch, possible with nondeterministic GPU kernels, is logged and training goes on). A
    collective: call it on every rank.

    Returns:
        the committed optimizer stage (its summary has ``recovered`` and ``weights_match``).
    """
    state = strategy.full_state_dict()
    summary = None
    if strategy.rank == 0:
        module = strategy.module
        saver = SimpleNamespace(save_pretrained=lambda out, **kw: module.save_pretrained(out, state_dict=state, **kw))
        match = weights_match(saver, done)
        if match:
            log.info("ppo_update: recomputed the lost sharded optimizer state of %s (weights match the commit)",
                     done.uri)
        else:
            log.warning("ppo_update: recomputed the lost sharded optimizer state of %s, but the recomputed weights "
                        "differ from the committed ones (nondeterministic kernels?); training goes on with it", done.uri)
        summary = {"recovered": True, "weights_match": match}
    return commit_sharded_optimizer_state(done, strategy, summary=summary)


def _committed(update: ShardRef) -> ShardRef | None:
    return optimizer_commit(update).committed(check_files=False)


def optimizer_state_committed(update: ShardRef) -> bool:
    """Whether the optimizer stage of the committed ``ppo_update`` ``update`` is committed."""
    return _committed(update) is not None


def _kept_elsewhere(update: ShardRef) -> bool:
    """Whether ``update`` has no optimizer stage by design: an update between checkpoints whose
    state stayed in a resident worker's memory (its manifest records the weights' digest
    instead of weight files). A DeepSpeed update has one (``commit_sharded_optimizer_state``).

    Raises:
        ShardNotCommittedError: ``update`` is not a committed stage.
    """
    manifest, _ = read_manifest(update.uri)
    return WEIGHTS_DIGEST_KEY in manifest.summary


def optimizer_state_missing(update: ShardRef) -> bool:
    """True when the committed ``ppo_update`` ``update`` should have a committed optimizer
    stage and has none: its background write was lost (a crash, or a failed write, which is
    logged). Waits for a pending write of that stage first."""
    try:
        wait_for_optimizer_writes(optimizer_state_uri(update))
    except OptimizerStateError as exc:
        log.warning("%s", exc)
    return _committed(update) is None and not _kept_elsewhere(update)


def writes_pending(update: ShardRef) -> list[str]:
    """The URIs of the background writes of ``update``'s state queued in this process that no
    ``wait_for_optimizer_writes`` has joined yet (its optimizer stage, its policy checkpoint),
    finished or not; [] when none."""
    return writer.pending([optimizer_state_uri(update), policy_checkpoint_uri(update)])


def writes_reading_tensors(update: ShardRef) -> list[str]:
    """Those of ``writes_pending(update)`` that read the caller's own tensors (a policy
    checkpoint's weights or an optimizer state not copied when it was queued, ``stage_on_host``):
    the caller must not change them before ``wait_for_writes_of(update)``. A write that reads a
    copy (a CUDA state staged on the host) leaves the caller free to step at once; its commit
    still comes before the next update's, which looks its state up (``optimizer_state_ref``)
    before it commits."""
    return writer.reading_tensors([optimizer_state_uri(update), policy_checkpoint_uri(update)])


def wait_for_writes_of(update: ShardRef) -> None:
    """Join the pending background writes of ``update``'s state (``writes_pending``), in order.

    Raises:
        OptimizerStateError: one failed (as ``wait_for_optimizer_writes``).
    """
    for uri in writes_pending(update):
        wait_for_optimizer_writes(uri)


def optimizer_state_key(policy: ShardRef | str) -> str | None:
    """What a ``ppo_update`` starting from ``policy`` hashes for the optimizer state it continues:
    the config hash of ``policy``'s optimizer stage (``optimizer_commit``, a function of
    ``policy``'s manifest alone), or None where ``optimizer_state_ref`` gives None (an initial
    model, a state kept in a resident worker's memory). Unlike the stage's manifest sha256, it is
    known while the background write is still running: the next update looks up its commit and
    starts its forward and backward passes without waiting, and waits before its first optimizer
    step (``SingleProcess.wait_before_step``, queued by the writer's caller).

    Raises:
        OptimizerStateError: no write is pending and the state is missing (as ``optimizer_state_ref``).
    """
    if not isinstance(policy, ShardRef):
        return None
    if optimizer_state_uri(policy) in writes_pending(policy):
        return optimizer_commit(policy).config_hash
    ref = optimizer_state_ref(policy)
    return None if ref is None else ref.config_hash


def optimizer_state_ref(policy: ShardRef | str) -> ShardRef | None:
    """The committed optimizer stage a ``ppo_update`` starting from ``policy`` loads (an
    ``optimizer.pt`` stage or a DeepSpeed one, ``deepspeed_checkpoint``), waiting for a pending
    background write of it. None: ``policy`` is an initial model, or kept its state in a
    resident worker's memory.

    Raises:
        OptimizerStateError: the state is missing (a lost background write, or a DeepSpeed
            update that stopped before its state was committed), or its pending write failed;
            the message says to resume the run, which recomputes it.
    """
    if not isinstance(policy, ShardRef):
        return None
    wait_for_optimizer_writes(policy_checkpoint_uri(policy))  # a background checkpoint reads the weights: done first
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
        "stopped before its write finished). Rerun the training flow on this run root: resuming that "
        "iteration recomputes it (AdamW is never restarted silently)")


def optimizer_state_dir(ref: ShardRef) -> str:
    """Local folder holding ``optimizer.pt`` of the committed optimizer stage ``ref`` (a
    non-local one is downloaded once into the cache, keyed by its manifest checksum).

    Raises:
        CheckpointPrunedError: the state was pruned (``checkpoint.keep_last``).
    """
    return policy_checkpoint_dir(ref, subdir="")


def saved_optimizer_state(opt_ref: ShardRef | None, *, deepspeed: bool, fsdp: bool = False
                          ) -> tuple[str | None, DeepSpeedCheckpoint | FSDPCheckpoint | None]:
    """What ``build_strategy`` continues from the committed optimizer stage ``opt_ref``:
    (folder holding ``optimizer.pt``, None) for a single-process update, (None, the
    ``DeepSpeedCheckpoint``) for a DeepSpeed one and (None, the ``FSDPCheckpoint``) for an
    FSDP2 one (their folder resolved once per node, a collective), (None, None) without a stage.

    Raises:
        DeepSpeedStateError: a state written by another kind of update than this one (single
            process, DeepSpeed, FSDP2: update.deepspeed or update.fsdp changed within a run),
            naming the stage and both kinds.
        CheckpointPrunedError: the state was pruned (``checkpoint.keep_last``).
    """
    if opt_ref is None:
        return None, None
    info = read_manifest(opt_ref.uri)[0].summary
    now = FSDP_FORMAT if fsdp else DEEPSPEED_FORMAT if deepspeed else None
    check_kind(info if "format" in info else None, now, source=opt_ref.uri, keys="update.deepspeed and update.fsdp")
    if now is None:
        return optimizer_state_dir(opt_ref), None
    return None, continued_state(info, lambda: optimizer_state_dir(opt_ref), source=opt_ref.uri)
