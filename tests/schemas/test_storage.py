"""Storage primitives: storage failures become errors naming the stage and the run; committed
checkpoint files are checked against the manifest (and not hashed twice by the process that
wrote them); the run layout's stage names parse both ways."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pyarrow as pa
import pytest

import schemas.storage as storage
from schemas import (
    ShardCorruptError,
    StorageError,
    commit_files,
    parse_stage_spec,
    split_stage_uri,
    stage_spec,
    stage_uri,
    storage_errors,
    verify_files,
    write_parts,
)
from schemas.columns import PPO_UPDATE


def test_stage_names_parse_both_ways():
    assert split_stage_uri("s3://b/runs/x/iter=000012/ppo_update") == ("s3://b/runs/x", 12, "ppo_update")
    assert split_stage_uri("/r/iter=000001/ppo_update-optimizer/") == ("/r", 1, "ppo_update-optimizer")
    assert split_stage_uri("/r/eval/iter=1-abc/rollout") is None
    assert stage_spec(3, "rollout") == "iter=3/rollout"
    assert parse_stage_spec("iter=000003/rollout") == parse_stage_spec("iter=3/rollout/") == (3, "rollout")
    with pytest.raises(ValueError, match="expected iter=N/<stage>"):
        parse_stage_spec("3/rollout")


def test_storage_errors_name_the_stage_the_run_and_the_cause(tmp_path):
    uri = stage_uri(str(tmp_path / "run"), 2, "ppo_update")
    with pytest.raises(StorageError) as info:
        with storage_errors(uri):
            raise OSError(errno.ENOSPC, "No space left on device", f"{uri}/policy/model.safetensors")
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert f"writing stage iter=2/ppo_update of run {tmp_path / 'run'} failed at {uri}/policy/model.safetensors" in msg
    assert "No space left on device [errno 28: ENOSPC]" in msg and "free of" in msg  # the free space of that disk
    assert "Nothing of this stage was committed" in msg and "rerun the same command" in msg
    with pytest.raises(StorageError, match=r"stage iter=2/ppo_update .* Access Denied .*bucket policy"):
        with storage_errors(uri):
            raise PermissionError("Access Denied")  # what s3fs raises for a read-only bucket (no errno)
    with pytest.raises(StorageError, match="read-only"):
        with storage_errors(uri):
            raise OSError(errno.EROFS, "Read-only file system")
    with pytest.raises(FileNotFoundError):  # not a storage failure: unchanged
        with storage_errors(uri):
            raise FileNotFoundError("x")


def _checkpoint(run_root: str, iteration: int = 1) -> str:
    uri = stage_uri(run_root, iteration, "ppo_update")
    folder = Path(uri, "policy")
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (folder / "config.json").write_text(json.dumps({"a": 1}))
    rows = write_parts(pa.table({k: [] for k in PPO_UPDATE.schema.names}, schema=PPO_UPDATE.arrow), uri, schema=PPO_UPDATE)
    commit_files(uri, stage="ppo_update", config_hash="h", schema=PPO_UPDATE, rows_per_file=rows)
    return uri


def test_verify_files_finds_a_flipped_byte_and_names_the_file_and_the_repair(tmp_path, monkeypatch):
    uri = _checkpoint(str(tmp_path / "run"))
    calls = []
    real = storage.file_checksum
    monkeypatch.setattr(storage, "file_checksum", lambda fs, p, *a: calls.append(p) or real(fs, p, *a))
    assert verify_files(uri, under="policy") == ["policy/config.json", "policy/model.safetensors"]
    assert calls == []  # committed by this process: known hashes, nothing read again
    w = Path(uri, "policy/model.safetensors")
    data = bytearray(w.read_bytes())
    data[1000] ^= 0x01
    w.write_bytes(bytes(data))  # same size, one bit flipped
    with pytest.raises(ShardCorruptError) as info:
        verify_files(uri, under="policy")
    msg = str(info.value)
    assert msg.startswith(f"{uri}/policy/model.safetensors: checksum does not match the manifest")
    assert f"rft repair {tmp_path / 'run'} --stage iter=1/ppo_update" in msg
    assert calls == [str(w)]  # changed since committed: hashed again
    w.write_bytes(bytes(data[:-1]))
    with pytest.raises(ShardCorruptError, match="10239 bytes, the manifest says 10240"):
        verify_files(uri)
    w.unlink()
    with pytest.raises(ShardCorruptError, match="model.safetensors: listed in the manifest but missing"):
        verify_files(uri)


def test_verify_files_checks_a_downloaded_copy(tmp_path):
    uri = _checkpoint(str(tmp_path / "run"))
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("model.safetensors", "config.json"):
        (copy / name).write_bytes(Path(uri, "policy", name).read_bytes())
    assert verify_files(uri, under="policy", local_copy=str(copy)) == ["policy/config.json", "policy/model.safetensors"]
    (copy / "config.json").write_text(json.dumps({"a": 2}))
    with pytest.raises(ShardCorruptError, match="policy/config.json: checksum does not match"):
        verify_files(uri, under="policy", local_copy=str(copy))


def test_file_checksums_are_xxh3_128_and_an_entry_holds_exactly_one(tmp_path):
    import hashlib

    import fsspec
    from pydantic import ValidationError

    from schemas.shards import FileEntry

    fs = fsspec.filesystem("file")
    empty, abc = tmp_path / "empty", tmp_path / "abc"
    empty.write_bytes(b"")
    abc.write_bytes(b"abc")
    # XXH3-128 of the empty input, from xxHash's own sanity table (tests/sanity_test_vectors.h)
    assert storage.file_checksum(fs, str(empty)) == (0, "xxh3_128:99aa06d3014798d86001c324468d497f")
    assert storage.file_checksum(fs, str(abc), "sha256") == (3, "sha256:" + hashlib.sha256(b"abc").hexdigest())
    assert storage.bytes_checksum(b"abc") == storage.file_checksum(fs, str(abc))[1]
    with pytest.raises(ValueError, match="'md5': not a file checksum algorithm"):
        storage.file_checksum(fs, str(abc), "md5")
    with pytest.raises(ValueError, match="not a file checksum '<algorithm>:<hex>'"):
        storage.verified(fs, str(abc), "0123")

    entry = FileEntry.of("part-00000.parquet", 0, "xxh3_128:99aa06d3014798d86001c324468d497f", rows=0)
    assert entry.checksum == "xxh3_128:99aa06d3014798d86001c324468d497f" and entry.sha256 is None
    assert json.loads(entry.model_dump_json()) == {"path": "part-00000.parquet", "bytes": 0, "rows": 0,
                                                   "xxh3_128": "99aa06d3014798d86001c324468d497f"}
    legacy = FileEntry.model_validate({"path": "a", "bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()})
    assert storage.verified(fs, str(abc), legacy.checksum) and not storage.verified(fs, str(empty), legacy.checksum)
    with pytest.raises(ValidationError, match="exactly one checksum"):
        FileEntry(path="a", bytes=3)
    with pytest.raises(ValidationError, match="exactly one checksum"):
        FileEntry(path="a", bytes=3, sha256="00", xxh3_128="00")


def test_a_manifest_of_version_1_with_sha256_checksums_is_still_checked(tmp_path):
    """Manifests written before version 2 recorded each file's sha256: their stages stay readable,
    and a file that no longer matches its sha256 is refused as before."""
    import hashlib

    from schemas import committed_ref, read_manifest, read_shard

    uri = _checkpoint(str(tmp_path / "run"))
    mpath = Path(uri, "_MANIFEST.json")
    m = json.loads(mpath.read_text())
    assert m["manifest_version"] == 2 and all(set(f) & {"xxh3_128", "sha256"} == {"xxh3_128"} for f in m["files"])
    m["manifest_version"] = 1
    for f in m["files"]:
        del f["xxh3_128"]
        f["sha256"] = hashlib.sha256(Path(uri, f["path"]).read_bytes()).hexdigest()
    mpath.write_text(json.dumps(m))
    storage._VERIFIED.clear()  # this process hashed them when it committed: check them again, by sha256
    assert [e.checksum.split(":")[0] for e in read_manifest(uri)[0].files] == ["sha256"] * 3
    assert verify_files(uri) == ["part-00000.parquet", "policy/config.json", "policy/model.safetensors"]
    committed_ref(uri, stage="ppo_update", config_hash="h", check_files=True)
    w = Path(uri, "policy/model.safetensors")
    data = bytearray(w.read_bytes())
    data[7] ^= 0x10
    w.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="policy/model.safetensors: checksum does not match the manifest"):
        verify_files(uri, under="policy")
    part = Path(uri, "part-00000.parquet")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="part-00000.parquet: checksum does not match the manifest"):
        committed_ref(uri, stage="ppo_update", config_hash="h", check_files=True)
    with pytest.raises(ShardCorruptError, match="part-00000.parquet: checksum does not match the manifest"):
        read_shard(uri)


def test_a_manifest_of_a_newer_version_is_refused_as_newer_not_as_corrupt(tmp_path):
    from schemas import NewerManifestError, read_manifest
    from schemas.shards import MANIFEST_VERSION
    from rft_core.storage import verify_run

    uri = _checkpoint(str(tmp_path / "run"))
    mpath = Path(uri, "_MANIFEST.json")
    m = json.loads(mpath.read_text())
    for extra in ({}, {"files_digest": "x"}):  # valid under this version's model, and with a field it does not know
        mpath.write_text(json.dumps({**m, **extra, "manifest_version": MANIFEST_VERSION + 1}))
        with pytest.raises(NewerManifestError, match=rf"manifest version {MANIFEST_VERSION + 1}, written by a newer "
                                                     rf"version of prefect-rft; this one reads versions up to {MANIFEST_VERSION}"):
            read_manifest(uri)
        assert "written by a newer version" in verify_run(str(tmp_path / "run"))["iter=1/ppo_update"]
    mpath.write_text(json.dumps({**m, "files_digest": "x"}))  # this version, an unknown field: corrupt, as before
    with pytest.raises(ShardCorruptError, match="not a valid manifest") as info:
        read_manifest(uri)
    assert not isinstance(info.value, NewerManifestError)


def test_a_half_written_lock_left_by_a_killed_writer_is_taken_over(tmp_path):
    import os
    import time

    from schemas import prepare_stage_dir
    from schemas.shards import LOCK_NAME, release_stage_lock

    uri = str(tmp_path / "run" / "iter=000001" / "rollout")
    os.makedirs(uri)
    lock = Path(uri, LOCK_NAME)
    lock.write_bytes(b"")  # created, never written: a writer killed (or out of space) between the two
    old = time.time() - 60
    os.utime(lock, (old, old))
    token = prepare_stage_dir(uri)
    assert json.loads(lock.read_text())["token"] == token
    release_stage_lock(uri, token)
    assert not lock.exists()


def test_a_lock_that_cannot_be_written_leaves_no_empty_file(tmp_path, monkeypatch):
    import os

    from schemas.storage import put_exclusive
    from fsspec.implementations.local import LocalFileSystem

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.f = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", Full)
    target = tmp_path / "lock"
    with pytest.raises(OSError, match="No space left"):
        put_exclusive(LocalFileSystem(), str(target), b"x")
    assert not target.exists()
