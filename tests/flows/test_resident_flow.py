"""Resident workers through the training flow on a local Ray (issue 27): 3 iterations with
``orchestration.workers=resident`` and ``checkpoint.every=3`` end with the weights of 3
iterations in stage mode; after its first iteration the resident run reads no model from
storage and builds no engine; the workers end with the run. The rewards vary inside each group
(``tests/varying.py``): each test first asserts non-zero advantages and a policy gradient."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from schemas import ShardRef, read_manifest, stage_uri  # noqa: E402
from tests.flows.conftest import flow_cfg  # noqa: E402
from tests.varying import REWARD, assert_training_signal  # noqa: E402
from tests.weights import policy_files  # noqa: E402


def _final_files(result) -> dict[str, str]:
    return policy_files(result.final_policy)


@pytest.mark.rotation(4)  # long (56 s): one turn in 8 (tests/rotation.py); every run checks the same equality in
# tests/rft_core/workers/test_resident.py, and groups 5, 6, 7 and 0 in tests/test_faults_resident.py's baseline
def test_resident_every_3_equals_stage_every_1(prefect_harness, tiny_model, tmp_path):
    import ray

    from flows.train import train
    from rft_core.stages import memo
    from rft_core.workers.pool import NAMESPACE, actor_name

    memo.clear()  # models another test kept in this process (tests.drive keeps stage mode's) would count as loaded
    stage = train(flow_cfg(tiny_model, tmp_path / "stage", iterations=3, **REWARD))
    assert_training_signal(tmp_path / "stage", (1, 2, 3))
    cfg = flow_cfg(tiny_model, tmp_path / "resident", iterations=3, **REWARD, **{"orchestration.workers": "resident",
                                                                                 "checkpoint.every": 3})
    resident = train(cfg)
    assert _final_files(resident) == _final_files(stage) and _final_files(stage)
    for it in (1, 2):  # between checkpoints: the experience and update shards, no weights
        m, _ = read_manifest(stage_uri(cfg.run_root, it, "ppo_update"))
        assert not any(e.path.startswith("policy/") for e in m.files)
    rows = resident.metrics
    loads = [r["run/model_loads"] for r in rows]
    builds = [r["run/engine_builds"] for r in rows]
    assert loads[0] == 3 and loads[1:] == [3, 3], loads  # engine, reference, trainer: iteration 1 only
    assert builds == [1, 1, 1], builds
    # each update but the last is synced to the rollout worker right after it (the sync ahead,
    # counted in its own iteration's row), before the next rollout asks for it
    assert [r.get("run/weight_syncs", 0) for r in rows] == [1, 2, 2]
    stage_loads = [r["run/model_loads"] for r in stage.metrics]
    # stage mode keeps its models (orchestration.keep_models, auto with the HF engine): iteration 1
    # reads the initial policy (its rollout, actor and reference passes) and the trainer, then nothing
    assert stage_loads[0] == 2 and stage_loads[1:] == [2, 2], stage_loads
    # the workers ended with the run
    for role in ("policy", "rollout", "reference"):
        with pytest.raises(ValueError):
            ray.get_actor(actor_name(cfg.run_root, role), namespace=NAMESPACE)
    assert ShardRef.from_manifest(stage_uri(cfg.run_root, 3, "ppo_update-optimizer")).stage == "optimizer_state"


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py); every run checks the same equality in one
# process (tests/rft_core/training/test_bf16_logprob_agreement.py)
def test_resident_bf16_lora_syncs_the_adapters_and_equals_stage_mode(prefect_harness, tiny_model, tmp_path):
    """A bfloat16 LoRA policy through the flow on a local Ray: the rollout worker (a Ray actor,
    given ``update.lora`` by ``WorkersConfig``) keeps the float32 adapters on its bfloat16 base
    and its syncs move the adapters only (``run/weight_sync_bytes``: 28 float32 matrices of rank 4
    per sync, between Ray actors over the shared-memory transport); the run commits stage mode's
    rollouts, advantages and final adapter, its adapter_config.json included (peft's set of
    target modules written sorted in every process: ``sorted_target_modules``)."""
    from flows.train import train

    lora = {"policy.dtype": "bfloat16", "update.lora.rank": 4, "update.lora.alpha": 8, **REWARD}
    stage = train(flow_cfg(tiny_model, tmp_path / "stage", iterations=3, **lora))
    assert_training_signal(tmp_path / "stage", (1, 2, 3))
    cfg = flow_cfg(tiny_model, tmp_path / "resident", iterations=3, **lora,
                   **{"orchestration.workers": "resident", "checkpoint.every": 3})
    resident = train(cfg)
    assert _final_files(resident) == _final_files(stage) and "policy/adapter_model.safetensors" in _final_files(stage)
    # the run's counters so far, per iteration: the syncs of updates 1 and 2 (the last update's weights are not synced)
    assert [r.get("run/weight_syncs", 0) for r in resident.metrics] == [1, 2, 2]
    # tests/tiny.py's Llama: 2 layers, hidden 32, MLP 64, 2 kv heads of 8; lora_A and lora_B of rank 4 on q, k, v, o
    # (32 -> 32, 16, 16, 32) and gate, up, down (32 -> 64, 64; 64 -> 32): 4 * (64 + 48 + 48 + 64 + 96 * 3) per layer
    adapter_bytes = 2 * 4 * (64 + 48 + 48 + 64 + 96 * 3) * 4
    assert [r.get("run/weight_sync_bytes", 0) for r in resident.metrics] == [adapter_bytes, 2 * adapter_bytes,
                                                                             2 * adapter_bytes]
    for it in (1, 2, 3):
        for name in ("rollout", "advantages"):
            a, b = (read_manifest(stage_uri(str(root), it, name))[0] for root in (tmp_path / "stage", cfg.run_root))
            assert {e.path: e.checksum for e in a.files} == {e.path: e.checksum for e in b.files}, (it, name)


@pytest.mark.rotation(7)  # long: one turn in 8 (tests/rotation.py; out of group 6, measured at 1042 s with it)
def test_resident_critic_keeps_its_model_and_commits_stage_modes_files(prefect_harness, tiny_model, tmp_path):
    """PPO with a critic (gae), 3 iterations: the resident critic worker computes the values on
    the critic it trained and continues its AdamW state in memory; every critic file and values
    shard, and the final policy, equal stage mode's, and after iteration 1 nothing is loaded."""
    from flows.train import train

    gae = {"advantage.estimator": "gae", "advantage.gae_lambda": 0.9, "critic.lr": 1e-2, **REWARD}
    stage = train(flow_cfg(tiny_model, tmp_path / "stage", iterations=3, **gae))
    assert_training_signal(tmp_path / "stage", (1, 2, 3))
    cfg = flow_cfg(tiny_model, tmp_path / "resident", iterations=3, **gae,
                   **{"orchestration.workers": "resident", "checkpoint.every": 3})
    resident = train(cfg)
    assert _final_files(resident) == _final_files(stage)

    def files(root, it, stage_name):
        m, _ = read_manifest(stage_uri(root, it, stage_name))
        return {e.path: e.checksum for e in m.files}

    for it in (1, 2, 3):
        for name in ("critic_values", "critic_update"):
            assert files(str(tmp_path / "stage"), it, name) == files(cfg.run_root, it, name), (it, name)
    loads = [r["run/model_loads"] for r in resident.metrics]
    # iteration 1: engine, reference, trainer, and the critic twice (values, then its update)
    assert loads[1:] == [loads[0]] * 2, loads


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
@pytest.mark.parametrize("where", ["gang", "beside"])
def test_a_sharded_critic_runs_in_its_gang_or_beside_the_workers_and_equals_stage_mode(prefect_harness, tiny_model,
                                                                                       tmp_path, own_process_group,
                                                                                       where):
    """PPO with an FSDP2 critic (critic.fsdp, one rank), 2 iterations under
    ``orchestration.workers=resident``: in its resident gang (``gang``: a critic worker of
    ``orchestration.critic_ranks`` 1 keeps the sharded critic and its AdamW state, so after
    iteration 1 the only model loaded is the critic of the values pass, which runs from storage:
    ``rft_core.workers.critic``) or, with ``runners.critic_values`` and
    ``runners.critic_update`` given, as those runners say beside the resident policy, rollout and
    reference workers (``beside``: in the flow's process, which keeps no model; no critic worker
    is started). Either way the run commits stage mode's critic files, values and final policy,
    and the second critic update continued the first's sharded AdamW state
    (``critic-optimizer/dcp``)."""
    from flows.train import train
    from rft_core.workers.pool import placements

    gae = {"advantage.estimator": "gae", "advantage.gae_lambda": 0.9, "critic.lr": 1e-2,
           "critic.fsdp.cpu_offload": False, **REWARD}
    stage = train(flow_cfg(tiny_model, tmp_path / "stage", iterations=2, **gae))
    assert_training_signal(tmp_path / "stage", (1, 2))
    beside = {"runners.critic_values.mode": "inprocess", "runners.critic_update.mode": "inprocess"}
    cfg = flow_cfg(tiny_model, tmp_path / "resident", iterations=2, **gae, **{"orchestration.workers": "resident"},
                   **(beside if where == "beside" else {}))
    assert cfg.runner("ppo_update").mode == "resident"
    assert cfg.runner("critic_update").mode == ("resident" if where == "gang" else "inprocess")
    assert not cfg.runner("critic_values").keep_models  # the flow's process holds no critic beside the workers
    resident = train(cfg)
    assert _final_files(resident) == _final_files(stage)

    def files(root, it, stage_name):
        m, _ = read_manifest(stage_uri(root, it, stage_name))
        # DCP's .metadata holds its folder's path and a random save id (torch.distributed.checkpoint StorageMeta)
        return {e.path: e.checksum for e in m.files if e.path != "critic-optimizer/dcp/.metadata"}

    for it in (1, 2):
        for name in ("critic_values", "critic_update"):
            assert files(str(tmp_path / "stage"), it, name) == files(cfg.run_root, it, name), (it, name)
    assert "critic-optimizer/dcp/__0_0.distcp" in files(cfg.run_root, 2, "critic_update")
    m, _ = read_manifest(stage_uri(cfg.run_root, 2, "critic_update"))
    assert m.summary["sharding"] == "fsdp2" and m.summary["optimizer"]["format"] == "fsdp"
    assert m.inputs["critic"] == read_manifest(stage_uri(cfg.run_root, 1, "critic_update"))[1]  # it continued update 1
    started = placements(cfg.run_root)  # every worker this process started, kept after the run stopped them
    assert {"policy", "rollout"} <= set(started) and ("critic" in started) == (where == "gang"), started
    loads = [r["run/model_loads"] for r in resident.metrics]
    if where == "gang":  # iteration 1: engine, reference, trainer, and the critic twice (values, then its update);
        assert loads == [5, 6], loads  # iteration 2: the critic of the values pass only


