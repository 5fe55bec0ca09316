"""The shard contract: manifests, checksums, schema checks, refusal of tampered shards."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import (
    ShardCorruptError,
    ShardNotCommittedError,
    ShardSchemaError,
    committed_ref,
    config_hash,
    read_manifest,
    read_shard,
    stage_uri,
    write_shard,
)
from schemas.columns import ACTOR_LOGPROBS, REF_LOGPROBS, STAGE_SCHEMAS
from schemas.shards import ShardExistsError, StaleShardError


def _table(n=3):
    return pa.table({"sample_id": [f"s{i}" for i in range(n)], "old_logprobs": [[-0.5] * (i + 1) for i in range(n)],
                     "action_entropy": [[1.5] * (i + 1) for i in range(n)]}, schema=ACTOR_LOGPROBS.arrow)


def test_layout_is_hive_style():
    assert stage_uri("s3://b/run", 12, "rollout") == "s3://b/run/iter=000012/rollout"
    with pytest.raises(ValueError):
        stage_uri("x", 1, "a/b")


def test_write_read_and_manifest(tmp_path):
    uri = str(tmp_path / "a")
    ref = write_shard(_table(), uri, schema=ACTOR_LOGPROBS, config_hash="abc", summary={"seconds": 1.5})
    m, sha = read_manifest(uri)
    assert (m.stage, m.num_rows, m.config_hash, m.schema_version) == ("actor_logprobs", 3, "abc", 1)
    assert m.files[0].path == "part-00000.parquet" and len(m.files[0].xxh3_128) == 32 and m.files[0].sha256 is None
    assert ref.manifest_sha256 == sha and m.summary["seconds"] == 1.5
    assert read_shard(ref).equals(_table().cast(ACTOR_LOGPROBS.arrow))
    # schema metadata is stamped in the file itself
    meta = pq.read_schema(tmp_path / "a" / "part-00000.parquet").metadata
    assert meta[b"stage"] == b"actor_logprobs" and meta[b"schema_version"] == b"1"


def test_multi_part_shard(tmp_path):
    ref = write_shard(_table(7), str(tmp_path / "a"), schema=ACTOR_LOGPROBS, config_hash="h", rows_per_part=3)
    m, _ = read_manifest(ref.uri)
    assert [f.rows for f in m.files] == [3, 3, 1]
    assert read_shard(ref).column("sample_id").to_pylist() == [f"s{i}" for i in range(7)]


def test_committed_shard_is_never_overwritten(tmp_path):
    uri = str(tmp_path / "a")
    write_shard(_table(), uri, schema=ACTOR_LOGPROBS, config_hash="h1")
    before = (tmp_path / "a" / "part-00000.parquet").read_bytes()
    with pytest.raises(ShardExistsError, match="refusing to overwrite"):
        write_shard(_table(5), uri, schema=ACTOR_LOGPROBS, config_hash="h2")
    assert (tmp_path / "a" / "part-00000.parquet").read_bytes() == before
    assert committed_ref(uri, stage="actor_logprobs", config_hash="h1") is not None
    with pytest.raises(StaleShardError, match="config hash h1"):
        committed_ref(uri, stage="actor_logprobs", config_hash="h2")


def test_half_written_stage_is_not_committed_and_gets_cleaned(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "part-00000.parquet").write_bytes(b"partial")
    (d / ".tmp-123-part-00001.parquet").write_bytes(b"junk")
    with pytest.raises(ShardNotCommittedError, match="no _MANIFEST.json"):
        read_shard(str(d))
    assert committed_ref(str(d), stage="actor_logprobs", config_hash="h") is None
    write_shard(_table(), str(d), schema=ACTOR_LOGPROBS, config_hash="h")
    assert sorted(p.name for p in d.iterdir()) == ["_MANIFEST.json", "part-00000.parquet"]


def test_flipped_byte_is_refused(tmp_path):
    ref = write_shard(_table(), str(tmp_path / "a"), schema=ACTOR_LOGPROBS, config_hash="h")
    f = tmp_path / "a" / "part-00000.parquet"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="part-00000.parquet: checksum does not match"):
        read_shard(ref)


def test_truncated_and_missing_file_are_refused(tmp_path):
    ref = write_shard(_table(), str(tmp_path / "a"), schema=ACTOR_LOGPROBS, config_hash="h")
    f = tmp_path / "a" / "part-00000.parquet"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ShardCorruptError, match="truncated"):
        read_shard(ref)
    with pytest.raises(ShardCorruptError, match="bytes"):
        committed_ref(ref.uri, stage="actor_logprobs", config_hash="h")
    f.unlink()
    with pytest.raises(ShardCorruptError, match="missing"):
        read_shard(ref)


def _rewrite_part(tmp_path, table, *, metadata=None):
    """Replace the part file with ``table`` and fix the manifest's checksum (a 'foreign' writer)."""
    import hashlib
    import io

    buf = io.BytesIO()
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, buf)
    data = buf.getvalue()
    (tmp_path / "a" / "part-00000.parquet").write_bytes(data)
    mpath = tmp_path / "a" / "_MANIFEST.json"
    m = json.loads(mpath.read_text())
    m["files"][0].pop("xxh3_128", None)  # recorded as a manifest of version 1 would: its sha256, still checked
    m["files"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    m["manifest_version"] = 1
    mpath.write_text(json.dumps(m))


def test_missing_column_wrong_dtype_wrong_version(tmp_path):
    uri = str(tmp_path / "a")
    write_shard(_table(), uri, schema=ACTOR_LOGPROBS, config_hash="h")
    meta = {"stage": "actor_logprobs", "schema_version": "1"}
    _rewrite_part(tmp_path, pa.table({"sample_id": ["a"]}), metadata=meta)
    with pytest.raises(ShardSchemaError, match=r"missing column\(s\) \['old_logprobs', 'action_entropy'\]"):
        read_shard(uri)
    _rewrite_part(tmp_path, pa.table({"sample_id": ["a"], "old_logprobs": [[0.5]], "action_entropy": [[0.1]]}),
                  metadata=meta)  # old_logprobs is list<double>
    with pytest.raises(ShardSchemaError, match="'old_logprobs' has dtype list<element: double>, expected list<item: float>"):
        read_shard(uri)
    _rewrite_part(tmp_path, _table(), metadata={"stage": "actor_logprobs", "schema_version": "0"})
    with pytest.raises(ShardSchemaError, match="schema_version"):
        read_shard(uri)
    mpath = tmp_path / "a" / "_MANIFEST.json"
    m = json.loads(mpath.read_text())
    m["schema_version"] = 99
    mpath.write_text(json.dumps(m))
    with pytest.raises(ShardSchemaError, match="schema_version 99"):
        read_shard(uri)


def test_wrong_stage_and_garbage_manifest(tmp_path):
    uri = str(tmp_path / "a")
    write_shard(pa.table({"sample_id": ["a"], "ref_logprobs": [[0.1]]}, schema=REF_LOGPROBS.arrow), uri,
                schema=REF_LOGPROBS, config_hash="h")
    with pytest.raises(ShardSchemaError, match="shard of stage 'ref_logprobs', expected 'actor_logprobs'"):
        read_shard(uri, stage="actor_logprobs")
    (tmp_path / "a" / "_MANIFEST.json").write_text("{not json")
    with pytest.raises(ShardCorruptError, match="not a valid manifest"):
        read_shard(uri)


def test_writer_validates_before_writing(tmp_path):
    with pytest.raises(ShardSchemaError, match="missing column"):
        write_shard(pa.table({"sample_id": ["a"]}), str(tmp_path / "a"), schema=ACTOR_LOGPROBS, config_hash="h")
    assert not (tmp_path / "a").exists()


def test_config_hash_tracks_content():
    from rft_core.config import RolloutConfig

    a = config_hash("x", RolloutConfig())
    assert a == config_hash("x", RolloutConfig())
    assert a != config_hash("x", RolloutConfig(temperature=0.5))


def test_every_stage_schema_has_distinct_fingerprint():
    fps = {s.fingerprint for s in STAGE_SCHEMAS.values()}
    assert len(fps) == len(STAGE_SCHEMAS)


def _hold_lock_then_commit(uri, started, release):
    """Child process: take the writer lock, signal, wait, then write and commit."""
    from schemas.shards import prepare_stage_dir
    from schemas.tables import write_parts

    token = prepare_stage_dir(uri)
    started.set()
    release.wait(30)
    rows = write_parts(_table(), uri, schema=ACTOR_LOGPROBS)
    from schemas import commit_files

    commit_files(uri, stage="actor_logprobs", config_hash="h", files=list(rows), num_rows=3, schema=ACTOR_LOGPROBS,
                 rows_per_file=rows, lock_token=token)


def test_concurrent_writers_one_wins_the_other_fails_clearly(tmp_path):
    import multiprocessing as mp

    from schemas.shards import ShardLockedError

    uri = str(tmp_path / "a")
    ctx = mp.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_lock_then_commit, args=(uri, started, release))
    child.start()
    assert started.wait(30)
    with pytest.raises(ShardLockedError, match=f"being written by host .* pid {child.pid}"):
        write_shard(_table(5), uri, schema=ACTOR_LOGPROBS, config_hash="h2")
    release.set()
    child.join(30)
    assert child.exitcode == 0
    assert read_shard(uri).num_rows == 3  # the winner's shard, intact
    with pytest.raises(ShardExistsError):
        write_shard(_table(5), uri, schema=ACTOR_LOGPROBS, config_hash="h2")
    assert not (tmp_path / "a" / ".writer.lock").exists()


