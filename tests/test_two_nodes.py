"""Resident workers on a Ray cluster of two nodes (issue 36): ``ray.cluster_utils.Cluster`` starts
a head node (``node_a``) and a second node (``node_b``) on this machine, each its own raylet and
worker processes; the run root is a bucket of the S3 server the object-storage tests use (moto,
``tests/faults.py``). ``ray.options`` pins the policy trainer and the reference
to node_a and the rollout engine to node_b through custom node resources, so every weight sync
crosses from one node's worker process to the other's.

* 3 resident iterations (``checkpoint.every=3``: iterations 1 and 2 keep the policy in memory
  only) end with the weights of stage mode bit for bit (the same sha256), the workers where the
  options put them and their placement in the log;
* node_b is killed (its raylet and workers SIGKILLed: ``cluster.remove_node(...,
  allow_graceful=False)``) while its rollout worker runs the rollout of iteration 2 (asserted:
  the worker was running a stage and that rollout was not committed when the node died): the
  stage fails with ``WorkerError`` naming the rollout worker and the dead node, and no rollout of
  iteration 2 is committed; a rerun of the same run on a fresh node_b ends with the weights of
  the uninterrupted runs.

* only the driver's environment holds the S3 credentials and endpoint (the nodes start without
  them, as nodes started apart from the run do): the pool passes them to its workers, and a
  worker on node_b reads the bucket (issue 45).

The runs are driven without Prefect (``tests/drive.py``: the flow's stage order, each model stage
through ``run_stage`` with the config's runner). Rewards vary inside each group
(``tests/varying.py``); the equality is asserted after the advantages and policy losses are
shown not to be 0."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("s3fs")
pytest.importorskip("moto")

from schemas import read_manifest, stage_uri  # noqa: E402
from tests.weights import iteration_policy_files  # noqa: E402
from tests.drive import drive  # noqa: E402
from tests.faults import MotoServer, exists  # noqa: E402
from tests.varying import assert_training_signal, varying_config  # noqa: E402

pytestmark = pytest.mark.timeout(600)
PINNED = {"policy": {"resources": {"node_a": 1}}, "reference": {"resources": {"node_a": 1}},
          "rollout": {"resources": {"node_b": 1}}}
# a dead node is noticed in ~3 s (Ray's default: 5 missed checks 3 s apart)
FAST_FAILURE_DETECTION = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def _policy_files(run_root: str, iteration: int = 3) -> dict[str, str]:
    return iteration_policy_files(run_root, iteration)


def _title(pid: int) -> str:
    """The process title Ray gives a worker (``ray::RolloutWorker.run`` while the rollout worker runs a stage)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def two_nodes(tiny_model, tmp_path_factory):
    """(cluster, node_b, S3 server): the nodes start without any ``AWS_*`` variable; the S3
    credentials and endpoint are set in the driver's environment only, after the nodes started
    (as on a cluster started apart from the run), so a worker reaches the bucket only through
    what the pool passes it."""
    import ray
    import s3fs
    from ray.cluster_utils import Cluster

    d = tmp_path_factory.mktemp("two-nodes")
    server = MotoServer(d)
    mp = pytest.MonkeyPatch()
    cluster = None
    try:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(k)
        mp.setenv("RFT_CACHE_DIR", str(d / "cache"))
        mp.setenv("RFT_WORKER_PLACEMENT_TIMEOUT_S", "120")  # a worker's first start on a loaded machine
        ray.shutdown()  # a local Ray another test started; this test's driver joins the cluster instead
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 4},
                                                                "_system_config": FAST_FAILURE_DETECTION})
        node_b = cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        for k, v in server.env().items():  # the driver's environment only
            mp.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        server.client().create_bucket(Bucket="rft")
        yield {"cluster": cluster, "node_b": node_b, "server": server, "model": tiny_model}
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        mp.undo()
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="module")
def stage_root(two_nodes) -> str:
    """The run root of 3 stage-mode iterations in the driver (the reference weights)."""
    root = "s3://rft/stage"
    drive(varying_config(two_nodes["model"], root, iterations=3))
    assert_training_signal(root, (1, 2, 3))
    return root


@pytest.mark.rotation(2)  # with group 2's two-node test, which starts the same cluster (two_nodes); tests/rotation.py
def test_credentials_only_in_the_driver_reach_the_workers_on_two_nodes(two_nodes, monkeypatch):
    """Issue 45, finding 4: with an S3 run root, the credentials and endpoint that
    docs/reliability.md tells users to export (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_ENDPOINT_URL``) are in the driver's environment only. The rollout worker, pinned to
    node_b, sees them and reads an object the driver wrote to the bucket."""
    import fsspec
    import ray

    from rft_core.config import RayConfig, WorkersConfig
    from rft_core.workers.pool import start_gang, stop_workers

    pool, probe = "s3://rft/credentials", "s3://rft/credentials/probe.txt"
    with fsspec.open(probe, "wb") as f:
        f.write(b"written by the driver")

    def storage_view(_actor):
        """In the worker: its node, its AWS variables, and the probe read back (when it has an endpoint)."""
        import os

        import fsspec
        import ray

        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        data = None
        if "AWS_ENDPOINT_URL" in env:  # without it s3fs would try AWS itself, which this machine cannot reach
            with fsspec.open(probe, "rb") as f:
                data = f.read()
        return {"node": ray.get_runtime_context().get_node_id(), "env": env, "data": data}

    workers = WorkersConfig(pool=pool, ray=RayConfig(address=two_nodes["cluster"].address, options=PINNED), threads=1)
    try:
        seen = ray.get(start_gang(workers, "rollout")[0].__ray_call__.remote(storage_view), timeout=120)
    finally:
        stop_workers(pool)
    assert seen["node"] == two_nodes["node_b"].node_id != two_nodes["cluster"].head_node.node_id
    assert seen["env"] == two_nodes["server"].env()
    assert seen["data"] == b"written by the driver"


