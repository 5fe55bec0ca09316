"""Resident workers in one process (``PolicyWorker``, ``RolloutWorker``, ``ReferenceWorker`` objects, no Ray): the same stage programs
with models from memory give the weights and shards of stage mode, an update between
checkpoints keeps its weights in memory only, a crash is recovered exactly from the last
checkpoint, and a failed weight sync never leaves the engine serving half-updated weights. Every
run here has rewards that vary inside each group (``tests/varying.py``), and each equality test
first asserts that the advantages and the policy gradient of what it compares are not 0."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rft_core.config import load_config
from rft_core.models.loading import load_causal_lm
from rft_core.stages.checkpoints import WeightlessPolicyError, policy_model_path
from rft_core.counters import COUNTS
from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY, has_weights, policy_chain, weights_stage
from rft_core.stages.writer import wait_for_optimizer_writes
from rft_core.weightsync import landing as landing_module
from rft_core.weightsync.digest import method_of
from rft_core.workers.policy import PolicyWorker
from rft_core.workers.pool import ROLE_OF_PROGRAM
from rft_core.workers.reference import ReferenceWorker
from rft_core.workers.rollout import RolloutWorker
from rft_core.weightsync.plan import WeightSyncError
from rft_core.weightsync.trained import inference_tensors
from schemas import ShardRef, read_manifest, stage_uri
from tests.drive import drive
from tests.varying import assert_training_signal, reward_args
from tests.weights import policy_files

BASE = [*reward_args(), "data.prompts_per_iteration=4", "data.size=50", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=12",
        "rollout.batch_size=8", "kl.kl_coef=0.05", "update.lr=1e-3", "update.micro_batch_size=4", "update.epochs=2",
        "iterations=3"]


def _cfg(model: str, root, *extra: str):
    return load_config(None, [*BASE, f"policy.path={model}", f"run_root={root}", *extra])


def _pool(**rollout) -> dict:
    policy = PolicyWorker("test")
    return {"policy": policy, "rollout": RolloutWorker("test", peer=policy, **rollout),
            "reference": ReferenceWorker("test")}


def _runner(pool):
    return lambda inp: pool[ROLE_OF_PROGRAM[inp.program]].run(inp)


def _weight_files(ref: ShardRef) -> dict[str, str]:
    return policy_files(ref, suffix=".safetensors")


@pytest.fixture(scope="module")
def stage_run(tiny_model, tmp_path_factory):
    """3 iterations in stage mode (checkpoint.every=1): the reference result."""
    root = tmp_path_factory.mktemp("stage")
    cfg = _cfg(tiny_model, root)
    return cfg, drive(cfg)


def test_resident_every_3_ends_with_the_stage_mode_weights(stage_run, tiny_model, tmp_path):
    cfg_s, final_s = stage_run
    assert_training_signal(cfg_s.run_root, (1, 2, 3))
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=3")
    pool = _pool()
    COUNTS.clear()
    loads: list[float] = []
    final = drive(cfg, _runner(pool), on_iteration=lambda m: loads.append(COUNTS["model_loads"]))
    assert _weight_files(final) == _weight_files(final_s) and _weight_files(final)
    # iterations 1 and 2 kept their weights in memory: no files, a digest and the input instead
    for it in (1, 2):
        ref = ShardRef.from_manifest(stage_uri(cfg.run_root, it, "ppo_update"))
        assert not has_weights(ref)
        summary = read_manifest(ref.uri)[0].summary
        assert method_of(summary[WEIGHTS_DIGEST_KEY]) == "xxh3" and summary["update_input"]["policy"]
        assert not (tmp_path / f"iter={it:06d}" / "ppo_update-optimizer").exists()
    assert (tmp_path / "iter=000003" / "ppo_update-optimizer" / "_MANIFEST.json").exists()
    from rft_core.inspect import run_status

    kinds = {r["iteration"]: r["checkpoint"] for r in run_status(str(tmp_path)) if r["stage"] == "ppo_update"}
    assert kinds == {1: "in memory", 2: "in memory", 3: "weights + optimizer"}  # what `rft inspect` shows
    # models read from storage: the engine's, the reference and the trainer's, all in iteration 1
    assert loads == [3, 3, 3]
    assert [s["version"].split("@")[0].rsplit("/", 2)[-2] for s in pool["rollout"].syncs] == ["iter=000001", "iter=000002"]
    # the metrics and shards of every stage equal stage mode's (the engine saw the same weights)
    for it in (1, 2, 3):
        for stage in ("rollout", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update"):
            a, b = (read_manifest(stage_uri(c.run_root, it, stage))[0] for c in (cfg_s, cfg))
            parts = lambda m: {e.path: e.checksum for e in m.files if e.path.endswith(".parquet")}  # noqa: E731
            assert parts(a) == parts(b), (it, stage)


def test_a_sync_ahead_lands_each_update_before_the_next_rollout_and_changes_no_bit(stage_run, tiny_model, tmp_path):
    """The flow hands each update but the last to the rollout worker right after it
    (``RolloutWorker.sync_ahead``, ``TrainConfig.syncs_rollout_ahead``): here the same calls in one
    process. The rollouts then find their version held (no sync of their own), and every shard and
    the final weights equal stage mode's."""
    cfg_s, final_s = stage_run
    assert_training_signal(cfg_s.run_root, (1, 2, 3))  # the compared updates moved the weights
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=3")
    assert [cfg.syncs_rollout_ahead(i) for i in (1, 2, 3)] == [True, True, False]
    pool = _pool()
    base, rollout_syncs = _runner(pool), []

    def run(inp):
        pool["rollout"].settle()  # a sync ahead still landing counts before the stage, not in it
        before = len(pool["rollout"].syncs)
        out = base(inp)
        if inp.program == "rollout":
            rollout_syncs.append(len(pool["rollout"].syncs) - before)
        iteration = int(Path(inp.out).parent.name.split("=")[1])
        if inp.program == "ppo_update" and cfg.syncs_rollout_ahead(iteration):
            pool["rollout"].sync_ahead(out, cfg.policy.dtype)
        return out

    final = drive(cfg, run)
    assert rollout_syncs == [0, 0, 0]  # iteration 1 loads the initial policy; 2 and 3 found theirs synced ahead
    assert [s["version"].split("@")[0].rsplit("/", 2)[-2] for s in pool["rollout"].syncs] == ["iter=000001", "iter=000002"]
    assert _weight_files(final) == _weight_files(final_s) and _weight_files(final)
    for it in (2, 3):
        for stage in ("rollout", "actor_logprobs", "ppo_update"):
            a, b = (read_manifest(stage_uri(c.run_root, it, stage))[0] for c in (cfg_s, cfg))
            assert {e.path: e.checksum for e in a.files if e.path.endswith(".parquet")} == \
                {e.path: e.checksum for e in b.files if e.path.endswith(".parquet")}, (it, stage)


