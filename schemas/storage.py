"""Storage primitives under the shard contract (``schemas.shards``), for any fsspec filesystem:
which writes are atomic or exclusive where (local disk, object stores), checksums of files (and
the ones this process already knows), and storage failures (disk full, read-only,
permission) turned into errors that name the stage and the run.
"""
from __future__ import annotations

import contextlib
import errno as _errno
import hashlib
import os
import re
import shutil
import threading
import uuid
from typing import Any, Callable, Iterator

import fsspec
import xxhash

from schemas.layout import split_stage_uri, stage_spec, stage_uri

_ITER = re.compile(r"iter=(\d{6})$")

MANIFEST_NAME = "_MANIFEST.json"
# protocols whose single-object PUT is atomic and which have no rename (a "move" is copy + delete)
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``uri`` and the path on it (without a trailing slash)."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path.rstrip("/")


def local_path(uri: str) -> str | None:
    """The local filesystem path of ``uri``, or None when it is not on the local filesystem."""
    fs, path = filesystem(uri)
    return local_path_of(fs, path)


def local_path_of(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """``path`` when ``fs`` is the local filesystem, else None."""
    from fsspec.implementations.local import LocalFileSystem

    return path if isinstance(fs, LocalFileSystem) else None


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is an object store (S3, GCS, Azure, ...): a PUT is atomic, there is no rename."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in OBJECT_STORE_PROTOCOLS for p in protocols)


def fresh_listing(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop fsspec's cached listings of ``path`` (s3fs caches directory listings: another
    process's writes would otherwise stay invisible to this one)."""
    fs.invalidate_cache(path)


def put_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Create ``path`` holding ``data`` unless it exists.

    Local disk: ``O_CREAT | O_EXCL``. Other filesystems: ``pipe_file(mode="create")``, which
    s3fs sends as a conditional PUT (``If-None-Match: *``): the server refuses the second of two
    concurrent creates. Filesystems without conditional writes fall back to fsspec's check-then-
    write (not atomic: two writers can both succeed).

    Raises:
        FileExistsError: ``path`` exists.
    """
    local = local_path_of(fs, path)
    if local is not None:
        fd = os.open(local, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException as exc:  # e.g. no space left: leave no empty file behind
            with contextlib.suppress(OSError):
                os.unlink(local)
            raise _named(exc, local)
        return
    try:
        fs.pipe_file(path, data, mode="create")
    except TypeError:  # an fsspec implementation without the mode argument
        if fs.exists(path):
            raise FileExistsError(path) from None
        fs.pipe_file(path, data)
    finally:
        fresh_listing(fs, path)


def atomic_put(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader never sees a partial file: under a temporary
    name, then renamed into place (atomic on local disk); on an object store one PUT, which is
    atomic there (a rename would be a copy plus a delete: twice the traffic, no gain)."""
    if is_object_store(fs):
        fs.pipe_file(path, data)
        fresh_listing(fs, path)
        return
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{name}"
    try:
        fs.pipe_file(tmp, data)
    except OSError as exc:
        raise _named(exc, path)
    fs.mv(tmp, path)


def _named(exc: BaseException, path: str) -> BaseException:
    """``exc`` with ``path`` as its file name when it is an OSError without one (a failed
    ``write`` names no file), to raise in its place."""
    if isinstance(exc, OSError) and exc.errno and not exc.filename:
        named = type(exc)(exc.errno, exc.strerror or str(exc), path)
        named.__cause__ = exc
        return named
    return exc


# The file checksums a manifest records (``FileEntry``), by the name of its field: XXH3-128 since
# manifest version 2 (the ``xxhash`` package, https://github.com/Cyan4973/xxHash), sha256 in the
# manifests written before. On this project's 2-core CPU XXH3-128 hashes a 0.4B model's 5.6 GB
# checkpoint in 0.5-0.9 s where sha256 (1.4 GB/s with the SHA extensions) took 3.8-5.4 s
# (benchmarks/checksums.py): time on the background writer's and on a loading stage's path. Both
# detect a corrupted or truncated file; neither is a signature (a manifest is not signed, so
# whoever can rewrite a file can rewrite its manifest).
CHECKSUMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
CHECKSUM = "xxh3_128"  # what new manifests record


def file_checksum(fs: fsspec.AbstractFileSystem, path: str, algorithm: str = CHECKSUM) -> tuple[int, str]:
    """(size in bytes, ``"<algorithm>:<hex>"``) of a file, read in 4 MiB chunks.

    Raises:
        ValueError: ``algorithm`` is not one of ``CHECKSUMS``.
    """
    h = _hasher(algorithm)
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, f"{algorithm}:{h.hexdigest()}"


def bytes_checksum(data: bytes, algorithm: str = CHECKSUM) -> str:
    """``"<algorithm>:<hex>"`` of ``data`` (what ``file_checksum`` gives for a file holding it)."""
    h = _hasher(algorithm)
    h.update(data)
    return f"{algorithm}:{h.hexdigest()}"


def checksum_algorithm(checksum: str) -> str:
    """The algorithm of a ``"<algorithm>:<hex>"`` checksum.

    Raises:
        ValueError: not of that form, or an algorithm not in ``CHECKSUMS``.
    """
    algorithm, sep, _ = checksum.partition(":")
    if not sep or algorithm not in CHECKSUMS:
        raise ValueError(f"{checksum!r}: not a file checksum '<algorithm>:<hex>' with an algorithm of {sorted(CHECKSUMS)}")
    return algorithm


def _hasher(algorithm: str):
    if algorithm not in CHECKSUMS:
        raise ValueError(f"{algorithm!r}: not a file checksum algorithm (known: {sorted(CHECKSUMS)})")
    return CHECKSUMS[algorithm]()


# the checksums of local files this process hashed or wrote: path -> (size, mtime_ns, checksum), so a
# checkpoint committed (and hashed) by this process is not hashed again when a later stage loads it
_VERIFIED: dict[str, tuple[int, int, str]] = {}
_VERIFIED_LOCK = threading.Lock()


def remember_checksum(fs: fsspec.AbstractFileSystem, path: str, checksum: str) -> None:
    """Record that the local file ``path``, as it is now (size, mtime), has ``checksum``
    (``"<algorithm>:<hex>"``)."""
    local = local_path_of(fs, path)
    if local is not None:
        st = os.stat(local)
        with _VERIFIED_LOCK:
            _VERIFIED[local] = (st.st_size, st.st_mtime_ns, checksum)


def verified(fs: fsspec.AbstractFileSystem, path: str, checksum: str) -> bool:
    """Whether the file ``path`` has ``checksum`` (``"<algorithm>:<hex>"``, the algorithm the
    manifest recorded): hashed now, or known from this process (a local file whose size and
    mtime are those recorded with that checksum).

    Raises:
        ValueError: ``checksum`` names no known algorithm.
    """
    algorithm = checksum_algorithm(checksum)
    local = local_path_of(fs, path)
    if local is not None:
        st = os.stat(local)
        with _VERIFIED_LOCK:
            if _VERIFIED.get(local) == (st.st_size, st.st_mtime_ns, checksum):
                return True
    got = file_checksum(fs, path, algorithm)[1]
    if got == checksum:
        remember_checksum(fs, path, got)
    return got == checksum


class StorageError(OSError):
    """Writing a stage failed in the storage itself: no space left, quota exceeded, read-only
    filesystem, permission denied, I/O error. ``errno`` is the cause's; the message names the
    stage, the run, the file and the cause, and says that nothing of the stage was committed."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# errno -> what to do about it
_STORAGE_ERRNOS = {
    _errno.ENOSPC: "free space (or keep fewer checkpoints: checkpoint.keep_last, checkpoint.keep_weights_last) "
                   "and rerun the same command: the run resumes at this stage",
    _errno.EDQUOT: "free space under the quota and rerun the same command: the run resumes at this stage",
    _errno.EROFS: "the filesystem is mounted read-only: choose a writable run_root",
    _errno.EACCES: "this user may not write there: fix the permissions (or the bucket policy) or choose another run_root",
    _errno.EPERM: "this user may not write there: fix the permissions (or the bucket policy) or choose another run_root",
    _errno.EIO: "the storage reported an I/O error: check the disk (or the object store) and rerun the same command",
}


def _free_space(uri: str) -> str:
    """`` (12.0 KiB free of 40.0 MiB)`` for a local ``uri`` (its nearest existing parent), else ''."""
    path = local_path(uri)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    if not path:
        return ""
    usage = shutil.disk_usage(path)
    return f" ({_human(usage.free)} free of {_human(usage.total)} on that filesystem)"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_stage(uri: str) -> str:
    """``stage iter=2/ppo_update of run s3://b/r`` for a stage folder of the run layout, else the URI."""
    where = split_stage_uri(uri)
    return f"stage {stage_spec(where[1], where[2])} of run {where[0]}" if where else uri


@contextlib.contextmanager
def storage_errors(uri: str, *, action: str = "writing") -> Iterator[None]:
    """Turn an ``OSError`` of the storage (no space, quota, read-only, permission, I/O) raised
    inside the block into a ``StorageError`` whose message names the stage folder ``uri``, its
    run, the file and the cause; other exceptions pass unchanged.

    Raises:
        StorageError: as above (``errno`` kept; the original is its ``__cause__``).
    """
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        code = exc.errno if exc.errno in _STORAGE_ERRNOS else (_errno.EACCES if isinstance(exc, PermissionError) else None)
        if code is None:
            raise
        cause = exc.strerror or str(exc) or type(exc).__name__
        file = f" at {exc.filename}" if exc.filename else ""
        raise StorageError(code, (
            f"{action} {describe_stage(uri)} failed{file}: {cause} [errno {code}: {_errno.errorcode.get(code, code)}]"
            f"{_free_space(uri) if code in (_errno.ENOSPC, _errno.EDQUOT) else ''}. Nothing of this stage was "
            f"committed (it has no {MANIFEST_NAME}) and the committed stages are untouched; {_STORAGE_ERRNOS[code]}."
        )) from exc


def repair_hint(uri: str) -> str:
    """The sentence a corruption error ends with: the command that recomputes the stage at
    ``uri`` and what depends on it (``rft repair``: ``rft_core.storage``), when ``uri`` is a stage of a run."""
    where = split_stage_uri(uri)
    if where is None:
        return ""
    return (f". To recompute this stage and the stages that depend on it (moved aside, nothing else touched): "
            f"rft repair {where[0]} --stage {stage_spec(where[1], where[2])}, "
            "then rerun the same training command")


def stage_folders(run_root: str) -> Iterator[tuple[int, str, str]]:
    """(iteration, stage, stage URI) of every stage folder of ``run_root``
    (``iter=NNNNNN/<stage>``), in iteration and name order; the listing is read fresh (no cached
    listing of an object store hides another process's commit).

    Raises:
        FileNotFoundError: ``run_root`` does not exist.
    """
    fs, root = filesystem(run_root)
    fs.invalidate_cache(root)
    if not fs.exists(root):
        raise FileNotFoundError(f"run folder {run_root!r} does not exist")
    for it_dir in sorted(fs.ls(root, detail=False)):
        m = _ITER.search(it_dir.rstrip("/"))
        if not m or not fs.isdir(it_dir):
            continue
        for st_dir in sorted(fs.ls(it_dir, detail=False)):
            if fs.isdir(st_dir):
                stage = st_dir.rstrip("/").rsplit("/", 1)[-1]
                yield int(m.group(1)), stage, stage_uri(run_root, int(m.group(1)), stage)