def _resident(env, run_root: str):
    cfg = varying_config(env["model"], run_root, "orchestration.workers=resident", "checkpoint.every=3",
                         f"ray.address={env['cluster'].address}",
                         f"ray.options={json.dumps(PINNED)}", iterations=3)
    return cfg, (lambda inp: _run(cfg, inp))


def _run(cfg, inp):
    from rft_core.api import run_stage

    return run_stage(inp, cfg.runner(inp.stage))


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_resident_on_two_nodes_equals_stage_mode(two_nodes, stage_root, caplog):
    from rft_core.workers.pool import placements, stop_workers

    cluster, node_b = two_nodes["cluster"], two_nodes["node_b"]
    cfg, run = _resident(two_nodes, "s3://rft/resident")
    try:
        with caplog.at_level(logging.INFO, logger="rft_core.workers"):
            drive(cfg, run)
        where = placements(cfg.run_root)
        assert where["policy"]["node_id"] == where["reference"]["node_id"] == cluster.head_node.node_id
        assert where["rollout"]["node_id"] == node_b.node_id != cluster.head_node.node_id
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for role in ("policy", "rollout", "reference"):  # the placement is in the run's log
            assert f"resident worker {role} of {cfg.run_root}: node {where[role]['node_id']}" in logged, logged
    finally:
        stop_workers(cfg.run_root)
    assert_training_signal(cfg.run_root, (1, 2, 3))
    for it in (1, 2):  # between checkpoints the policy lived only in the workers' memory
        m, _ = read_manifest(stage_uri(cfg.run_root, it, "ppo_update"))
        assert not any(e.path.startswith("policy/") for e in m.files)
    assert _policy_files(cfg.run_root) == _policy_files(stage_root) and _policy_files(cfg.run_root)


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_killing_the_rollout_node_mid_iteration_then_rerun(two_nodes, stage_root):
    import ray

    from rft_core.workers.pool import WorkerError, placements

    cluster, node_b = two_nodes["cluster"], two_nodes["node_b"]
    cfg, run = _resident(two_nodes, "s3://rft/killed")
    rollout_2 = stage_uri(cfg.run_root, 2, "rollout")
    kill: dict = {}

    def killer() -> None:
        """Once iteration 2 has started (its prompts committed) and the rollout worker runs a
        stage (its rollout: the sync of iteration 1's weights, then generation), SIGKILL node_b:
        the worker's process first (``remove_node`` kills the raylet, whose workers notice only
        later: a tiny model's rollout then still committed, CI 2026-12-01), then the node."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not kill:
            pid = placements(cfg.run_root).get("rollout", {}).get("pid")
            if pid and exists(f"{stage_uri(cfg.run_root, 2, 'prompts')}/_MANIFEST.json"):
                title = _title(pid)
                if title.startswith("ray::RolloutWorker.run"):
                    # the replacement the run then asks for cannot be placed (no node_b): fail in 5 s, not 120
                    os.environ["RFT_WORKER_PLACEMENT_TIMEOUT_S"] = "5"
                    os.kill(pid, signal.SIGKILL)
                    cluster.remove_node(node_b, allow_graceful=False)
                    kill.update(title=title, rollout_committed=exists(f"{rollout_2}/_MANIFEST.json"),
                                node=placements(cfg.run_root)["rollout"]["node_id"])
                    return
            time.sleep(0.01)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pytest.raises(WorkerError) as err:
        drive(cfg, run)
    thread.join(10)
    print(f"two nodes: killed node_b ({kill.get('title')!r}); the stage failed with: {err.value}")
    # the kill landed mid-iteration 2, inside the rollout worker's stage, on node_b
    assert kill, "node_b was never killed"
    assert kill["title"].startswith("ray::RolloutWorker.run") and not kill["rollout_committed"], kill
    assert kill["node"] == node_b.node_id
    # the stage failed naming the role and the node
    assert "the rollout worker of s3://rft/killed" in str(err.value) and node_b.node_id in str(err.value), err.value
    assert not exists(f"{rollout_2}/_MANIFEST.json")
    assert exists(f"{stage_uri(cfg.run_root, 1, 'ppo_update')}/_MANIFEST.json")

    # the run ends (its process, and with it the workers it owns); a rerun on a fresh node_b
    os.environ["RFT_WORKER_PLACEMENT_TIMEOUT_S"] = "120"  # the fixture's value again (its MonkeyPatch restores it)
    ray.shutdown()
    fresh = two_nodes["node_b"] = cluster.add_node(num_cpus=2, resources={"node_b": 1})
    cluster.wait_for_nodes()
    from rft_core.workers.pool import stop_workers

    try:
        drive(cfg, run)
        assert placements(cfg.run_root)["rollout"]["node_id"] == fresh.node_id
    finally:
        stop_workers(cfg.run_root)
    assert_training_signal(cfg.run_root, (1, 2, 3))
    assert _policy_files(cfg.run_root) == _policy_files(stage_root)