def test_a_sync_ahead_is_waited_for_by_the_next_call_and_a_failed_one_raises_nothing(monkeypatch, caplog):
    """``sync_ahead`` returns at once; ``run``, ``stats`` and ``close`` wait for it (``settle``). One
    that fails is logged, leaves the copy holding no version, and raises nothing (the rollout's
    own sync raises, if it fails again)."""
    import threading
    import time

    worker = RolloutWorker("test")
    landed = threading.Event()

    def slow(ref, *, dtype, role):
        time.sleep(0.5)
        worker.version = ref
        landed.set()
        return None

    monkeypatch.setattr(worker, "inference_model", slow)
    t0 = time.perf_counter()
    worker.sync_ahead("v1", "float32")
    assert time.perf_counter() - t0 < 0.4 and not landed.is_set()  # returned before the sync landed
    stats = worker.stats()
    assert landed.is_set() and stats["version"] == "v1"  # stats waited for it

    def failing(ref, *, dtype, role):
        worker.version = None
        raise WeightSyncError("the digests differ")

    monkeypatch.setattr(worker, "inference_model", failing)
    with caplog.at_level("WARNING", logger="rft_core.workers"):
        worker.sync_ahead("v2", "float32")
        worker.settle()
    assert worker.version is None and "sync ahead of path:v2 failed (WeightSyncError: the digests differ)" in caplog.text
    worker.close()  # nothing pending: returns

