"""Shared plumbing of the stage programs: reuse-or-compute, timing, policy references."""
from __future__ import annotations

import logging
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import fsspec
import pyarrow as pa

from rft_core.stages.contracts import StageInput
from rft_core.stages.lineage import weights_stage
from rft_core.stages.retention import CHECKPOINT_STAGES, latest_policy_checkpoint
from rft_core.stages.sharded_state import raise_if_any_failed, save_partitions, sharded_format, sharded_state_folder
from rft_core.training.checkpoint import save_checkpoint
from rft_core.training.strategy import DeepSpeedStrategy, FSDPStrategy, SingleProcess
from schemas import (
    OlderVersionError,
    ShardRef,
    StageSchema,
    commit_files,
    committed_ref,
    local_path,
    prepare_stage_dir,
    split_stage_uri,
    stage_uri,
    storage_errors,
    write_parts,
    write_shard,
)
from schemas.shards import release_stage_lock

log = logging.getLogger("rft_core.stages")



@dataclass(frozen=True)
class Commit:
    """Where and under what a stage program commits: its folder, stage, config hash and
    stage contract (pass them on to ``write_shard`` / ``commit_files``)."""

    uri: str
    stage: str
    config_hash: str
    contract: str

    def write(self, table: pa.Table, *, schema: StageSchema, inputs: Mapping[str, ShardRef] | None = None,
              summary: Mapping[str, Any] | None = None,
              side_tables: Mapping[str, tuple[pa.Table, StageSchema]] | None = None) -> ShardRef:
        """``write_shard`` of ``table`` (and its ``side_tables``) as this commit."""
        return write_shard(table, self.uri, schema=schema, config_hash=self.config_hash, inputs=inputs, summary=summary,
                           contract=self.contract, side_tables=side_tables)

    def committed(self, *, check_files: bool = True) -> ShardRef | None:
        """The committed ref to reuse, or None (see ``schemas.committed_ref``).

        Raises:
            OlderVersionError: as ``committed_ref``; its message also gives the command that
                starts a new run from the run's last policy checkpoint (``continue_from_checkpoint``).
        """
        try:
            return committed_ref(self.uri, stage=self.stage, config_hash=self.config_hash, contract=self.contract,
                                 check_files=check_files)
        except OlderVersionError as exc:
            raise OlderVersionError(f"{exc}{continue_from_checkpoint(self.uri)}") from exc


def continue_from_checkpoint(uri: str) -> str:
    """The sentence an ``OlderVersionError`` of the stage at ``uri`` ends with: the command that
    starts a new run from the last committed policy checkpoint of the run ``uri`` belongs to
    (``latest_policy_checkpoint``: its ``iter=N/ppo_update[-policy]/policy`` folder, an HF model folder
    that ``policy.path`` takes); '' when ``uri`` is not a stage folder of a run."""
    where = split_stage_uri(uri)
    if where is None:
        return ""
    root = where[0]
    fs, path = fsspec.core.url_to_fs(root)
    found = (re.search(r"/iter=(\d+)$", p.rstrip("/")) for p in fs.glob(f"{path.rstrip('/')}/iter=*"))
    iterations = [int(m.group(1)) for m in found if m]
    last = latest_policy_checkpoint(root, max(iterations)) if iterations else None
    if last is None:
        return " No iteration of this run committed a policy checkpoint: a new run folder starts from the initial policy."
    held = weights_stage(ShardRef.from_manifest(stage_uri(root, last, "ppo_update")))
    checkpoint = f"{held.uri}/{CHECKPOINT_STAGES['ppo_update']}"
    return (f" Or start a new run from this run's last checkpoint (iteration {last}): rft train -c <your config> "
            f"--set policy.path={checkpoint} (without this --run-root: a new run folder, counting iterations from 1 "
            "with a fresh optimizer; with a KL term also --set reference.path=<the policy.path this run started "
            "from>, so its reference stays the initial model).")


