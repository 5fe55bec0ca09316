"""Parquet parts of a shard: schema validation, writing parts and committing them
(``write_shard``), reading a committed shard back with every check (``read_shard``), and
checking a committed stage's other files (checkpoints) against its manifest (``verify_files``).

The commit protocol itself (manifest, locks, checksums) is in ``schemas.shards``.
"""
from __future__ import annotations

import io
import os
from typing import Any, Callable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.columns import StageSchema, schema_for
from schemas.shards import (
    ShardCorruptError,
    ShardRef,
    ShardSchemaError,
    atomic_put,
    bytes_checksum,
    checksum_algorithm,
    commit_files,
    filesystem,
    prepare_stage_dir,
    pruned_files,
    read_manifest,
    release_stage_lock,
    repair_hint,
    storage_errors,
    verified,
)


def _same_type(got: pa.DataType, want: pa.DataType) -> bool:
    """Type equality that ignores the child field names of lists/maps (item vs element)."""
    if pa.types.is_list(got) and pa.types.is_list(want):
        return _same_type(got.value_type, want.value_type)
    if pa.types.is_map(got) and pa.types.is_map(want):
        return _same_type(got.key_type, want.key_type) and _same_type(got.item_type, want.item_type)
    return got == want


def _present_optional(table: pa.Table, expected: StageSchema) -> list[str]:
    """The optional columns of ``expected`` that ``table`` has (``StageSchema.optional``)."""
    return [f.name for f in expected.optional if f.name in table.column_names]


def validate_table(table: pa.Table, expected: StageSchema, *, where: str) -> pa.Table:
    """Check ``table`` against ``expected``; return it with the expected column order (the
    required columns, then the optional ones it has; other columns dropped).

    Raises:
        ShardSchemaError: a missing column or a wrong dtype, named in the message.
    """
    missing = [f.name for f in expected.schema if f.name not in table.column_names]
    if missing:
        raise ShardSchemaError(f"{where}: missing column(s) {missing} for stage {expected.stage!r}")
    present = _present_optional(table, expected)
    for f in [*expected.schema, *(f for f in expected.optional if f.name in present)]:
        got = table.schema.field(f.name).type
        if not _same_type(got, f.type):
            raise ShardSchemaError(f"{where}: column {f.name!r} has dtype {got}, expected {f.type}")
        if not f.nullable and table.column(f.name).null_count:
            raise ShardSchemaError(f"{where}: column {f.name!r} has nulls but is not nullable")
    return table.select([f.name for f in expected.schema] + present)


def _parquet_bytes(table: pa.Table, schema: StageSchema) -> bytes:
    """``table`` (already validated) cast to ``schema`` (with its optional columns present) as one
    zstd Parquet file."""
    table = validate_table(table, schema, where="")
    buf = io.BytesIO()
    pq.write_table(table.cast(schema.arrow_with(_present_optional(table, schema))), buf, compression="zstd")
    return buf.getvalue()