def test_a_weightless_update_is_refused_from_storage_and_chains_to_its_checkpoint(stage_run, tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=3")
    drive(cfg, _runner(_pool()), stop_after=2)
    ref2 = ShardRef.from_manifest(stage_uri(cfg.run_root, 2, "ppo_update"))
    with pytest.raises(WeightlessPolicyError, match=r"kept its weights in memory \(checkpoint.every > 1.*Resume the run"):
        policy_model_path(ref2)
    base, chain = policy_chain(ref2)
    assert base == tiny_model and [c.uri for c in chain] == [stage_uri(cfg.run_root, i, "ppo_update") for i in (1, 2)]
    # a stage process of its own (no runner: nothing kept) cannot run an update without a checkpoint
    with pytest.raises(ValueError, match="resident worker .* or in a process that keeps its models"):
        from rft_core.stages.runner import run_stage
        from rft_core.stages.contracts import PPOUpdateInput

        inp = PPOUpdateInput.model_validate(read_manifest(ref2.uri)[0].summary["update_input"])
        run_stage(inp.model_copy(update={"out": str(tmp_path / "elsewhere")}))


def test_crash_after_two_iterations_recovers_exactly(stage_run, tiny_model, tmp_path):
    """New workers (a crash lost the first ones) rebuild the policy of iteration 2 from the
    initial model by re-applying the two committed updates, then finish with stage mode's weights."""
    cfg_s, final_s = stage_run
    assert_training_signal(cfg_s.run_root, (1, 2, 3))
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=3")
    drive(cfg, _runner(_pool()), stop_after=2)
    COUNTS.clear()
    pool = _pool()
    final = drive(cfg, _runner(pool))
    assert _weight_files(final) == _weight_files(final_s)
    assert COUNTS["recovered_updates"] == 2


def test_a_failed_sync_leaves_the_engine_without_a_version_until_one_lands(stage_run, tiny_model, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=3")
    pool = _pool()
    drive(cfg, _runner(pool), stop_after=1)
    engine = pool["rollout"]
    real, flipped = landing_module.IntoTensors.put, []

    def corrupted(self, name, src, digest):
        if not flipped:  # one bit flipped in transit: the landed weights' digest must differ from the sent one
            src = src.clone()
            src.view(-1).view(torch.uint8)[0] ^= 1
            flipped.append(name)
        return real(self, name, src, digest)

    monkeypatch.setattr(landing_module.IntoTensors, "put", corrupted)
    ref1 = ShardRef.from_manifest(stage_uri(cfg.run_root, 1, "ppo_update"))
    with pytest.raises(WeightSyncError, match="digest"):
        engine.inference_model(ref1, dtype="float32", role="policy")
    assert engine.version is None  # never served: the next request syncs again
    monkeypatch.setattr(landing_module.IntoTensors, "put", real)
    model = engine.inference_model(ref1, dtype="float32", role="policy")
    trainer = pool["policy"].held.strategy.model
    initial = load_causal_lm(tiny_model).state_dict()
    assert max((v - initial[k]).abs().max().item() for k, v in trainer.state_dict().items()) > 1e-4  # it trained
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trainer.state_dict().values()))


