"""A sharded trainer's AdamW state on storage (DeepSpeed ZeRO's partitions, FSDP2's
``torch.distributed.checkpoint`` shards): every rank writes its own part into one folder
(``save_partitions``), the manifest summary says what wrote it and what the next update must match
(``sharded_format``: a DeepSpeed state needs the same world size, ZeRO stage and dtype, an FSDP2
one the same dtype on any number of ranks), and the next update's ranks find it again
(``sharded_checkpoint``, ``folder_once_per_node``).

Two stages hold such a state: the policy's optimizer stage ``iter=K/ppo_update-optimizer`` (its
own manifest, written after the update: ``rft_core.stages.optimizer_state``) and the critic's
``critic_update``, whose ``critic-optimizer/`` folder is written by every rank before rank 0's
manifest lists it with the critic's weights (``rft_core.stages.common.commit_trained``), so the
next critic update continues its AdamW moments and float32 masters as a single-process critic
continues its ``critic/optimizer.pt``.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any, Callable

import fsspec
import torch

from rft_core.stages.writer import OptimizerStateError
from rft_core.training.checkpoint import OPTIMIZER_FOLDER_SUFFIX
from rft_core.training.fsdp import FSDP_TAG, init_process_group
from rft_core.training.strategy import (
    DeepSpeedCheckpoint,
    DeepSpeedStateError,
    DeepSpeedStrategy,
    FSDPCheckpoint,
    FSDPStrategy,
    init_distributed,
)
from schemas import local_path, storage_errors

# manifest summary of a DeepSpeed state: {"format": DEEPSPEED_FORMAT, "tag", "world_size", "zero_stage",
# "bf16", "deepspeed_version"} (the policy's optimizer stage adds "seconds")
DEEPSPEED_FORMAT = "deepspeed"
DEEPSPEED_TAG = "zero"
# ... of an FSDP2 one: {"format": FSDP_FORMAT, "tag", "world_size", "bf16", "torch_version"}
FSDP_FORMAT = "fsdp"
# what wrote a state of each format, in errors ("... written by a DeepSpeed update")
KINDS = {DEEPSPEED_FORMAT: "a DeepSpeed", FSDP_FORMAT: "an FSDP2", None: "a single-process"}


def sharded_state_folder(subdir: str) -> str:
    """The folder of a training stage holding the sharded AdamW state of its ``subdir/``
    checkpoint (``rft_core.stages.common.commit_trained`` with ``keep_optimizer``):
    ``critic-optimizer`` for ``critic``."""
    return f"{subdir}{OPTIMIZER_FOLDER_SUFFIX}"


def raise_if_any_failed(strategy: DeepSpeedStrategy | FSDPStrategy, exc: BaseException | None, what: str) -> None:
    """A collective: raise on every rank when ``exc`` is set on any (this rank's own ``exc``
    as it is, the others an ``OptimizerStateError`` naming ``what``), so that no rank waits
    for a peer that gave up."""
    failed = int(strategy.all_reduce_sum([0.0 if exc is None else 1.0])[0])
    if exc is not None:
        raise exc
    if failed:
        raise OptimizerStateError(f"{what} failed on {failed} other rank(s) (see their log lines)")


def save_partitions(strategy: DeepSpeedStrategy | FSDPStrategy, uri: str, tag: str) -> BaseException | None:
    """Every rank writes its part of the sharded state (``strategy.save_state``, a collective)
    into the folder ``uri``: directly where it is a local folder, else into a local temporary
    folder that it then uploads. Returns the upload's error on this rank (None: uploaded), for
    ``raise_if_any_failed``; a failed save raises here (a collective every rank is in).

    Raises:
        StorageError: the save refused a write (named stage and cause).
    """
    local = local_path(uri)
    if local is not None:
        with storage_errors(uri):
            strategy.save_state(local, tag)  # a collective; every rank writes into the stage folder
        return None
    err: BaseException | None = None
    tmp = tempfile.mkdtemp(prefix="rft-ds-opt-")
    try:
        with storage_errors(uri):
            strategy.save_state(tmp, tag)  # each rank's folder holds what this rank wrote
        try:
            with storage_errors(uri):
                fs, path = fsspec.core.url_to_fs(uri)
                fs.put(tmp.rstrip("/") + "/", path.rstrip("/"), recursive=True)
        except BaseException as exc:  # noqa: BLE001 - every rank raises in raise_if_any_failed
            err = exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return err


def sharded_format(strategy: DeepSpeedStrategy | FSDPStrategy) -> dict[str, Any]:
    """The manifest summary that says what wrote a sharded state and what the next update must
    match (``sharded_checkpoint``)."""
    if isinstance(strategy, FSDPStrategy):
        return {"format": FSDP_FORMAT, "tag": FSDP_TAG, "world_size": strategy.world_size, "bf16": strategy.bf16,
                "torch_version": torch.__version__}
    import deepspeed

    return {"format": DEEPSPEED_FORMAT, "tag": DEEPSPEED_TAG, "world_size": strategy.world_size,
            "zero_stage": strategy.zero_stage, "bf16": strategy.bf16, "deepspeed_version": deepspeed.__version__}


def sharded_checkpoint(info: dict[str, Any], folder: str, *, source: str,
                       role: str = "policy") -> DeepSpeedCheckpoint | FSDPCheckpoint | None:
    """The saved state that ``info`` (a ``sharded_format`` summary) describes, whose files are in
    the local ``folder`` (DeepSpeed: ``folder/latest`` and ``folder/{tag}/``; FSDP2: its DCP folder
    ``folder/{tag}``), named ``source`` in errors; None for another format (a single-process
    ``optimizer.pt``). ``role``: ``"policy"`` or ``"critic"``, whose settings a refusal names."""
    if info.get("format") == DEEPSPEED_FORMAT:
        return DeepSpeedCheckpoint(folder=folder, tag=str(info["tag"]), world_size=int(info["world_size"]),
                                   zero_stage=int(info["zero_stage"]), bf16=bool(info["bf16"]), source=source,
                                   role=role)
    if info.get("format") == FSDP_FORMAT:
        return FSDPCheckpoint(folder=os.path.join(folder, str(info["tag"])), world_size=int(info["world_size"]),
                              bf16=bool(info["bf16"]), source=source, role=role)
    return None


def folder_once_per_node(resolve: Callable[[], str], *, source: str, init: Callable[[], tuple[int, int]]) -> str:
    """``resolve()`` (a local folder of a committed state: checked against its manifest, downloaded
    into the cache when remote) run by local rank 0 of each node and shared with that node's other
    ranks, so that a node hashes and downloads the state once. A collective over the job's ranks
    (``init``: the process group of the strategy that loads it, DeepSpeed's or FSDP2's; returns
    (rank, world size)).

    Raises:
        the error of ``resolve`` on local rank 0 (``CheckpointPrunedError``,
        ``ShardCorruptError``); ``OptimizerStateError`` naming ``source`` on the node's other ranks.
    """
    import torch.distributed as dist

    _, world = init()
    host = socket.gethostname()
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    folder, err = None, None
    if first:
        try:
            folder = resolve()
        except BaseException as exc:  # noqa: BLE001 - shared below, re-raised here
            err = exc
    if world == 1:
        if err is not None:
            raise err
        assert folder is not None
        return folder
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (host, first, folder, None if err is None else f"{type(err).__name__}: {err}"))
    if err is not None:
        raise err
    if first:
        assert folder is not None
        return folder
    for g_host, g_first, g_folder, g_err in gathered:
        if g_first and g_host == host:
            if g_err is not None:
                raise OptimizerStateError(f"{source}: local rank 0 on {host} could not open the optimizer state: {g_err}")
            return g_folder
    raise OptimizerStateError(f"{source}: no rank with LOCAL_RANK=0 on {host} to open the optimizer state")


def check_kind(info: dict[str, Any] | None, now: str | None, *, source: str, keys: str) -> None:
    """Refuse to continue the state ``info`` describes (a ``sharded_format`` summary; None: a
    single process's ``optimizer.pt``) by an update of another kind ``now`` (``DEEPSPEED_FORMAT``,
    ``FSDP_FORMAT`` or None).

    Raises:
        DeepSpeedStateError: naming ``source``, both kinds, and the settings ``keys`` to keep.
    """
    written = None if info is None else info.get("format")
    if written != now:
        raise DeepSpeedStateError(f"{source}: this optimizer state was written by {KINDS.get(written, written)} "
                                  f"update and cannot be continued by {KINDS[now]} update; keep {keys} the same across "
                                  "a run")


def continued_state(info: dict[str, Any], resolve: Callable[[], str], *, source: str,
                    role: str = "policy") -> DeepSpeedCheckpoint | FSDPCheckpoint | None:
    """The sharded state ``info`` describes, its files in the folder ``resolve()`` gives (resolved
    once per node in the process group of the strategy that loads it: ``folder_once_per_node``,
    a collective), as ``sharded_checkpoint`` hands it to ``build_strategy``."""
    init = init_process_group if info.get("format") == FSDP_FORMAT else init_distributed
    return sharded_checkpoint(info, folder_once_per_node(resolve, source=source, init=init), source=source, role=role)
