"""The shard contract on a real S3-compatible server (moto's server mode, a subprocess on
127.0.0.1) through s3fs: manifest-last holds without renames (a stage whose manifest is missing
is never accepted, even with every part present), parts and manifests are single PUTs (no
temporary objects), the writer lock and the manifest are conditional writes (If-None-Match: *)
so of two writers only one commits, and listings cached by s3fs never hide another process's
writes."""
from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from schemas import (
    ShardNotCommittedError,
    committed_ref,
    prepare_stage_dir,
    read_manifest,
    read_shard,
    write_parts,
    write_shard,
)
from schemas.columns import ACTOR_LOGPROBS
from schemas.shards import ShardExistsError, ShardLockedError, commit_files, put_exclusive, release_stage_lock
from tests.faults import MotoServer

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env().items():
                mp.setenv(k, v)
            server.client().create_bucket(Bucket="shards")
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            yield server
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.stop()


def _table(n=3):
    return pa.table({"sample_id": [f"s{i}" for i in range(n)], "old_logprobs": [[-0.5] * (i + 1) for i in range(n)],
                     "action_entropy": [[1.5] * (i + 1) for i in range(n)]}, schema=ACTOR_LOGPROBS.arrow)


def _keys(s3, prefix: str) -> list[str]:
    out = s3.client().list_objects_v2(Bucket="shards", Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for o in out.get("Contents", []))


def test_round_trip_with_single_puts_and_no_temporaries(s3):
    uri = "s3://shards/run/iter=000001/actor_logprobs"
    ref = write_shard(_table(7), uri, schema=ACTOR_LOGPROBS, config_hash="h", rows_per_part=3)
    assert _keys(s3, "run/iter=000001/actor_logprobs/") == [
        "_MANIFEST.json", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]  # no .tmp-*, no lock left
    assert read_shard(ref).equals(_table(7))
    # the manifest's checksums are those of the stored objects
    m, _ = read_manifest(uri)
    import xxhash

    for e in m.files:
        body = s3.client().get_object(Bucket="shards", Key=f"run/iter=000001/actor_logprobs/{e.path}")["Body"].read()
        assert (len(body), "xxh3_128:" + xxhash.xxh3_128(body).hexdigest()) == (e.bytes, e.checksum)


def test_manifest_last_every_part_present_but_no_manifest_is_not_a_stage(s3):
    uri = "s3://shards/run/iter=000002/actor_logprobs"
    token = prepare_stage_dir(uri)
    write_parts(_table(), uri, schema=ACTOR_LOGPROBS)  # every part written: a writer killed just before its commit
    assert _keys(s3, "run/iter=000002/actor_logprobs/") == [".writer.lock", "part-00000.parquet"]
    with pytest.raises(ShardNotCommittedError, match="no _MANIFEST.json"):
        read_shard(uri)
    assert committed_ref(uri, stage="actor_logprobs", config_hash="h") is None
    from rft_core.inspect import run_status

    assert {(r["stage"], r["status"]) for r in run_status("s3://shards/run") if r["iteration"] == 2} == {
        ("actor_logprobs", "incomplete")}
    release_stage_lock(uri, token)
    # the next writer clears the leftovers and commits
    write_shard(_table(2), uri, schema=ACTOR_LOGPROBS, config_hash="h")
    assert read_shard(uri).num_rows == 2


def test_conditional_put_lets_exactly_one_of_concurrent_creates_win(s3):
    import s3fs

    fs = s3fs.S3FileSystem()
    results: list[str] = []
    barrier = threading.Barrier(8)

    def create(i: int) -> None:
        barrier.wait()
        try:
            put_exclusive(fs, "shards/race/lock", f"writer {i}".encode())
            results.append(f"won {i}")
        except FileExistsError:
            results.append("refused")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r.startswith("won")]
    assert len(winners) == 1 and results.count("refused") == 7
    assert fs.cat_file("shards/race/lock") == f"writer {winners[0].split()[1]}".encode()


def test_two_writers_one_holds_the_lock_and_the_other_is_refused(s3):
    uri = "s3://shards/run/iter=000003/actor_logprobs"
    token = prepare_stage_dir(uri)
    with pytest.raises(ShardLockedError, match=r"being written by host .* pid \d+"):
        prepare_stage_dir(uri)  # this process's pid is alive: the lock is not stale
    write_parts(_table(), uri, schema=ACTOR_LOGPROBS)
    commit_files(uri, stage="actor_logprobs", config_hash="h", num_rows=3, files=["part-00000.parquet"],
                 rows_per_file={"part-00000.parquet": 3}, schema=ACTOR_LOGPROBS, lock_token=token)
    with pytest.raises(ShardExistsError, match="already committed"):
        prepare_stage_dir(uri)


