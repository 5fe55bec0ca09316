"""The shard contract: atomic, manifest-committed Parquet shards under any fsspec URI.

Write protocol (``write_shard`` / ``commit_files``):
  1. refuse if ``_MANIFEST.json`` already exists (a committed stage is never overwritten);
  2. take the stage's writer lock, remove leftovers of an interrupted attempt (anything in the
     folder without a manifest);
  3. write each part (local disk: under a temporary name, then renamed to ``part-NNNNN.parquet``;
     an object store: one PUT, which is atomic there: the object appears whole or not at all);
  4. write ``_MANIFEST.json`` last: it is the commit point (local: temporary name + rename; an
     object store: a conditional PUT, ``If-None-Match: *``, so of two writers only one commits).

A reader trusts only the manifest: rows, files, sizes, checksums (XXH3-128 since manifest
version 2, sha256 before: ``schemas.storage.CHECKSUMS``), schema fingerprint,
config hash and the inputs that produced the shard; a folder whose manifest is missing is never
accepted, whatever parts it holds. Parquet parts are written and read in ``schemas.tables``.

Object stores have no rename and no exclusive create, except through conditional writes: the
writer lock and the manifest use ``pipe_file(mode="create")``, which s3fs sends as S3's
``If-None-Match: *`` (AWS S3 since 2024, MinIO and moto honour it). What that guarantees and
what it does not is in ``docs/reliability.md`` ("Object storage").

A write that fails in the storage itself (disk full, quota, read-only, permission) raises
``StorageError``, which names the stage, the run, the file and the cause.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os

import psutil
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping, Union

import fsspec
from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from schemas.columns import StageSchema
from schemas.layout import split_stage_uri
from schemas.storage import (  # noqa: F401 - re-exported: the shard contract's storage primitives
    MANIFEST_NAME,
    OBJECT_STORE_PROTOCOLS,
    StorageError,
    atomic_put,
    bytes_checksum,
    checksum_algorithm,
    describe_stage,
    file_checksum,
    filesystem,
    fresh_listing,
    is_object_store,
    local_path,
    local_path_of,
    put_exclusive,
    remember_checksum,
    repair_hint,
    storage_errors,
    verified,
)

# 2: files carry an XXH3-128 checksum (FileEntry.xxh3_128), where version 1 carried sha256
MANIFEST_VERSION = 2


class ShardError(ValueError):
    """Base class: a shard cannot be used. The message names the URI and what is wrong."""


class NewerManifestError(ShardError):
    """A manifest of a newer manifest version than this code reads (``MANIFEST_VERSION``): written
    by a newer version of this project, which this one cannot check (version 2, for instance,
    records XXH3-128 checksums where version 1 recorded sha256)."""


class ShardNotCommittedError(ShardError):
    """No manifest: the stage never finished (or was interrupted before its commit)."""


class ShardCorruptError(ShardError):
    """A committed file is missing, truncated, or its checksum does not match the manifest."""


class ShardSchemaError(ShardError):
    """A column is missing, has the wrong dtype, or the schema stage/version differs."""


class ShardExistsError(ShardError):
    """A committed shard already exists where a writer was asked to write."""


class StaleShardError(ShardError):
    """A committed shard exists but was produced with another config hash."""


class ShardLockedError(ShardError):
    """Another live writer holds the stage's lock; the message names it."""


LOCK_NAME = ".writer.lock"
PRUNED_NAME = "_PRUNED.json"
LOCK_TTL_SECONDS = float(os.environ.get("RFT_LOCK_TTL_SECONDS", 6 * 3600))