def stage_commit(inp: StageInput, *, uri: str | None = None, stage: str | None = None, **derived: Any) -> Commit:
    """The ``Commit`` of ``inp`` (``uri``/``stage``: for a program that commits several stages),
    its config hash extended by ``derived`` values (``StageInput.config_hash``)."""
    return Commit(uri=uri or inp.out, stage=stage or inp.stage, config_hash=inp.config_hash(**derived),
                  contract=inp.contract)


def reuse_or_compute(commit: Commit, compute: Callable[[], ShardRef | None]) -> ShardRef | None:
    """The committed ShardRef of ``commit`` when it exists, else ``compute()``.

    Raises:
        StaleShardError: the folder was committed with another config hash (never overwritten).
        OlderVersionError: it was committed under another stage contract.
    """
    ref = commit.committed()
    if ref is not None:
        log.info("%s: reusing committed shard %s (config %s)", commit.stage, commit.uri, commit.config_hash)
        return ref
    return compute()


class Timer:
    """Context manager measuring wall seconds into ``.seconds``."""

    def __enter__(self) -> "Timer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0


def commit_checkpoint(commit: Commit, *, subdir: str, model, tokenizer, optimizer, steps: list, schema: StageSchema,
                      inputs: Mapping[str, ShardRef], summary: dict, save_weights: bool = True,
                      lock_token: str | None = None) -> ShardRef:
    """Commit a training stage: per-step metric rows (dataclasses, one per optimizer step) as
    Parquet parts plus an HF checkpoint (with the optimizer state unless ``optimizer`` is None)
    under ``{commit.uri}/{subdir}``, all under one manifest written last (with every other file
    in the folder: a sharded optimizer state the ranks wrote first, ``commit_trained``). Works on
    any fsspec URI (remote: saved to a local temp folder, then uploaded). ``summary`` gains
    ``checkpoint_seconds``. ``save_weights=False``: the metrics parts only (a resident worker,
    or stage mode keeping its models, keeps the weights in memory; ``checkpoint.every``).
    ``lock_token``: the caller already holds the stage's writer lock (``prepare_stage_dir``);
    it is released when this fails, as one taken here."""
    out = commit.uri
    token = lock_token if lock_token is not None else prepare_stage_dir(out)
    try:
        with Timer() as t_save, storage_errors(out):
            local = local_path(out)
            if not save_weights:
                pass
            elif local is not None:
                save_checkpoint(model, tokenizer, optimizer, f"{local}/{subdir}")
            else:
                tmp = tempfile.mkdtemp(prefix="rft-ckpt-")
                try:
                    save_checkpoint(model, tokenizer, optimizer, tmp)
                    fs, path = fsspec.core.url_to_fs(out)
                    fs.put(tmp.rstrip("/") + "/", f"{path.rstrip('/')}/{subdir}", recursive=True)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        table = pa.table({k: [asdict(s)[k] for s in steps] for k in schema.schema.names}, schema=schema.arrow)
        rows = write_parts(table, out, schema=schema)
        return commit_files(out, stage=schema.stage, config_hash=commit.config_hash, num_rows=table.num_rows, inputs=inputs,
                            summary={**summary, "checkpoint_seconds": t_save.seconds}, schema=schema, rows_per_file=rows,
                            lock_token=token, contract=commit.contract)
    except BaseException:
        release_stage_lock(out, token)
        raise


class _WithStateDict:
    """``model`` whose ``save_pretrained`` writes ``state_dict`` (weights gathered from ZeRO ranks)."""

    def __init__(self, model, state_dict) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, out, **kw) -> None:
        self.model.save_pretrained(out, state_dict=self.state_dict, **kw)


