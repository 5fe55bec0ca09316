"""A run root's storage: the preflight check before a run starts, verifying every committed
file, and repairing a corrupted stage.

    rft check  RUN_ROOT                      # can this process write there?
    rft verify RUN_ROOT                      # every committed file vs its manifest
    rft repair RUN_ROOT --stage iter=1/ppo_update [--dry-run] [--force]

(the commands are in ``flows/cli.py``; this module is their logic).

``repair`` moves the stage and every committed stage that depends on it into
``{run_root}/_repaired/<timestamp>/`` (nothing is deleted; ``_REPAIR.json`` there says what
moved and why); rerunning the same training command then recomputes exactly those stages and
reuses everything else untouched. What depends on a stage: the stages whose manifest lists it
(or a dependent) among its inputs, and, once a policy or critic update of iteration ``j`` moves,
every stage of the later iterations that has inputs (they start from that checkpoint); the
stages without inputs (``prompts``: data and config only) stay.

Never imports prefect.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import uuid
from dataclasses import dataclass, field

import fsspec

from schemas import (
    ShardError,
    filesystem,
    is_object_store,
    local_path,
    parse_stage_spec,
    read_manifest,
    stage_spec,
    verify_files,
)
from schemas.storage import stage_folders
from schemas.shards import LOCK_NAME, MANIFEST_NAME

REPAIRED_DIR = "_repaired"
REPAIR_RECORD = "_REPAIR.json"
# stages whose output is the checkpoint the next iteration starts from
_CHECKPOINT_STAGES = ("ppo_update", "critic_update")


class RunRootError(ValueError):
    """The run root cannot be used; the message names the URI and the cause."""


# --------------------------------------------------------------------------- preflight


def _preflight_fs(run_root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``run_root`` for the preflight: for S3 a fresh client that gives up
    after one quick try (an unreachable endpoint fails in seconds, not after minutes of retries)."""
    fs, path = filesystem(run_root)
    if "s3" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        opts = dict(fs.storage_options)
        config = {**opts.pop("config_kwargs", {}), "connect_timeout": 5, "read_timeout": 15,
                  "retries": {"max_attempts": 1, "mode": "standard"}}
        fs = type(fs)(**opts, config_kwargs=config, skip_instance_cache=True)
        fs.retries = 1  # s3fs's own retry loop, on top of botocore's
    return fs, path


def _endpoint(fs: fsspec.AbstractFileSystem) -> str:
    url = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f" (endpoint {url})" if url else ""


def _cause(exc: BaseException, fs: fsspec.AbstractFileSystem, path: str, step: str) -> str:
    """What went wrong, in words, from an exception of the filesystem."""
    name, text = type(exc).__name__, str(exc) or type(exc).__name__
    bucket = path.split("/", 1)[0]
    store = is_object_store(fs)
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionError", "ClientConnectorError") or \
            isinstance(exc, (ConnectionError, TimeoutError)):
        return f"cannot reach the storage endpoint{_endpoint(fs)}: {text}"
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return f"no credentials for the object store ({text}): set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
    if store and isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        return f"the bucket {bucket!r} does not exist{_endpoint(fs)}: create it, or fix run_root"
    if isinstance(exc, PermissionError) and re.search(r"access key|signature|security token|credential", text, re.I):
        return f"the credentials were refused{_endpoint(fs)}: {text}"
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) in (13, 1, 30):
        what = ("a read-only bucket, or a policy without s3:PutObject/s3:DeleteObject" if store
                else "a read-only filesystem or folder")
        return f"cannot {step}: {text} ({what}); choose a writable run_root"
    if getattr(exc, "errno", None) == 28:
        return f"cannot {step}: no space left on the device"
    return f"cannot {step}: {name}: {text}"


