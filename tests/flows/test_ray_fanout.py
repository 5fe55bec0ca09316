"""Rollout fan-out on a local Ray cluster (127.0.0.1) through prefect-ray: 2 parallel shards in
2 Ray worker processes whose merged rollout equals the single-worker rollout byte for byte."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("prefect_ray")

from rft_core.config import RayConfig, RunnerConfig  # noqa: E402
from rft_core.stages import prompts as prompts_stage  # noqa: E402
from rft_core.stages import rollout as rollout_stage  # noqa: E402
from rft_core.stages.contracts import PromptsInput, RolloutInput  # noqa: E402
from schemas import read_manifest, read_shard  # noqa: E402
from tests.flows.conftest import flow_cfg  # noqa: E402


@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_two_ray_shards_union_equals_single_worker_rollout(prefect_harness, tiny_model, tmp_path):
    from flows.fanout import sharded_rollout, shard_uri

    # 4 prompts x 2 samples in batches of 4 sequences: 2 engine batches, one per shard
    cfg = flow_cfg(tiny_model, tmp_path / "run", **{"data.prompts_per_iteration": 4, "rollout.n_samples_per_prompt": 2,
                                                    "rollout.batch_size": 4, "rollout.max_new_tokens": 5})
    p = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "prompts")))
    inp = RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, out=str(tmp_path / "single"))
    single = rollout_stage.run(inp)
    # Ray workers default to 1 torch thread; the same thread count as here gives bit-equal matmuls
    threads = {"env_vars": {"OMP_NUM_THREADS": str(torch.get_num_threads())}}
    ray = RayConfig(init_kwargs={"num_cpus": 2, "include_dashboard": False, "_node_ip_address": "127.0.0.1",
                                 "runtime_env": threads})
    out = str(tmp_path / "fanout" / "rollout")
    merged = sharded_rollout(inp.model_copy(update={"out": out}), RunnerConfig(shards=2), ray)
    assert merged.config_hash == single.config_hash and merged.num_rows == single.num_rows == 8
    want, _ = read_manifest(single.uri)
    got, _ = read_manifest(merged.uri)
    assert [(f.path, f.checksum) for f in got.files] == [(f.path, f.checksum) for f in want.files]
    # the merged manifest keeps what the iteration's metrics read from the rollout (issue 39)
    versions = ("policy_version", "staleness")
    assert {k: got.summary[k] for k in versions} == {k: want.summary[k] for k in versions} == {"policy_version": 0,
                                                                                             "staleness": 0}
    # each shard holds half of the samples and ran in its own Ray worker process, not here
    shards = [read_manifest(shard_uri(out, i, 2))[0] for i in range(2)]
    assert [s.num_rows for s in shards] == [4, 4]
    workers = {s.summary["worker"] for s in shards}
    assert len(workers) == 2 and all(not w.endswith(f":{os.getpid()}") for w in workers)
    ids = [set(read_shard(shard_uri(out, i, 2)).column("sample_id").to_pylist()) for i in range(2)]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == set(read_shard(single).column("sample_id").to_pylist())