def test_a_writer_that_lost_the_race_to_the_manifest_cannot_commit(s3, monkeypatch):
    """Two writers past their checks at the same moment (a stale lock taken over twice): the
    manifest's conditional PUT refuses the second commit instead of overwriting the first."""
    import s3fs

    uri = "s3://shards/run/iter=000004/actor_logprobs"
    first = write_shard(_table(3), uri, schema=ACTOR_LOGPROBS, config_hash="h")
    real_exists = s3fs.S3FileSystem.exists
    monkeypatch.setattr(s3fs.S3FileSystem, "exists",
                        lambda self, path, **kw: False if path.endswith("_MANIFEST.json") else real_exists(self, path, **kw))
    with pytest.raises(ShardExistsError, match="won the conditional write"):
        commit_files(uri, stage="actor_logprobs", config_hash="other", num_rows=3, files=["part-00000.parquet"],
                     rows_per_file={"part-00000.parquet": 3}, schema=ACTOR_LOGPROBS)
    monkeypatch.undo()
    assert read_manifest(uri)[1] == first.manifest_sha256  # the first commit stands


def test_another_process_writes_are_seen_despite_cached_listings(s3):
    """s3fs caches listings: a stage committed by another client after this one listed the
    folder must still be seen as committed (never cleared as leftovers, never overwritten)."""
    import s3fs

    src, dst = "run/iter=000005/src", "run/iter=000005/actor_logprobs"
    write_shard(_table(), f"s3://shards/{src}", schema=ACTOR_LOGPROBS, config_hash="h")
    fs = s3fs.S3FileSystem()
    fs.pipe_file(f"shards/{dst}/.leftover", b"x")
    assert fs.ls(f"shards/{dst}", detail=False) == [f"shards/{dst}/.leftover"]  # now cached
    client = s3.client()  # "another process" commits the stage through its own connection
    for name in ("part-00000.parquet", "_MANIFEST.json"):
        client.copy_object(Bucket="shards", Key=f"{dst}/{name}", CopySource={"Bucket": "shards", "Key": f"{src}/{name}"})
    assert not fs.exists(f"shards/{dst}/_MANIFEST.json")  # what a stale listing says
    with pytest.raises(ShardExistsError, match="already committed"):
        prepare_stage_dir(f"s3://shards/{dst}")
    assert committed_ref(f"s3://shards/{dst}", stage="actor_logprobs", config_hash="h") is not None
    assert read_shard(f"s3://shards/{dst}").num_rows == 3


def test_verify_and_repair_on_the_bucket(s3):
    """A corrupted object of a committed stage is found by ``verify``; ``repair`` moves the stage
    and the stage that read it under ``_repaired/`` in the bucket, and leaves the rest."""
    import s3fs

    from rft_core.storage import repair, verify_run

    root = "s3://shards/rep"
    a = write_shard(_table(), f"{root}/iter=000001/actor_logprobs", schema=ACTOR_LOGPROBS, config_hash="a")
    b_uri = f"{root}/iter=000001/ref_logprobs"
    fs = s3fs.S3FileSystem()
    fs.pipe_file("shards/rep/iter=000001/ref_logprobs/notes.txt", b"derived from actor_logprobs")
    commit_files(b_uri, stage="ref_logprobs", config_hash="b", files=["notes.txt"], inputs={"actor_logprobs": a})
    c = write_shard(_table(), f"{root}/iter=000001/other", schema=ACTOR_LOGPROBS, config_hash="c")
    assert verify_run(root) == {}
    key = "rep/iter=000001/actor_logprobs/part-00000.parquet"
    body = bytearray(s3.client().get_object(Bucket="shards", Key=key)["Body"].read())
    body[50] ^= 0x01
    s3.client().put_object(Bucket="shards", Key=key, Body=bytes(body))
    assert list(verify_run(root)) == ["iter=1/actor_logprobs"]
    plan = repair(root, "iter=1/actor_logprobs")
    assert plan.moves == {"iter=1/actor_logprobs": "asked for", "iter=1/ref_logprobs": "reads iter=1/actor_logprobs"}
    moved = _keys(s3, "rep/_repaired/")
    assert any(k.endswith("iter=000001/actor_logprobs/part-00000.parquet") for k in moved)
    assert any(k.endswith("iter=000001/ref_logprobs/notes.txt") for k in moved)
    assert _keys(s3, "rep/iter=000001/actor_logprobs/") == [] and read_manifest(c.uri)[1] == c.manifest_sha256
