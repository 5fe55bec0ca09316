"""Runs whose run_root is ``s3://bucket/...`` on a real S3-compatible server (moto's server mode,
a subprocess on 127.0.0.1), through s3fs, as a user runs them (``python -m flows.cli train``
subprocesses):

* a full 2-iteration training commits every stage in the bucket (single PUTs, no temporary
  objects or locks left behind);
* SIGKILL in the rollout and while the update writes its checkpoint: the rerun resumes, every
  committed object keeps its ETag, LastModified and sha256, every shard validates and the final
  weights equal the uninterrupted run's;
* ``rft inspect``, replay and eval read from the bucket; pandas and DuckDB read the shards with
  the same ``s3://`` URIs;
* bad input (a bucket that does not exist, wrong credentials, an unreachable endpoint, a
  read-only bucket) is refused at the start of the run, naming the URI and the cause, before
  any stage starts.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from rft_core.network import free_port
from tests.faults import ROOT, Baseline, MotoServer, assert_row, baseline_run, row, s3_row, write_config

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytestmark = pytest.mark.timeout(900)
BASE = "s3://rft/base"


@pytest.fixture(scope="module")
def s3run(prefect_harness, tiny_model, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp("s3run")
    server = MotoServer(d)
    try:
        with pytest.MonkeyPatch.context() as mp:
            env = {**server.env(), "RFT_CACHE_DIR": str(d / "cache")}  # checkpoint downloads
            for k, v in env.items():
                mp.setenv(k, v)
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            server.client().create_bucket(Bucket="rft")
            config = write_config(d / "faults.yaml", tiny_model)
            t0 = time.perf_counter()
            weights, timeline = baseline_run(config, BASE, PREFECT_API_URL.value(), env=env)
            yield {"server": server, "env": env, "config": config, "weights": weights, "timeline": timeline,
                   "api": PREFECT_API_URL.value(), "dir": d, "tiny": tiny_model, "seconds": time.perf_counter() - t0}
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.stop()


def _keys(server, prefix: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket="rft", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


@pytest.mark.rotation(3)  # with the S3 rows of group 3, which build the same bucket run (s3run); tests/rotation.py
def test_full_training_commits_every_stage_in_the_bucket(s3run):
    from rft_core.inspect import run_status

    status = run_status(BASE)
    stages = {(r["iteration"], r["stage"]): r["status"] for r in status}
    want = ["prompts", "rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update",
            "ppo_update-optimizer", "ppo_update-policy"]
    assert {(i, s) for i in (1, 2) for s in want} <= set(stages)
    assert stages[(2, "ppo_update")] == "committed" and stages[(1, "rollout")] == "committed"
    assert stages[(1, "ppo_update-optimizer")] == "committed (pruned)"  # default retention: last iteration's only
    keys = _keys(s3run["server"], "base/")
    assert not [k for k in keys if "/.tmp-" in k or k.endswith(".writer.lock")]  # single PUTs, locks released
    # the weights written in the background (checkpoint.async_weights): their own stage, in the bucket too
    assert "base/iter=000002/ppo_update-policy/policy/model.safetensors" in keys and "base/metrics.jsonl" in keys


# each row in its turn of the SIGKILL rotation (tests/rotation.py); benchmarks/reliability.py's s3 table runs the same
S3_ROWS = [row("rollout", "compute", group=3), row("ppo_update", "write", group=3), row("rollout", "write", group=4),
           row("ppo_update", "compute", group=4), row("ppo_update-optimizer", "write", group=4)]  # its baseline: 2 groups


@pytest.mark.parametrize("target, phase", S3_ROWS)
def test_sigkill_on_object_storage_then_rerun_resumes(s3run, target, phase):
    b = Baseline(s3run["config"], s3run["weights"], s3run["timeline"], s3run["api"], "s3://rft", env=s3run["env"])
    out = s3_row(b, target, phase)
    # killed where it says, redone; committed objects keep their ETag, LastModified and sha256
    assert_row(out)
    if phase == "write":  # killed while uploading its parts or checkpoint: objects without a manifest, never accepted
        assert out.partial_files and out.interrupted.startswith(f"1: {target}"), out


@pytest.mark.rotation(4)  # with the S3 rows of group 4, which build the same bucket run (s3run); tests/rotation.py
def test_inspect_pandas_and_duckdb_read_the_bucket(s3run):
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "flows.cli", "inspect", BASE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("committed") >= 16 and "ppo_update" in res.stdout
    res = subprocess.run([sys.executable, "-m", "flows.cli", "inspect", BASE, "-i", "1", "--export",
                          str(s3run["dir"] / "samples.jsonl")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    samples = [json.loads(line) for line in (s3run["dir"] / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and {"response_text", "rewards", "advantage_mean"} <= set(samples[0])

    import duckdb
    import pandas as pd
    import s3fs

    from schemas import read_shard

    rollout = pd.read_parquet(f"{BASE}/iter=000001/rollout")  # _MANIFEST.json and the lock are skipped
    assert len(rollout) == 16 and list(rollout["sample_id"]) == read_shard(f"{BASE}/iter=000001/rollout").column(
        "sample_id").to_pylist()
    con = duckdb.connect()
    con.register_filesystem(s3fs.S3FileSystem())  # DuckDB reads s3:// through fsspec (no httpfs download)
    rows = con.sql(f"""select count(*), sum(w.rewards) from '{BASE}/iter=*/rollout/*.parquet' r
                       join '{BASE}/iter=*/rewards/*.parquet' w using (sample_id)""").fetchall()[0]
    rewards = pd.concat([pd.read_parquet(f"{BASE}/iter={i:06d}/rewards") for i in (1, 2)])
    assert rows[0] == 32 and rows[1] == pytest.approx(rewards["rewards"].sum())


@pytest.mark.rotation(4)  # with the S3 rows of group 4, which build the same bucket run (s3run); tests/rotation.py
def test_replay_and_eval_read_from_the_bucket(s3run):
    from flows.eval import evaluate
    from flows.replay import replay
    from rft_core.config import load_config
    from schemas import read_shard

    cfg = load_config(s3run["config"], ["run_root=s3://rft/replayed", "iterations=2", "advantage.estimator=rloo"])
    result = replay(BASE, cfg)
    assert [m["iteration"] for m in result.metrics] == [1, 2] and result.final_policy.uri.startswith("s3://rft/replayed/")
    assert read_shard("s3://rft/replayed/iter=000002/advantages").num_rows == 16
    ecfg = load_config(s3run["config"], ["eval.num_prompts=4", "eval.max_new_tokens=4", "eval.batch_size=4"])
    ev = evaluate(ecfg, BASE, "s3://rft/eval-base")  # the run root: its last checkpoint, downloaded and verified
    assert ev.policy == f"{BASE}/iter=000002/ppo_update-policy/policy" and ev.num_prompts == 4
    assert read_shard("s3://rft/eval-base/eval", stage="eval").num_rows == 4


# ---------------------------------------------------------------- bad input, refused before any stage


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server that checks credentials: a writable bucket, and a read-only user on it."""
    server = MotoServer(tmp_path_factory.mktemp("moto-auth"), auth_setup_calls=4)
    try:
        s3, iam = server.client("s3"), server.client("iam")
        s3.create_bucket(Bucket="guarded")  # the 4 set-up calls run before authentication starts
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                                                   "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        yield server, key
    finally:
        server.stop()