def test_config_refuses_what_resident_workers_do_not_cover(tiny_model, tmp_path):
    from rft_core.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.every=3 keeps the policy in memory between checkpoints"):
        _cfg(tiny_model, tmp_path, "checkpoint.every=3", "orchestration.keep_models=false")
    with pytest.raises(ConfigError, match="orchestration.policy_ranks=2: several policy ranks are DeepSpeed"):
        _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "orchestration.policy_ranks=2")
    with pytest.raises(ConfigError, match="orchestration.critic_ranks=2: several critic ranks are DeepSpeed"):
        _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "advantage.estimator=gae",
             "orchestration.critic_ranks=2")
    with pytest.raises(ConfigError, match="orchestration.critic_ranks=2 with runners.critic_update: the critic's stages"):
        _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "advantage.estimator=gae",
             "critic.fsdp.cpu_offload=false", "orchestration.critic_ranks=2", "runners.critic_update.launcher=torchrun",
             "runners.critic_update.mode=subprocess", "runners.critic_update.nproc_per_node=2")
    no_critic = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "orchestration.critic_ranks=2")
    assert not no_critic.needs_critic and not no_critic.resident_blockers()  # nothing to refuse without a critic
    # a DeepSpeed or FSDP2 critic runs in its resident gang, or with runners.critic_* given as they say beside the
    # resident workers; the other stages stay resident
    for sharded in ("critic.deepspeed.zero_stage=2", "critic.fsdp.cpu_offload=false"):
        gang = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "advantage.estimator=gae", sharded)
        assert "critic_update" in gang.resident_stages and gang.runner("critic_values").mode == "resident"
        cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "advantage.estimator=gae", sharded,
                   "runners.critic_update.launcher=torchrun", "runners.critic_update.mode=subprocess",
                   "runners.critic_update.nproc_per_node=2")
        assert cfg.resident_stages == ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update", "teacher_logprobs")
        assert (cfg.runner("critic_update").mode, cfg.runner("critic_update").launcher) == ("subprocess", "torchrun")
        assert cfg.runner("critic_values").mode == "inprocess" and cfg.runner("ppo_update").mode == "resident"
        assert "critic_values" not in cfg.first_resident_stages and "ppo_update" in cfg.first_resident_stages
    with pytest.raises(ConfigError, match="runners.critic_update sets how critic_update starts a process of its own"):
        _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "advantage.estimator=gae",
             "runners.critic_update.mode=subprocess")  # a one-process critic runs in its resident worker
    for engine in ("vllm", "sglang"):  # in-memory sync into the GPU engines; one version held
        _cfg(tiny_model, tmp_path, "orchestration.workers=resident", f"rollout.engine={engine}")
        with pytest.raises(ConfigError, match=f"rollout.max_staleness=2 with rollout.engine={engine}"):
            _cfg(tiny_model, tmp_path, "orchestration.workers=resident", f"rollout.engine={engine}",
                 "rollout.max_staleness=2")
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=2")
    assert [cfg.is_checkpoint(i) for i in (1, 2, 3)] == [False, True, True]  # every 2nd and the last
    assert cfg.runner("ppo_update").mode == "resident" and cfg.runner("rewards").mode == "inprocess"
    assert json.loads(cfg.runner("rollout").workers.model_dump_json())["pool"] == str(tmp_path)


TIMINGS = {"seconds", "tokens_per_second", "checkpoint_seconds"}