def check_run_root(run_root: str) -> str:
    """Check, before any stage starts, that this process can create, read back and delete a
    file under ``run_root`` (an existing run root too: resuming writes there). On an object
    store this also proves the bucket exists, the endpoint answers and the credentials are
    accepted.

    Returns:
        one line saying what was checked (and the free space of a local disk).
    Raises:
        RunRootError: names ``run_root`` and the cause: bucket missing, credentials refused,
            endpoint unreachable, no write permission (read-only bucket or folder), disk full.
    """
    fs, path = _preflight_fs(run_root)
    probe = f"{path.rstrip('/')}/.rft-preflight-{uuid.uuid4().hex}"
    step = "create the run folder"
    try:
        if is_object_store(fs):  # no folders there; and s3fs's makedirs would create a missing bucket
            step = "list the bucket"
            fs.ls(path.split("/", 1)[0], detail=False, refresh=True)
        else:
            fs.makedirs(path, exist_ok=True)
        step = "write a file there"
        fs.pipe_file(probe, b"preflight")
        step = "read it back"
        if fs.cat_file(probe) != b"preflight":
            raise RunRootError(f"run_root {run_root!r}: a file written there read back different bytes")
        step = "delete it"
        fs.rm_file(probe)
    except RunRootError:
        raise
    except Exception as exc:  # noqa: BLE001 - botocore/aiohttp errors are not OSErrors; all are named
        raise RunRootError(f"run_root {run_root!r}: {_cause(exc, fs, path, step)}. No stage was started.") from exc
    local = local_path(run_root)
    if local is not None:
        import shutil

        free = shutil.disk_usage(local).free
        return f"run_root {run_root}: writable local folder, {free / 2**30:.1f} GiB free"
    return f"run_root {run_root}: writable ({type(fs).__name__}{_endpoint(fs)})"


# --------------------------------------------------------------------------- the run's stages


@dataclass(frozen=True)
class StageInfo:
    """A stage folder of a run: where, which iteration and stage, its manifest sha256 and the
    manifest sha256s of its inputs (None and () when it has no readable manifest)."""

    uri: str
    iteration: int
    stage: str
    sha256: str | None
    inputs: tuple[str, ...]


def run_stages(run_root: str) -> list[StageInfo]:
    """Every stage folder of ``run_root`` (``iter=NNNNNN/<stage>``), in iteration and name order.

    Raises:
        FileNotFoundError: ``run_root`` does not exist.
    """
    out = []
    for iteration, stage, uri in stage_folders(run_root):
        try:
            manifest, sha = read_manifest(uri)
            out.append(StageInfo(uri, iteration, stage, sha, tuple(manifest.inputs.values())))
        except ShardError:
            out.append(StageInfo(uri, iteration, stage, None, ()))
    return out


def verify_run(run_root: str) -> dict[str, str]:
    """{stage spec: the problem} for every committed stage of ``run_root`` whose manifest is
    unreadable or one of whose files is missing or differs from it (the checksum of every file)."""
    bad = {}
    for st in run_stages(run_root):
        fs, path = filesystem(st.uri)
        if st.sha256 is None and not fs.exists(f"{path}/{MANIFEST_NAME}"):
            continue  # never committed: nothing to verify
        try:
            verify_files(st.uri)
        except ShardError as exc:
            bad[stage_spec(st.iteration, st.stage)] = str(exc).split(". To recompute")[0]
    return bad


# --------------------------------------------------------------------------- repair


@dataclass
class RepairPlan:
    """What ``repair`` moves: the stage asked for, then its dependents, each with the reason."""

    run_root: str
    target: str
    moves: dict[str, str] = field(default_factory=dict)  # stage spec -> why it moves
    problem: str | None = None  # what verification found wrong with the target (None: nothing)
    moved_to: str | None = None