@pytest.mark.rotation(1)  # long: one turn in 8 (tests/rotation.py)
def test_resident_teacher_equals_stage_mode(prefect_harness, tiny_model, tmp_path):
    """On-policy distillation (a teacher: another tiny model with the policy's tokenizer) with the
    task reward, 2 iterations: the resident teacher worker loads the teacher once and commits the
    teacher log-probs, advantages and final policy of stage mode, file for file."""
    import ray

    from flows.train import train
    from rft_core.workers.pool import NAMESPACE, actor_name
    from tests.tiny import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", seed=1)
    distill = {"teacher.path": teacher, "teacher.coef": 0.5, **REWARD}
    stage = train(flow_cfg(tiny_model, tmp_path / "stage", iterations=2, **distill))
    assert_training_signal(tmp_path / "stage", (1, 2))
    cfg = flow_cfg(tiny_model, tmp_path / "resident", iterations=2, **distill,
                   **{"orchestration.workers": "resident", "checkpoint.every": 2})
    resident = train(cfg)

    def files(root, it, stage_name):
        m, _ = read_manifest(stage_uri(str(root), it, stage_name))
        return {e.path: e.checksum for e in m.files}

    for it in (1, 2):
        for name in ("teacher_logprobs", "advantages"):
            assert files(tmp_path / "stage", it, name) == files(cfg.run_root, it, name), (it, name)
    assert stage.metrics[0]["distill_reverse_kl"] != 0
    assert _final_files(resident) == _final_files(stage) and _final_files(stage)
    loads = [r["run/model_loads"] for r in resident.metrics]
    assert loads == [4, 4], loads  # engine, reference, trainer, teacher: iteration 1 only
    stage_loads = [r["run/model_loads"] for r in stage.metrics]
    assert stage_loads == [3, 3], stage_loads  # stage mode keeping its models: policy, teacher, trainer in iteration 1
    with pytest.raises(ValueError):  # the teacher worker ended with the run
        ray.get_actor(actor_name(cfg.run_root, "teacher"), namespace=NAMESPACE)