def test_every_1_commits_the_same_files_and_manifests_as_stage_mode(stage_run, tiny_model, tmp_path):
    """checkpoint.every=1, both modes writing their checkpoints in the background (the default):
    every file (Parquet parts, weights, tokenizer, optimizer state) has the stage-mode checksum;
    manifests differ only in timings and dates, and in the config hashes and input checksums that
    follow from them (an input's manifest checksum covers its timings)."""
    cfg_s, _ = stage_run
    assert_training_signal(cfg_s.run_root, (1, 2, 3))
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident")
    assert cfg.background_checkpoint and cfg_s.background_checkpoint
    drive(cfg, _runner(_pool()))
    wait_for_optimizer_writes()
    for it in (1, 2, 3):
        for stage in ("prompts", "rollout", "rewards", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update",
                      "ppo_update-optimizer", "ppo_update-policy"):
            a, b = (json.loads(Path(stage_uri(c.run_root, it, stage), "_MANIFEST.json").read_text()) for c in (cfg_s, cfg))
            assert a["files"] == b["files"], (it, stage)
            assert a["contract"] == b["contract"]
            assert {k for k in a if a[k] != b[k]} <= {"config_hash", "inputs", "summary", "created_at"}, (it, stage)
            # update_input: the update's own input, recorded for recovery, names its inputs (their URIs and checksums)
            assert {k for k in a["summary"] if a["summary"][k] != b["summary"].get(k)} <= TIMINGS | {"update_input"}, \
                (it, stage)
            assert set(a["summary"]) == set(b["summary"])
    prompts = [read_manifest(stage_uri(c.run_root, 1, "prompts"))[0] for c in (cfg_s, cfg)]
    assert prompts[0].config_hash == prompts[1].config_hash  # no inputs: the hash is the config's alone


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py); the full-weight every_3 test runs every time
def test_lora_resident_every_3_equals_stage_mode(tiny_model, tmp_path):
    """A float32 LoRA policy: the trainer keeps its adapters, the rollout worker (given the run's
    ``update.lora``, ``WorkersConfig.lora``) gets the merged weights (peft's merge_and_unload on a
    copy, as a stage-mode pass merges the adapter checkpoint on load in float32,
    ``keeps_adapters``); every shard of every iteration and the final adapter equal stage mode's
    bit for bit. Below float32 the copy keeps the adapters: test_bf16_logprob_agreement.py."""
    lora = ["update.lora.rank=4", "update.lora.alpha=8"]
    cfg_s = _cfg(tiny_model, tmp_path / "stage", *lora)
    final_s = drive(cfg_s)
    assert_training_signal(cfg_s.run_root, (1, 2, 3))
    cfg = _cfg(tiny_model, tmp_path / "resident", *lora, "orchestration.workers=resident", "checkpoint.every=3")
    pool = _pool(lora=cfg.runner("rollout").workers.lora)
    assert pool["rollout"].lora.rank == 4
    final = drive(cfg, _runner(pool))
    files = _weight_files(final)
    assert files == _weight_files(final_s) and "policy/adapter_model.safetensors" in files
    model = pool["policy"].held.strategy.model
    assert [s["bytes"] for s in pool["rollout"].syncs] == [sum(t.numel() * 4 for t in inference_tensors(model).values())] * 2
    # iterations 2 and 3 rolled out on synced, merged weights
    for it in (1, 2, 3):
        for stage in ("rollout", "actor_logprobs", "advantages", "ppo_update"):
            a, b = (read_manifest(stage_uri(c.run_root, it, stage))[0] for c in (cfg_s, cfg))
            parts = lambda m: {e.path: e.checksum for e in m.files if e.path.endswith(".parquet")}  # noqa: E731
            assert parts(a) == parts(b), (it, stage)


def test_an_engine_sync_takes_the_weights_its_plan_was_made_from(tiny_model, tmp_path, monkeypatch):
    """prepare_weights with a dtype (a GPU engine's sync) builds the plan from the trainer's
    weights and keeps them for the send that follows: a ZeRO-3 gather or a LoRA merge runs once
    per sync, and only once is kept."""
    from rft_core.workers import policy as resident_module
    from rft_core.weightsync.plan import SyncPlan

    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident", "checkpoint.every=3")
    pool = _pool()
    drive(cfg, _runner(pool), stop_after=1)
    policy, calls = pool["policy"], []
    real = resident_module.merged_tensors
    monkeypatch.setattr(resident_module, "merged_tensors", lambda s: calls.append(s) or real(s))
    offer = policy.prepare_weights(ShardRef.from_manifest(stage_uri(cfg.run_root, 1, "ppo_update")), dtype="bfloat16")
    plan = SyncPlan.from_json(offer.plan)
    assert offer.backend == "gloo" and {e.dtype for e in plan.entries} == {"bfloat16"}
    sent = policy._send_tensors()  # what send_weights takes
    assert len(calls) == 1 and sorted(sent) == [e.name for e in plan.entries]
    policy._send_tensors()
    assert len(calls) == 2  # taken once: a later sync gathers afresh