def plan_repair(run_root: str, spec: str) -> RepairPlan:
    """The stages ``repair`` would move for ``spec`` (``iter=N/<stage>``): it, and every
    committed stage that depends on it (see the module docstring).

    Raises:
        ValueError: a malformed ``spec``, or no folder for that stage in the run.
    """
    iteration, stage = parse_stage_spec(spec)
    stages = run_stages(run_root)
    by_spec = {stage_spec(s.iteration, s.stage): s for s in stages}
    target = stage_spec(iteration, stage)
    if target not in by_spec:
        have = ", ".join(sorted(k for k in by_spec if k.startswith(f"iter={iteration}/"))) or "none"
        raise ValueError(f"{run_root}: no stage folder {target} (stages of iteration {iteration}: {have})")
    plan = RepairPlan(run_root=run_root, target=target, moves={target: "asked for"})
    try:
        verify_files(by_spec[target].uri)
    except ShardError as exc:
        plan.problem = str(exc).split(". To recompute")[0]
    changed = True
    while changed:
        changed = False
        moved = [by_spec[k] for k in plan.moves]
        shas = {s.sha256 for s in moved if s.sha256}
        unreadable = [s for s in moved if s.sha256 is None]
        first_ckpt = min((s.iteration for s in moved if s.stage in _CHECKPOINT_STAGES), default=None)
        for s in stages:
            key = stage_spec(s.iteration, s.stage)
            if key in plan.moves or s.sha256 is None:
                continue
            why = None
            if shas & set(s.inputs):
                why = "reads " + ", ".join(k for k, m in zip(plan.moves, moved) if m.sha256 in s.inputs)
            elif first_ckpt is not None and s.iteration > first_ckpt and s.inputs:
                why = f"starts from the checkpoint of iteration {first_ckpt}"
            elif unreadable and s.inputs and s.iteration >= min(u.iteration for u in unreadable):
                why = f"may read {', '.join(stage_spec(u.iteration, u.stage) for u in unreadable)} (manifest unreadable)"
            if why:
                plan.moves[key] = why
                changed = True
    return plan


def repair(run_root: str, spec: str, *, dry_run: bool = False, force: bool = False) -> RepairPlan:
    """Move the stage ``spec`` and its dependents (``plan_repair``) into
    ``{run_root}/_repaired/<UTC timestamp>/`` with a ``_REPAIR.json`` record, so that rerunning
    the training command recomputes exactly them; nothing else in the run is touched.

    Raises:
        ValueError: as ``plan_repair``; or every file of the stage matches its manifest and
            ``force`` is not set (nothing to repair).
        RuntimeError: a stage to move is being written right now (it holds its writer lock).
    """
    plan = plan_repair(run_root, spec)
    if plan.problem is None and not force:
        raise ValueError(f"{run_root}: every file of {plan.target} matches its manifest: nothing to repair "
                         "(--force moves it and its dependents anyway)")
    if dry_run:
        return plan
    fs, root = filesystem(run_root)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest_root = f"{root}/{REPAIRED_DIR}/{stamp}"
    for key in plan.moves:
        it, st = parse_stage_spec(key)
        if fs.exists(f"{root}/iter={it:06d}/{st}/{LOCK_NAME}"):
            raise RuntimeError(f"{run_root}: {key} is being written right now (it holds {LOCK_NAME}); stop the run first")
    fs.makedirs(dest_root, exist_ok=True)
    fs.pipe_file(f"{dest_root}/{REPAIR_RECORD}", json.dumps({
        "run_root": run_root, "stage": plan.target, "problem": plan.problem, "moved": plan.moves,
        "at": stamp}, indent=1).encode())
    for key in plan.moves:  # the asked-for stage first, then dependents in discovery order
        it, st = parse_stage_spec(key)
        src, dst = f"{root}/iter={it:06d}/{st}", f"{dest_root}/iter={it:06d}/{st}"
        fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
        if local_path(run_root) is not None:
            os.rename(src, dst)  # atomic on one filesystem
        else:  # an object store: copy every object, then delete the originals
            files = fs.find(src)
            for f in files:
                fs.copy(f, f"{dst}/{f[len(src) + 1:]}")
            fs.rm(files)
        fs.invalidate_cache(src)
    plan.moved_to = f"{run_root.rstrip('/')}/{REPAIRED_DIR}/{stamp}"
    return plan