def acquire_stage_lock(uri: str) -> str:
    """Take the writer lock of a stage folder; return its token.

    The lock is created exclusively (``put_exclusive``: ``O_EXCL`` on local disk, a conditional
    PUT on S3), so two writers can never both create it. A lock whose writer is gone is taken
    over: same host and that pid no longer runs (a killed worker), or older than
    ``RFT_LOCK_TTL_SECONDS`` (default 6 h; writers on other hosts). Taking over is delete +
    create: two writers taking over the same dead lock at the same moment can, on an object
    store without conditional deletes, both end up believing they hold it; the conditional
    manifest PUT (``commit_files``) still lets only one of them commit.

    Raises:
        ShardLockedError: a live writer holds the lock (named: host, pid, since when).
    """
    fs, path = filesystem(uri)
    if not is_object_store(fs):  # object stores have no folders (and s3fs would create a missing bucket)
        fs.makedirs(path, exist_ok=True)
    lpath = f"{path}/{LOCK_NAME}"
    token = uuid.uuid4().hex
    info = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    data = json.dumps(info).encode()
    for _ in range(5):
        try:
            put_exclusive(fs, lpath, data)
        except FileExistsError:
            pass
        else:
            if local_path(uri) is not None or is_object_store(fs) or json.loads(fs.cat_file(lpath)).get("token") == token:
                return token
        try:
            held = json.loads(fs.cat_file(lpath))
        except FileNotFoundError:
            continue  # released meanwhile: try again
        except ValueError:  # empty or half-written: a writer between its create and its write, or killed there
            if _age_seconds(fs, lpath) < 5:
                time.sleep(0.5)
                continue
            held = {}  # stale: nobody finishes writing a lock after seconds
        pid = int(held.get("pid", -1))  # no pid: only the TTL can make the lock stale
        stale = (held.get("host") == info["host"] and pid >= 0 and not psutil.pid_exists(pid)) or \
            time.time() - float(held.get("since", 0)) > LOCK_TTL_SECONDS
        if not stale:
            raise ShardLockedError(
                f"{uri}: being written by host {held.get('host')} pid {held.get('pid')} since "
                f"{_dt.datetime.fromtimestamp(float(held.get('since', 0))).isoformat(timespec='seconds')}; "
                "wait for it or stop it")
        fs.rm(lpath)
        fresh_listing(fs, lpath)
    raise ShardLockedError(f"{uri}: could not take the writer lock")


def _age_seconds(fs, path: str) -> float:
    """Seconds since ``path`` was last modified (0 when that cannot be told)."""
    try:
        return max(0.0, time.time() - fs.modified(path).timestamp())
    except (OSError, NotImplementedError, AttributeError):
        return 0.0


def release_stage_lock(uri: str, token: str) -> None:
    """Remove the lock if ``token`` still holds it."""
    fs, path = filesystem(uri)
    lpath = f"{path}/{LOCK_NAME}"
    try:
        if json.loads(fs.cat_file(lpath)).get("token") == token:
            fs.rm(lpath)
    except (FileNotFoundError, ValueError):
        pass