def commit_trained(commit: Commit, strategy: SingleProcess | DeepSpeedStrategy | FSDPStrategy, *, subdir: str,
                   tokenizer, steps: list, schema: StageSchema, inputs: Mapping[str, ShardRef], summary: dict,
                   keep_optimizer: bool, save_weights: bool = True) -> ShardRef:
    """Commit what ``strategy`` trained (``commit_checkpoint``). One process: the model, with
    its AdamW state inside the checkpoint when ``keep_optimizer``. DeepSpeed: the weights are
    gathered on every rank (a collective), rank 0 commits them (the summary records world_size
    and zero_stage), the other ranks wait for the commit and return the same ref. FSDP2
    likewise: the weights gathered to rank 0 (``FSDPStrategy.full_state_dict``, in the dtypes
    they were loaded in), the summary records world_size and ``sharding: fsdp2``. Their sharded
    AdamW state (and float32 masters): with ``keep_optimizer`` (the critic) every rank writes its
    part into ``{subdir}-optimizer/`` of this stage after rank 0 took the stage's lock and before
    rank 0's manifest, which lists those files too and records their format under
    ``summary["optimizer"]`` (``rft_core.stages.sharded_state``; the next critic update continues
    it); without it (the policy) the caller commits it as its optimizer stage
    (``rft_core.stages.optimizer_state.commit_sharded_optimizer_state``).

    Raises:
        OptimizerStateError: (the other ranks) taking the lock or writing the sharded state failed
            on a peer; that rank raises its own error.
    """
    if isinstance(strategy, SingleProcess):
        return commit_checkpoint(commit, subdir=subdir, model=strategy.model, tokenizer=tokenizer,
                                 optimizer=strategy.optimizer if keep_optimizer else None, steps=steps, schema=schema,
                                 inputs=inputs, summary=summary, save_weights=save_weights)
    state = strategy.full_state_dict() if save_weights else None
    token, extra = None, {}
    if keep_optimizer and save_weights:
        token, extra = _save_sharded_state(commit.uri, strategy, subdir)
    ref = None
    if strategy.rank == 0:
        layout = ({"sharding": "fsdp2"} if isinstance(strategy, FSDPStrategy) else {"zero_stage": strategy.zero_stage})
        ref = commit_checkpoint(commit, subdir=subdir, model=_WithStateDict(strategy.module, state), tokenizer=tokenizer,
                                optimizer=None, steps=steps, schema=schema, inputs=inputs,
                                summary={**summary, "world_size": strategy.world_size, **layout, **extra},
                                save_weights=save_weights, lock_token=token)
    strategy.barrier()
    if ref is None:
        ref = commit.committed()
        assert ref is not None, f"rank 0 did not commit {commit.uri}"
    return ref


def _save_sharded_state(uri: str, strategy: DeepSpeedStrategy | FSDPStrategy, subdir: str) -> tuple[str | None, dict]:
    """``commit_trained``'s sharded AdamW state, a collective: rank 0 takes the writer lock of
    the stage folder ``uri`` (clearing an interrupted attempt's files), then every rank writes its
    part into ``sharded_state_folder(subdir)``. Returns (rank 0's lock token, None on the others;
    the summary entries ``{"optimizer": sharded_format, "optimizer_seconds": the write's seconds}``);
    the lock is released on a failure.

    Raises:
        OptimizerStateError: a peer failed (this rank's own error otherwise).
    """
    token, err = None, None
    if strategy.rank == 0:
        try:
            token = prepare_stage_dir(uri)
        except BaseException as exc:  # noqa: BLE001 - every rank raises below
            err = exc
    t0 = time.perf_counter()
    try:
        raise_if_any_failed(strategy, err, f"{uri}: taking the writer lock")
        info = sharded_format(strategy)
        err = save_partitions(strategy, f"{uri.rstrip('/')}/{sharded_state_folder(subdir)}", info["tag"])
        raise_if_any_failed(strategy, err, f"{uri}: writing the {info['format']} optimizer state")
    except BaseException:
        if token is not None:
            release_stage_lock(uri, token)
        raise
    return token, {"optimizer": info, "optimizer_seconds": time.perf_counter() - t0}
