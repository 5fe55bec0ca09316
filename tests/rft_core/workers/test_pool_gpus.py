"""Resident workers' Ray options (issue 36): every model role gets a GPU by default when the
cluster has GPUs, the rollout worker of vLLM/SGLang its tensor-parallel GPUs, a one-GPU
cluster shares its GPU, ``ray.options`` overrides any of it; where each actor
landed is logged, and an actor Ray cannot place fails naming the role instead of waiting forever.

The cluster test runs a real Ray cluster (``ray.cluster_utils.Cluster``) whose node declares 2
GPUs: Ray schedules by the declared count and sets ``CUDA_VISIBLE_DEVICES`` in the actor, which
is what the options decide, with no GPU present."""
from __future__ import annotations

import logging
import os

import pytest

from rft_core.config import RayConfig, TrainConfig, WorkersConfig
from rft_core.workers.pool import actor_options

W = WorkersConfig(pool="p")


@pytest.mark.parametrize("gpus, role, engine, want", [
    (0, "policy", 1, {"num_cpus": 0}),                    # CPU cluster: as before issue 36
    (0, "rollout", 2, {"num_cpus": 0}),
    (8, "policy", 1, {"num_cpus": 0, "num_gpus": 1}),
    (8, "reference", 1, {"num_cpus": 0, "num_gpus": 1}),
    (8, "critic", 1, {"num_cpus": 0, "num_gpus": 1}),
    (8, "rollout", 1, {"num_cpus": 0, "num_gpus": 1}),
    (8, "rollout", 2, {"num_cpus": 0, "num_gpus": 2}),   # vLLM/SGLang tensor parallel 2
    (8, "reference", 2, {"num_cpus": 0, "num_gpus": 1}),  # engine GPUs concern the rollout only
    (2, "policy", 1, {"num_cpus": 0, "num_gpus": 1}),
    (1, "policy", 1, {"num_cpus": 0, "num_gpus": 0.2}),  # one GPU: the 5 roles share it
    (1, "rollout", 1, {"num_cpus": 0, "num_gpus": 0.2}),
])
def test_default_options(gpus, role, engine, want):
    assert actor_options(W.model_copy(update={"rollout_gpus": engine}), role, cluster_gpus=gpus) == want


def test_worker_options_override_the_defaults():
    w = WorkersConfig(pool="p", rollout_gpus=2, ray=RayConfig(options={
        "reference": {"num_gpus": 0.5}, "rollout": {"resources": {"node_b": 1}}, "policy": {"num_cpus": 2, "num_gpus": 0},
        "rollout_shard": {"num_gpus": 3}}))  # the fan-out's tasks: no worker's
    assert actor_options(w, "reference", cluster_gpus=8) == {"num_cpus": 0, "num_gpus": 0.5}
    assert actor_options(w, "rollout", cluster_gpus=8) == {"num_cpus": 0, "num_gpus": 2,
                                                                          "resources": {"node_b": 1}}
    assert actor_options(w, "policy", cluster_gpus=8) == {"num_cpus": 2, "num_gpus": 0}
    assert actor_options(w, "critic", cluster_gpus=0) == {"num_cpus": 0}


def test_the_config_reaches_the_pool():
    """ray.options -> TrainConfig.runner -> WorkersConfig.ray.options, per stage."""
    cfg = TrainConfig(run_root="/tmp/r", orchestration={"workers": "resident"},
                      ray={"options": {"rollout": {"num_gpus": 2}}})
    workers = cfg.runner("rollout").workers
    assert actor_options(workers, "rollout", cluster_gpus=8) == {"num_cpus": 0, "num_gpus": 2}
    assert actor_options(cfg.runner("ppo_update").workers, "policy", cluster_gpus=8) == {"num_cpus": 0, "num_gpus": 1}