def test_background_checkpoints_commit_after_their_update_with_the_stage_mode_files(stage_run, tiny_model, tmp_path):
    """checkpoint.async_weights (the default under resident workers): each checkpoint iteration's
    ppo_update commits as between checkpoints (digest, no weights), then its AdamW state and
    weights commit in the background as ``ppo_update-optimizer`` and ``ppo_update-policy``, whose
    files have the stage-mode checkpoint's sha256; storage readers find the weights there."""
    cfg_s, _ = stage_run
    assert_training_signal(cfg_s.run_root, (1, 2, 3))
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident")
    assert cfg.background_checkpoint
    drive(cfg, _runner(_pool()))
    wait_for_optimizer_writes()
    for it in (1, 2, 3):
        ref = ShardRef.from_manifest(stage_uri(cfg.run_root, it, "ppo_update"))
        stage_ref = ShardRef.from_manifest(stage_uri(cfg_s.run_root, it, "ppo_update"))
        m = read_manifest(ref.uri)[0]
        assert not any(e.path.startswith("policy/") for e in m.files) and method_of(m.summary[WEIGHTS_DIGEST_KEY]) == "xxh3"
        held = weights_stage(ref)
        assert held.uri == ref.uri + "-policy" and read_manifest(held.uri)[0].inputs == {"ppo_update": ref.manifest_sha256}
        files = lambda r: {e.path: e.checksum for e in read_manifest(r.uri)[0].files if e.path.startswith("policy/")}  # noqa: E731
        assert files(held) == files(weights_stage(stage_ref)) and files(held), it  # weights, config and tokenizer files
        opt = [json.loads(Path(stage_uri(c.run_root, it, "ppo_update-optimizer"), "_MANIFEST.json").read_text())["files"]
               for c in (cfg_s, cfg)]
        assert opt[0] == opt[1], it
        assert policy_model_path(ref) == str(Path(held.uri) / "policy")
    from rft_core.inspect import run_status

    kinds = {r["iteration"]: r["checkpoint"] for r in run_status(str(tmp_path)) if r["stage"] == "ppo_update"}
    assert kinds == {1: "weights + optimizer", 2: "weights + optimizer", 3: "weights + optimizer"}


def test_a_background_checkpoint_lost_to_a_crash_resumes_from_the_one_before(stage_run, tiny_model, tmp_path):
    """A crash during iteration 2's background checkpoint write (its ``ppo_update-policy`` never
    committed): new workers rebuild iteration 2's policy from iteration 1's checkpoint by
    re-applying the committed update 2 and write the lost checkpoint again, and the run ends with
    stage mode's weights. (No SIGKILL row kills a real writer there yet.)"""
    cfg_s, final_s = stage_run
    assert_training_signal(cfg_s.run_root, (1, 2, 3))
    cfg = _cfg(tiny_model, tmp_path, "orchestration.workers=resident")
    drive(cfg, _runner(_pool()), stop_after=2)
    wait_for_optimizer_writes()
    ref2 = ShardRef.from_manifest(stage_uri(cfg.run_root, 2, "ppo_update"))
    Path(weights_stage(ref2).uri, "_MANIFEST.json").unlink()  # the commit point of the write never landed
    assert not has_weights(ref2) and policy_chain(ref2)[1] == [ref2]
    COUNTS.clear()
    final = drive(cfg, _runner(_pool()))
    assert COUNTS["recovered_updates"] == 1
    assert _weight_files(final) == _weight_files(final_s)
    # the lost checkpoint was written again, with the stage-mode checkpoint's files
    assert has_weights(ref2)
    assert _weight_files(ref2) == _weight_files(ShardRef.from_manifest(stage_uri(cfg_s.run_root, 2, "ppo_update")))