def _check(monkeypatch, uri: str, **env):
    import s3fs

    from rft_core.storage import check_run_root

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    t0 = time.perf_counter()
    try:
        return check_run_root(uri)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        assert time.perf_counter() - t0 < 20  # quick, even for an unreachable endpoint


def test_bad_object_storage_is_refused_with_the_uri_and_the_cause(guarded, monkeypatch):
    from rft_core.storage import RunRootError

    server, key = guarded
    good = {**server.env(), "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    with pytest.raises(RunRootError, match=r"run_root 's3://no-such-bucket/run': the bucket 'no-such-bucket' does not exist "
                                           rf"\(endpoint {server.url}\)"):
        _check(monkeypatch, "s3://no-such-bucket/run", **good)
    with pytest.raises(RunRootError, match=r"run_root 's3://guarded/run': the credentials were refused .*Access Key Id"):
        _check(monkeypatch, "s3://guarded/run", **{**good, "AWS_ACCESS_KEY_ID": "AKIAWRONGKEY", "AWS_SECRET_ACCESS_KEY": "x"})
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RunRootError, match=rf"run_root 's3://guarded/run': cannot reach the storage endpoint \(endpoint {dead}\)"):
        _check(monkeypatch, "s3://guarded/run", **{**good, "AWS_ENDPOINT_URL": dead})
    with pytest.raises(RunRootError, match=r"run_root 's3://guarded/run': cannot write a file there: Access Denied "
                                           r"\(a read-only bucket, or a policy without s3:PutObject"):
        _check(monkeypatch, "s3://guarded/run", **good)
    reader = server.client(key=key["AccessKeyId"], secret=key["SecretAccessKey"])
    assert reader.list_objects_v2(Bucket="guarded").get("KeyCount", 0) == 0  # nothing was written
    with pytest.raises(reader.exceptions.NoSuchBucket):  # the preflight created no bucket
        reader.list_objects_v2(Bucket="no-such-bucket")


@pytest.mark.rotation(3)  # with the S3 rows of group 3, which build the same bucket run (s3run); tests/rotation.py
def test_training_refuses_a_missing_bucket_before_any_stage(s3run, monkeypatch):
    from flows.train import train
    from rft_core.config import load_config
    from rft_core.storage import RunRootError

    cfg = load_config(s3run["config"], ["run_root=s3://missing-bucket/run"])
    with pytest.raises(RunRootError, match=r"run_root 's3://missing-bucket/run': the bucket 'missing-bucket' does not "
                                           r"exist \(endpoint http://127.0.0.1:\d+\): create it, or fix run_root. No stage"):
        train(cfg)
    names = [b["Name"] for b in s3run["server"].client().list_buckets()["Buckets"]]
    assert names == ["rft"]  # nothing was created


def test_local_read_only_run_root_is_refused(tmp_path, monkeypatch):
    import os

    from rft_core.storage import RunRootError, check_run_root

    if os.geteuid() == 0:  # root writes through permissions: use a read-only bind of a folder instead
        ro = tmp_path / "ro"
        ro.mkdir()
        if subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot bind-mount read-only here (needs root with mount rights)")
        try:
            with pytest.raises(RunRootError, match=rf"run_root '{ro}/run': cannot create the run folder: .*Read-only"):
                check_run_root(str(ro / "run"))
        finally:
            subprocess.run(["umount", str(ro)], check=True)
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(RunRootError, match=rf"run_root '{ro}/run': cannot create the run folder: .*Permission denied"):
            check_run_root(str(ro / "run"))
    assert "writable local folder" in check_run_root(str(tmp_path / "ok"))