@pytest.mark.parametrize("rollout, gpus", [
    ({}, 1),                                                                   # hf
    ({"engine": "vllm"}, 1),
    ({"engine": "vllm", "vllm": {"tensor_parallel_size": 4}}, 4),
    ({"engine": "sglang", "sglang": {"tensor_parallel_size": 2}}, 2),
    ({"engine": "hf", "vllm": {"tensor_parallel_size": 4}}, 1),              # another engine's settings: unused
])
def test_the_rollout_worker_gets_its_engines_gpus_whichever_stage_starts_it(rollout, gpus):
    """The rollout worker is started by the first stage that needs it: the rollout, or (a run
    resumed after its rollout was committed) the actor pass, whose input carries no engine
    settings. Either way it gets the engine's tensor-parallel GPUs, which every later rollout on
    that worker needs."""
    cfg = TrainConfig(run_root="/tmp/r", orchestration={"workers": "resident"}, rollout=rollout)
    for stage in ("rollout", "actor_logprobs"):
        workers = cfg.runner(stage).workers
        assert workers.rollout_gpus == gpus, stage
        assert actor_options(workers, "rollout", cluster_gpus=8)["num_gpus"] == gpus, stage
    assert actor_options(cfg.runner("ref_logprobs").workers, "reference", cluster_gpus=8)["num_gpus"] == 1


@pytest.fixture
def gpu_cluster():
    """A one-node Ray cluster whose node declares 2 GPUs (and no CPU to spare: actors take 0)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a local Ray another test started
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.rotation(1)  # long: one turn in 8 (tests/rotation.py)
def test_actors_get_gpus_on_a_cluster_with_gpus(gpu_cluster, tmp_path, caplog, monkeypatch):
    import ray

    from rft_core.workers.pool import WorkerError, placements, start_gang, stop_workers

    pool = str(tmp_path / "run")
    workers = WorkersConfig(pool=pool, ray=RayConfig(address=gpu_cluster.address, options={"critic": {"num_gpus": 0}}),
                            threads=1)
    tp2 = workers.model_copy(update={"rollout_gpus": 2})  # the rollout worker of a vLLM engine of tensor parallel 2
    try:
        with caplog.at_level(logging.INFO, logger="rft_core.workers"):
            reference = start_gang(workers, "reference")[0]
        assert ray.cluster_resources()["GPU"] == 2
        where = placements(pool)["reference"]
        assert len(where["gpus"]) == 1 and where["gpus"][0] in ("0", "1")
        assert where["node_id"] == gpu_cluster.head_node.node_id
        # what the actor's CUDA libraries would see: the GPU Ray gave it
        assert ray.get(reference.__ray_call__.remote(lambda _: os.environ["CUDA_VISIBLE_DEVICES"])) == where["gpus"][0]
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resident worker reference")]
        assert logged and f"node {where['node_id']}" in logged[0] and str(where["gpus"]) in logged[0], logged

        # the override: the critic asks for no GPU and gets none
        start_gang(workers, "critic")
        assert placements(pool)["critic"]["gpus"] == []
        # a vLLM engine of tensor parallel 2 needs both GPUs; the reference holds one: never placed
        # (a 5 s limit for this one only: an actor that can be placed may take longer to start on a loaded machine)
        monkeypatch.setenv("RFT_WORKER_PLACEMENT_TIMEOUT_S", "5")
        with pytest.raises(WorkerError, match=r"the rollout worker of .* could not be placed within 5 s") as err:
            start_gang(tp2, "rollout")
        assert "'num_gpus': 2" in str(err.value) and gpu_cluster.head_node.node_id in str(err.value)
        # with the GPU free again it is placed, on both GPUs
        assert sorted(stop_workers(pool)) == ["critic", "reference"]
        monkeypatch.delenv("RFT_WORKER_PLACEMENT_TIMEOUT_S")
        start_gang(tp2, "rollout")
        assert sorted(placements(pool)["rollout"]["gpus"]) == ["0", "1"]
    finally:
        stop_workers(pool)