def _take_lock_and_hang(uri, started):
    from schemas.shards import prepare_stage_dir

    prepare_stage_dir(uri)
    (__import__("pathlib").Path(uri) / "part-00000.parquet").write_bytes(b"half")
    started.set()
    __import__("time").sleep(60)


def test_lock_of_a_killed_writer_is_taken_over(tmp_path):
    import multiprocessing as mp
    import os
    import signal

    uri = str(tmp_path / "a")
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    child = ctx.Process(target=_take_lock_and_hang, args=(uri, started))
    child.start()
    assert started.wait(30)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert (tmp_path / "a" / ".writer.lock").exists()
    write_shard(_table(), uri, schema=ACTOR_LOGPROBS, config_hash="h")  # the dead writer's lock is stale
    assert read_shard(uri).num_rows == 3
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["_MANIFEST.json", "part-00000.parquet"]


def test_failed_write_releases_the_lock(tmp_path):
    uri = str(tmp_path / "a")
    bad = pa.table({"sample_id": ["a"], "old_logprobs": [[0.1]], "action_entropy": [[0.1]]}, schema=ACTOR_LOGPROBS.arrow)

    from schemas import tables

    orig = tables.write_parts
    tables.write_parts = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))
    try:
        with pytest.raises(OSError, match="disk full"):
            write_shard(bad, uri, schema=ACTOR_LOGPROBS, config_hash="h")
    finally:
        tables.write_parts = orig
    assert not (tmp_path / "a" / ".writer.lock").exists()
    write_shard(bad, uri, schema=ACTOR_LOGPROBS, config_hash="h")  # the same process can retry at once