def write_parts(table: pa.Table, uri: str, *, schema: StageSchema, rows_per_part: int = 100_000) -> dict[str, int]:
    """Write ``table`` as Parquet parts into a prepared stage folder (no commit).

    Returns:
        {part file name: rows}, to pass on to ``commit_files``.
    Raises:
        ShardSchemaError: ``table`` does not match ``schema``.
        StorageError: the storage refused a write (no space, read-only, permission), named.
    """
    table = validate_table(table, schema, where=f"writing {uri}")
    table = table.cast(schema.arrow_with(_present_optional(table, schema)))
    fs, path = filesystem(uri)
    rows: dict[str, int] = {}
    n_parts = max(1, -(-table.num_rows // rows_per_part))
    for i in range(n_parts):
        part = table.slice(i * rows_per_part, rows_per_part)
        buf = io.BytesIO()
        pq.write_table(part, buf, compression="zstd")
        name = f"part-{i:05d}.parquet"
        with storage_errors(uri):
            atomic_put(fs, f"{path}/{name}", buf.getvalue())
        rows[name] = part.num_rows
    return rows


def write_shard(
    table: pa.Table,
    uri: str,
    *,
    schema: StageSchema,
    config_hash: str,
    inputs: Mapping[str, ShardRef] | None = None,
    summary: Mapping[str, Any] | None = None,
    rows_per_part: int = 100_000,
    contract: str | None = None,
    side_tables: Mapping[str, tuple[pa.Table, StageSchema]] | None = None,
) -> ShardRef:
    """Atomically write ``table`` as a committed shard of ``schema.stage`` at ``uri``.

    ``side_tables``: {relative path: (table, its schema)} written as single Parquet files next
    to the parts and committed under the same manifest (rows=None: ``read_shard`` skips them;
    ``read_side_table`` reads one back), e.g. a partial rollout's carried sequences. They are
    checked against their schemas before anything is written.

    Raises:
        ShardSchemaError: ``table`` or a side table does not match its schema (checked before
            anything is written).
        ShardExistsError: ``uri`` is already committed.
        ValueError: a side-table path that is not a ``.parquet`` file below the folder, or a part's name.
    """
    validate_table(table, schema, where=f"writing {uri}")
    side = dict(side_tables or {})
    for name, (t, s) in side.items():
        if not name.endswith(".parquet") or name.startswith(("/", ".")) or ".." in name or name.startswith("part-"):
            raise ValueError(f"side table {name!r}: a relative path ending in .parquet, not a part's name")
        validate_table(t, s, where=f"writing {uri}/{name}")
    token = prepare_stage_dir(uri)
    try:
        rows = write_parts(table, uri, schema=schema, rows_per_part=rows_per_part)
        fs, path = filesystem(uri)
        for name, (t, s) in side.items():
            with storage_errors(uri):
                if "/" in name:
                    fs.makedirs(f"{path}/{name.rsplit('/', 1)[0]}", exist_ok=True)
                atomic_put(fs, f"{path}/{name}", _parquet_bytes(t, s))
        return commit_files(uri, stage=schema.stage, config_hash=config_hash, files=[*rows, *side],
                            num_rows=table.num_rows, inputs=inputs, summary=summary, schema=schema,
                            rows_per_file=rows, lock_token=token, contract=contract)
    except BaseException:
        release_stage_lock(uri, token)
        raise


def read_shard(ref: ShardRef | str, *, stage: str | None = None, verify: bool = True) -> pa.Table:
    """Read a committed shard, validating it against its manifest and its stage's schema.

    Args:
        ref: a ShardRef or the shard folder's URI.
        stage: the stage the caller expects (default: the manifest's).
        verify: check every file's size and checksum against the manifest.
    Raises:
        ShardNotCommittedError: no manifest.
        ShardCorruptError: missing file, wrong size or checksum, unreadable Parquet, or (for a
            ShardRef) a manifest that changed since the ref was made.
        ShardSchemaError: another stage, schema version or fingerprint; missing column; wrong dtype.
    """
    uri = ref.uri if isinstance(ref, ShardRef) else ref
    manifest, sha = read_manifest(uri)
    if isinstance(ref, ShardRef) and ref.manifest_sha256 != sha:
        raise ShardCorruptError(f"{uri}: manifest changed since it was referenced (sha256 {sha[:12]}, ref {ref.manifest_sha256[:12]})")
    want = stage or manifest.stage
    if manifest.stage != want:
        raise ShardSchemaError(f"{uri}: shard of stage {manifest.stage!r}, expected {want!r}")
    expected = schema_for(want)
    if manifest.schema_version != expected.version:
        raise ShardSchemaError(
            f"{uri}: schema_version {manifest.schema_version} of stage {want!r}, this code reads version {expected.version}"
        )
    if manifest.schema_fingerprint != expected.fingerprint:
        raise ShardSchemaError(f"{uri}: schema fingerprint {manifest.schema_fingerprint} differs from {expected.fingerprint}")
    fs, path = filesystem(uri)
    tables = []
    for entry in manifest.files:
        if entry.rows is None:  # not a Parquet part (e.g. a checkpoint file)
            continue
        fpath = f"{path}/{entry.path}"
        part = validate_table(_read_file(fs, fpath, entry, uri=uri, schema=expected, verify=verify), expected, where=fpath)
        tables.append(part.cast(expected.arrow_with(_present_optional(part, expected))))
    table = pa.concat_tables(tables) if tables else expected.arrow.empty_table()
    if table.num_rows != manifest.num_rows:
        raise ShardCorruptError(f"{uri}: {table.num_rows} rows, manifest says {manifest.num_rows}")
    return table


def read_side_table(ref: ShardRef | str, name: str, schema: StageSchema) -> pa.Table:
    """A side table committed with a shard (``write_shard(side_tables=...)``), checked as a part
    is: listed in the manifest, same size and checksum, readable Parquet stamped with ``schema``'s
    stage and version, the columns of ``schema``.

    Raises:
        ShardNotCommittedError: no manifest.
        ShardCorruptError: the manifest changed since ``ref`` was made, or the file is missing,
            truncated, corrupted or unreadable.
        ShardSchemaError: the manifest does not list ``name``, or the file is of another stage,
            schema version or columns.
    """
    uri = ref.uri if isinstance(ref, ShardRef) else ref
    manifest, sha = read_manifest(uri)
    if isinstance(ref, ShardRef) and ref.manifest_sha256 != sha:
        raise ShardCorruptError(f"{uri}: manifest changed since it was referenced (sha256 {sha[:12]}, ref {ref.manifest_sha256[:12]})")
    entry = next((e for e in manifest.files if e.path == name), None)
    if entry is None:
        raise ShardSchemaError(f"{uri}: the manifest lists no side table {name!r}")
    fs, path = filesystem(uri)
    fpath = f"{path}/{name}"
    table = validate_table(_read_file(fs, fpath, entry, uri=uri, schema=schema, verify=True), schema, where=fpath)
    return table.cast(schema.arrow_with(_present_optional(table, schema)))


def _read_file(fs, fpath: str, entry, *, uri: str, schema: StageSchema, verify: bool) -> pa.Table:
    """One committed Parquet file of the shard at ``uri`` (a part or a side table; ``entry`` its
    manifest entry), checked: present, with ``verify`` of the manifest's size and checksum, readable,
    stamped with ``schema``'s stage and version (its columns are the caller's to validate).

    Raises:
        ShardCorruptError: missing, truncated, corrupted or unreadable.
        ShardSchemaError: stamped with another stage or schema version.
    """
    if not fs.exists(fpath):
        raise ShardCorruptError(f"{uri}: manifest lists {entry.path} but the file is missing")
    data = fs.cat_file(fpath)
    if verify:
        if len(data) != entry.bytes:
            raise ShardCorruptError(f"{fpath}: {len(data)} bytes, manifest says {entry.bytes} (truncated?){repair_hint(uri)}")
        if bytes_checksum(data, checksum_algorithm(entry.checksum)) != entry.checksum:
            raise ShardCorruptError(f"{fpath}: checksum does not match the manifest (corrupted){repair_hint(uri)}")
    try:
        table = pq.read_table(pa.BufferReader(data))
    except Exception as exc:
        raise ShardCorruptError(f"{fpath}: unreadable Parquet: {exc}") from exc
    meta = table.schema.metadata or {}
    if meta.get(b"stage", b"").decode() != schema.stage or meta.get(b"schema_version", b"").decode() != str(schema.version):
        raise ShardSchemaError(
            f"{fpath}: file metadata says stage={meta.get(b'stage')!r} schema_version={meta.get(b'schema_version')!r}, "
            f"expected {schema.stage!r} version {schema.version}"
        )
    return table


def verify_files(uri: str, *, under: str = "", local_copy: str | None = None,
                 skip: Callable[[str], bool] | None = None) -> list[str]:
    """Check the committed files of the stage at ``uri`` below its sub-folder ``under`` ("" for
    all) against the manifest: present, same size, same checksum. Files pruned on purpose
    (``_PRUNED.json``) are skipped, and those ``skip`` (called with the path relative to ``uri``)
    says the caller will not read. A local file that this process wrote or checked before,
    unchanged since (size, mtime), is not hashed again.

    Args:
        local_copy: check this local folder instead (a download of ``{uri}/{under}``: the files
            keep their paths relative to ``under``).
    Returns:
        the paths checked (relative to ``uri``).
    Raises:
        ShardNotCommittedError: no manifest at ``uri``.
        ShardCorruptError: a file is missing, has another size or another checksum; the message
            names the file and the command that recomputes the stage.
    """
    manifest, _ = read_manifest(uri)
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    pruned = pruned_files(uri)
    fs, path = filesystem(uri)
    if local_copy is not None:
        from fsspec.implementations.local import LocalFileSystem

        fs = LocalFileSystem()
    checked = []
    for entry in manifest.files:
        if not entry.path.startswith(prefix) or entry.path in pruned or (skip is not None and skip(entry.path)):
            continue
        fpath = os.path.join(local_copy, entry.path[len(prefix):]) if local_copy is not None else f"{path}/{entry.path}"
        shown = f"{uri.rstrip('/')}/{entry.path}"
        if not fs.exists(fpath):
            raise ShardCorruptError(f"{shown}: listed in the manifest but missing{repair_hint(uri)}")
        size = fs.size(fpath)
        if size != entry.bytes:
            raise ShardCorruptError(f"{shown}: {size} bytes, the manifest says {entry.bytes} (truncated or "
                                    f"overwritten){repair_hint(uri)}")
        if not verified(fs, fpath, entry.checksum):
            raise ShardCorruptError(f"{shown}: checksum does not match the manifest: the committed file is "
                                    f"corrupted{repair_hint(uri)}")
        checked.append(entry.path)
    return checked