class FileEntry(BaseModel):
    """One committed file: path relative to the shard folder, size in bytes, its checksum (hex):
    ``xxh3_128`` in manifests of version 2 on, ``sha256`` in those written before (exactly one of
    the two; ``checksum`` gives either as ``"<algorithm>:<hex>"``), and its rows (Parquet parts).

    Raises:
        pydantic.ValidationError: neither or both checksums.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    bytes: int
    xxh3_128: str | None = None
    sha256: str | None = None
    rows: int | None = None

    @model_validator(mode="after")
    def _one_checksum(self) -> "FileEntry":
        if (self.xxh3_128 is None) == (self.sha256 is None):
            raise ValueError(f"{self.path}: a file entry has exactly one checksum, xxh3_128 or sha256")
        return self

    @model_serializer(mode="wrap")
    def _without_the_other_checksum(self, handler):
        return {k: v for k, v in handler(self).items() if not (k in ("xxh3_128", "sha256") and v is None)}

    @property
    def checksum(self) -> str:
        """``"<algorithm>:<hex>"``: what ``schemas.storage.verified`` checks the file against."""
        return f"xxh3_128:{self.xxh3_128}" if self.xxh3_128 is not None else f"sha256:{self.sha256}"

    @classmethod
    def of(cls, path: str, size: int, checksum: str, rows: int | None = None) -> "FileEntry":
        """The entry of ``path`` with ``checksum`` (``"<algorithm>:<hex>"``, ``file_checksum``'s)."""
        algorithm = checksum_algorithm(checksum)
        return cls(path=path, bytes=size, rows=rows, **{algorithm: checksum.partition(":")[2]})


class Manifest(BaseModel):
    """The commit record of one stage's output (``_MANIFEST.json``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    manifest_version: int = MANIFEST_VERSION
    stage: str
    schema_version: int | None
    schema_fingerprint: str | None
    config_hash: str
    num_rows: int
    files: list[FileEntry]
    inputs: dict[str, str]  # input name -> that input's manifest sha256
    summary: dict[str, Any] = {}
    created_at: str
    # the stage contract that wrote it ("<stage> v<N>", rft_core.stages.contracts); None: written
    # before stage contracts existed. A config hash is only comparable under the same contract.
    contract: str | None = None


class ShardRef(BaseModel):
    """A reference to a committed shard; what tasks return and flows pass on.

    ``manifest_sha256`` identifies the exact content: downstream config hashes include it, so a
    recomputed upstream stage invalidates everything after it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    uri: str
    stage: str
    num_rows: int
    config_hash: str
    manifest_sha256: str

    @classmethod
    def from_manifest(cls, uri: str) -> "ShardRef":
        """The ref of the stage committed at ``uri``, read from its manifest.

        Raises:
            ShardNotCommittedError: no manifest at ``uri``.
            ShardCorruptError: the manifest is not a valid manifest.
        """
        manifest, sha = read_manifest(uri)
        return _ref(uri, manifest, sha)


# A policy (or critic, or reference) is either a model path (an initial model: alias, folder or
# hub id) or the ShardRef of a committed training stage whose sub-folder is an HF checkpoint.
PolicyRef = Union[str, ShardRef]


def _canonical(obj: Any) -> Any:
    if isinstance(obj, ShardRef):
        return {"shard": obj.manifest_sha256}
    if isinstance(obj, BaseModel):
        return _canonical(obj.model_dump(mode="json"))
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


def config_hash(*parts: Any) -> str:
    """sha256 (hex, first 16 chars) of the canonical JSON of ``parts``.

    Pydantic models are dumped in JSON mode, ShardRefs reduce to their manifest sha256.
    """
    text = json.dumps(_canonical(list(parts)), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_manifest(uri: str) -> tuple[Manifest, str]:
    """Read and parse ``{uri}/_MANIFEST.json``.

    Returns:
        (manifest, sha256 of the manifest bytes).
    Raises:
        ShardNotCommittedError: no manifest at ``uri``.
        NewerManifestError: the manifest's ``manifest_version`` is newer than ``MANIFEST_VERSION``.
        ShardCorruptError: the manifest is not valid JSON or not a manifest.
    """
    fs, path = filesystem(uri)
    mpath = f"{path}/{MANIFEST_NAME}"
    fresh_listing(fs, path)
    try:
        raw = fs.cat_file(mpath)
    except FileNotFoundError:
        raise ShardNotCommittedError(f"{uri}: no {MANIFEST_NAME}; the stage has not committed") from None
    except IsADirectoryError as exc:
        raise ShardCorruptError(f"{uri}/{MANIFEST_NAME}: a folder, not a manifest") from exc
    try:
        manifest = Manifest.model_validate_json(raw)
    except Exception as exc:  # pydantic.ValidationError or JSON error
        _refuse_newer(uri, _peek_version(raw))
        raise ShardCorruptError(f"{uri}/{MANIFEST_NAME}: not a valid manifest: {exc}") from exc
    _refuse_newer(uri, manifest.manifest_version)
    return manifest, hashlib.sha256(raw).hexdigest()


def _peek_version(raw: bytes) -> Any:
    """The ``manifest_version`` of manifest bytes that did not validate (None: not a JSON object)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data.get("manifest_version") if isinstance(data, dict) else None


def _refuse_newer(uri: str, version: Any) -> None:
    if isinstance(version, int) and version > MANIFEST_VERSION:
        raise NewerManifestError(
            f"{uri}/{MANIFEST_NAME}: manifest version {version}, written by a newer version of prefect-rft; this one "
            f"reads versions up to {MANIFEST_VERSION}. Use the newer version for this run root.")


def _ref(uri: str, manifest: Manifest, sha: str) -> ShardRef:
    return ShardRef(uri=uri, stage=manifest.stage, num_rows=manifest.num_rows,
                    config_hash=manifest.config_hash, manifest_sha256=sha)


class OlderVersionError(StaleShardError):
    """A committed stage was written under another stage contract (another version of this
    project): its config hash cannot be compared with this version's. The message names the
    stage, its iteration, both contract ids, and how to go on (``older_version_message``)."""


def _contract_version(contract: str | None) -> tuple[str, int] | None:
    """(program, version) of a contract id ``"<program> v<version>"``, or None."""
    program, _, version = (contract or "").rpartition(" v")
    return (program, int(version)) if program and version.isdigit() else None


def older_version_message(uri: str, old: str | None, new: str) -> str:
    """Why the stage committed at ``uri`` under contract ``old`` (None: before contracts
    existed) is refused by this version, which writes ``new``, and how to go on: resume with
    the version that wrote it, or a new run folder. ``rft_core.stages.common`` adds the command
    that starts a new run from the run's last checkpoint."""
    was, now = _contract_version(old), _contract_version(new)
    if old is None or (was and now and was[0] == now[0] and was[1] < now[1]):
        who = "an older version of prefect-rft"
    elif was and now and was[0] == now[0] and was[1] > now[1]:
        who = "a newer version of prefect-rft"
    else:
        who = "another version of prefect-rft"
    where = split_stage_uri(uri)
    stage = f"stage {where[2]!r} of iteration {where[1]}" if where else "this stage"
    return (f"{uri}: {stage} was written by {who} (stage contract {old or 'none'}; this version writes {new}): what "
            "its settings mean changed since, so its config hash cannot be compared with this run's and it is not "
            "reused (committed results are never overwritten). To go on: resume this run with the version that wrote "
            "it, or start a new run folder (--run-root <new folder>, or no --run-root for a new timestamped one).")


def committed_ref(uri: str, *, stage: str, config_hash: str, contract: str | None = None,
                  check_files: bool = True) -> ShardRef | None:
    """The ShardRef of a committed stage that may be reused, or None when it must be computed.

    Returns None when no manifest exists (never run, or interrupted before its commit).

    Args:
        contract: the stage contract the caller computes ``config_hash`` under; a manifest
            written under another one (or none) is refused as written by another version.
    Raises:
        OlderVersionError: the manifest was written under another stage contract.
        StaleShardError: a manifest exists with another config hash or stage; a committed
            result is never silently overwritten (use a new run root).
        ShardCorruptError: with ``check_files``, a committed file is missing or has another size,
            or a Parquet part's checksum differs from the manifest's (the parts are small; the
            checkpoint files are checked when they are loaded, ``schemas.tables.verify_files``).
    """
    try:
        manifest, sha = read_manifest(uri)
    except ShardNotCommittedError:
        return None
    if manifest.config_hash != config_hash and contract is not None and manifest.contract != contract:
        raise OlderVersionError(older_version_message(uri, manifest.contract, contract))
    if manifest.stage != stage or manifest.config_hash != config_hash:
        raise StaleShardError(
            f"{uri}: committed by stage {manifest.stage!r} with config hash {manifest.config_hash}, "
            f"but this run asks for stage {stage!r} with config hash {config_hash}; the config or an "
            "upstream shard changed. Use a new run root (committed results are never overwritten)."
        )
    if check_files:
        fs, path = filesystem(uri)
        pruned = pruned_files(uri)
        for entry in manifest.files:
            if entry.path in pruned:  # removed on purpose (checkpoint retention), not corruption
                continue
            fpath = f"{path}/{entry.path}"
            if not fs.exists(fpath):
                raise ShardCorruptError(f"{uri}: manifest lists {entry.path} but the file is missing")
            size = fs.size(fpath)
            if size != entry.bytes:
                raise ShardCorruptError(f"{uri}/{entry.path}: {size} bytes, manifest says {entry.bytes}{repair_hint(uri)}")
            if entry.rows is not None and not verified(fs, fpath, entry.checksum):
                raise ShardCorruptError(f"{uri}/{entry.path}: checksum does not match the manifest (corrupted){repair_hint(uri)}")
    return _ref(uri, manifest, sha)


def pruned_files(uri: str) -> dict[str, str]:
    """{path relative to ``uri``: why} of the committed files ``prune_files`` removed; {} when
    none were.

    Raises:
        ShardCorruptError: ``_PRUNED.json`` exists but is not a JSON object of strings.
    """
    fs, path = filesystem(uri)
    ppath = f"{path}/{PRUNED_NAME}"
    if not fs.exists(ppath):
        return {}
    try:
        data = json.loads(fs.cat_file(ppath))
    except ValueError as exc:
        raise ShardCorruptError(f"{uri}/{PRUNED_NAME}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ShardCorruptError(f"{uri}/{PRUNED_NAME}: expected an object {{path: reason}}")
    return data


def prune_files(uri: str, paths: Iterable[str], *, reason: str) -> list[str]:
    """Delete committed files that are not Parquet parts (checkpoint weights, optimizer state)
    from a committed stage, to bound a run's storage.

    The manifest is never rewritten (downstream stages reference it by sha256): the removed
    paths are recorded in ``{uri}/_PRUNED.json`` first, then deleted, so a crash in between
    leaves only recorded files behind, and ``committed_ref`` treats recorded files as removed on
    purpose, not as corruption. Pruning a file already pruned is a no-op.

    Returns:
        the paths deleted now (sorted).
    Raises:
        ShardNotCommittedError: the stage has no manifest.
        ValueError: a path the manifest does not list, or a Parquet part (rows would be lost).
    """
    manifest, _ = read_manifest(uri)
    entries = {e.path: e for e in manifest.files}
    paths = sorted(set(paths))
    for rel in paths:
        if rel not in entries:
            raise ValueError(f"{uri}: cannot prune {rel!r}: the manifest does not list it")
        if entries[rel].rows is not None:
            raise ValueError(f"{uri}: cannot prune {rel!r}: it is a Parquet part of the shard")
    done = pruned_files(uri)
    todo = [rel for rel in paths if rel not in done]
    if not todo:
        return []
    fs, path = filesystem(uri)
    atomic_put(fs, f"{path}/{PRUNED_NAME}", json.dumps({**done, **{rel: reason for rel in todo}}, indent=1, sort_keys=True).encode())
    for rel in todo:
        if fs.exists(f"{path}/{rel}"):
            fs.rm_file(f"{path}/{rel}")
    return todo


def prepare_stage_dir(uri: str) -> str:
    """Take the stage's writer lock and clear leftovers of an interrupted attempt.

    Returns:
        the lock token, to pass to ``commit_files`` (which releases it) or to
        ``release_stage_lock`` when the attempt fails.
    Raises:
        ShardExistsError: the folder holds a committed manifest.
        ShardLockedError: another live writer is writing this stage.
    """
    fs, path = filesystem(uri)
    fresh_listing(fs, path)
    if fs.exists(f"{path}/{MANIFEST_NAME}"):
        raise ShardExistsError(f"{uri}: already committed; refusing to overwrite it")
    with storage_errors(uri):
        token = acquire_stage_lock(uri)
    try:
        fresh_listing(fs, path)
        if fs.exists(f"{path}/{MANIFEST_NAME}"):  # committed by a writer that finished just now
            raise ShardExistsError(f"{uri}: already committed by another writer; refusing to overwrite it")
        with storage_errors(uri):
            for entry in fs.ls(path, detail=False):
                if entry.rstrip("/").rsplit("/", 1)[-1] != LOCK_NAME:
                    fs.rm(entry, recursive=True)  # leftovers of an interrupted attempt (we hold the lock)
    except BaseException:
        release_stage_lock(uri, token)
        raise
    return token


def commit_files(
    uri: str,
    *,
    stage: str,
    config_hash: str,
    files: Iterable[str] | None = None,
    num_rows: int = 0,
    inputs: Mapping[str, ShardRef] | None = None,
    summary: Mapping[str, Any] | None = None,
    schema: StageSchema | None = None,
    rows_per_file: Mapping[str, int] | None = None,
    lock_token: str | None = None,
    contract: str | None = None,
) -> ShardRef:
    """Write the manifest for files already written under ``uri`` (the commit point), then
    release the writer lock ``lock_token`` (from ``prepare_stage_dir``).

    Used directly for checkpoints (HF folders) and by ``write_shard`` for Parquet parts.

    Args:
        files: paths relative to ``uri``; default: every file below it except temporaries.
        inputs: the ShardRefs this output was computed from (recorded by manifest sha256).
        contract: the stage contract ``config_hash`` was computed under (recorded).
    Raises:
        ShardExistsError: a manifest already exists at ``uri`` (also when another writer's
            conditional PUT of it won just now, on an object store).
        StorageError: the storage refused a write (no space, read-only, permission).
    """
    fs, path = filesystem(uri)
    mpath = f"{path}/{MANIFEST_NAME}"
    fresh_listing(fs, path)
    if fs.exists(mpath):
        raise ShardExistsError(f"{uri}: already committed; refusing to overwrite it")
    entries = _file_entries(fs, path, _stage_files(fs, path) if files is None else list(files), rows_per_file or {})
    manifest = Manifest(
        stage=stage,
        schema_version=schema.version if schema else None,
        schema_fingerprint=schema.fingerprint if schema else None,
        config_hash=config_hash,
        num_rows=num_rows,
        files=entries,
        inputs={k: v.manifest_sha256 for k, v in (inputs or {}).items()},
        summary=dict(summary or {}),
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
        contract=contract,
    )
    raw = manifest.model_dump_json(indent=1).encode()
    _put_manifest(fs, mpath, raw, uri=uri)
    if lock_token is not None:
        release_stage_lock(uri, lock_token)
    return _ref(uri, manifest, hashlib.sha256(raw).hexdigest())


def _stage_files(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Every file below the stage folder ``path`` (relative, sorted) but temporaries
    (``.tmp-*``), the manifest and the writer lock."""
    found = fs.find(path)
    return sorted(
        p[len(path) + 1:] for p in (f.rstrip("/") for f in found)
        if not p.rsplit("/", 1)[-1].startswith(".tmp-") and not p.endswith(MANIFEST_NAME) and not p.endswith(LOCK_NAME)
    )


def _file_entries(fs: fsspec.AbstractFileSystem, path: str, files: list[str],
                  rows_per_file: Mapping[str, int]) -> list[FileEntry]:
    """The manifest entries (size, XXH3-128 checksum, rows) of ``files`` below ``path``; each
    checksum is remembered for later verification (``remember_checksum``)."""
    # hashed on a few threads: xxhash (>= 3.0) and hashlib release the GIL while they hash, and an object store's
    # reads overlap
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(files)))) as pool:
        sums = list(pool.map(lambda rel: file_checksum(fs, f"{path}/{rel}"), files))
    for rel, (_, checksum) in zip(files, sums):
        remember_checksum(fs, f"{path}/{rel}", checksum)
    return [FileEntry.of(rel, size, checksum, rows_per_file.get(rel)) for rel, (size, checksum) in zip(files, sums)]


def _put_manifest(fs: fsspec.AbstractFileSystem, mpath: str, raw: bytes, *, uri: str) -> None:
    """Write the manifest bytes ``raw`` at ``mpath``: the commit point (an atomic rename on a
    local folder, a conditional PUT where an object store has one).

    Raises:
        ShardExistsError: another writer's manifest won the conditional write just now.
        StorageError: the storage refused the write.
    """
    with storage_errors(uri, action="committing"):
        if local_path_of(fs, mpath) is not None:
            atomic_put(fs, mpath, raw)
        else:
            try:
                put_exclusive(fs, mpath, raw)  # the commit point: a conditional PUT where the store has one
            except FileExistsError:
                raise ShardExistsError(f"{uri}: committed by another writer a moment ago (its manifest won the "
                                       "conditional write); this attempt's result is discarded") from None


