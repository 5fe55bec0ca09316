"""FSDP2 (torch's ``fully_shard``, issue 47) on CPU with 2 ranks (torchrun, gloo), through the
shared training loop: 3 iterations of the policy update, each a torchrun job continuing the
previous one's sharded state (``torch.distributed.checkpoint`` in its optimizer stage), end
within 1e-6 of the single-process update and of DeepSpeed ZeRO-3 on the same inputs (the
session fixtures of conftest.py, shared with test_deepspeed_update.py); the state written by 2
ranks resumes on 1 (DCP reshards, logged); bfloat16 masters carry over exactly; LoRA with
gradient checkpointing matches one process; a resident gang of 2 ranks equals the torchrun
chain bit for bit and its weights reach the rollout worker gathered."""
from __future__ import annotations

import pytest
import torch

from rft_core.config import CriticConfig, FSDPConfig, KLConfig, LoraConfig
from rft_core.models.loading import load_causal_lm
from rft_core.stages import optimizer_state as opt_state
from rft_core.stages.contracts import PPOUpdateInput
from rft_core.training.fsdp import FSDPCheckpoint, FSDPStateError, check_fsdp_state, layer_classes
from rft_core.training.strategy import DeepSpeedCheckpoint, OptimizerSettings, build_strategy
from schemas import read_manifest, read_shard
from tests.rft_core.training.chain import (ITERATIONS, RUNNER, assert_critic_chain_continues, critic_chain, fsdp, max_diff,
                                          one_thread, random_head_critic, resident_critic_gang, run_update, weights)
from tests.update_settings import update_settings
from tests.varying import assert_shard_advantages_nonzero, assert_update_signal


@pytest.fixture(scope="module")
def fsdp_chain(update_inputs, tiny_model):
    """(refs, log lines of each): ITERATIONS FSDP2 updates on 2 ranks (reshard_after_forward), each a
    torchrun job from the previous one's committed policy and optimizer stage."""
    refs, logs, policy = [], [], tiny_model
    for i in range(1, ITERATIONS + 1):
        lines: list[str] = []
        policy = run_update(update_inputs, policy, fsdp(update_inputs[3]), f"fsdp-{i}", RUNNER, lines)
        refs.append(policy)
        logs.append(lines)
    return refs, logs


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_fsdp_two_ranks_three_iterations_match_single_process(update_inputs, single_chain, fsdp_chain, tiny_model):
    assert_shard_advantages_nonzero(update_inputs[2])  # first: what is compared is a policy-gradient update
    assert_update_signal(single_chain[0])
    refs, _ = fsdp_chain
    previous_opt, to_single = None, []
    for i, (ref, want_ref) in enumerate(zip(refs, single_chain), start=1):
        manifest, _ = read_manifest(ref.uri)
        assert manifest.summary["world_size"] == 2 and manifest.summary["sharding"] == "fsdp2"
        want, got = read_shard(want_ref.uri).to_pydict(), read_shard(ref.uri).to_pydict()
        assert got["num_tokens"] == want["num_tokens"] and len(got["step"]) == 4
        assert got["policy_loss"] == pytest.approx(want["policy_loss"], abs=1e-5), i
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), i
        # the sharded state is the update's optimizer stage: DCP's metadata and one shard file per rank
        opt_manifest, opt_sha = read_manifest(opt_state.optimizer_state_uri(ref))
        assert opt_manifest.stage == "optimizer_state" and opt_manifest.inputs == {"ppo_update": ref.manifest_sha256}
        assert {k: opt_manifest.summary[k] for k in ("format", "world_size", "bf16", "tag")} == {
            "format": "fsdp", "world_size": 2, "bf16": False, "tag": "dcp"}
        assert sorted(f.path for f in opt_manifest.files) == ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"]
        assert manifest.inputs.get("optimizer") == previous_opt  # the next update continued it
        previous_opt = opt_sha
        to_single.append(max_diff(weights(ref.uri), weights(want_ref.uri)))
    init, last = load_causal_lm(tiny_model).state_dict(), weights(single_chain[-1].uri)
    assert max_diff(last, init) > 1e-2  # 12 AdamW steps of lr 1e-3 moved the weights
    assert max(to_single) < 1e-6, to_single  # float rounding only, every iteration


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_fsdp_three_iterations_match_deepspeed_zero3(update_inputs, ds_chain, fsdp_chain):
    """The same 3 iterations under DeepSpeed ZeRO-3 on 2 ranks (skipped without deepspeed)."""
    assert_shard_advantages_nonzero(update_inputs[2])
    zero3, _ = ds_chain(3)
    refs, _ = fsdp_chain
    assert max_diff(weights(zero3[-1].uri), weights(update_inputs[4].uri)) > 1e-3  # iterations 2 and 3 moved them
    diffs = []
    for ref, z3 in zip(refs, zero3):
        assert read_shard(ref.uri).to_pydict()["policy_loss"] == pytest.approx(
            read_shard(z3.uri).to_pydict()["policy_loss"], abs=1e-5)
        diffs.append(max_diff(weights(ref.uri), weights(z3.uri)))
    assert max(diffs) < 1e-6, diffs


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_a_state_of_two_ranks_resumes_on_one_and_says_so(update_inputs, single_chain, fsdp_chain):
    """DCP reshards: iteration 2 on 1 rank from the 2-rank iteration 1 logs the resharding and
    ends within 1e-6 of the 2-rank iteration 2 and of the single process (AdamW continued: a
    restarted AdamW is > 1e-4 off, test_deepspeed_update.py's test_a_restarted_adamw_would_not_match)."""
    refs, _ = fsdp_chain
    lines: list[str] = []
    one_rank = RUNNER.model_copy(update={"nproc_per_node": 1})
    ref = run_update(update_inputs, refs[0], fsdp(update_inputs[3]), "fsdp-2-one-rank", one_rank, lines)
    assert any("was saved by 2 rank(s); torch.distributed.checkpoint reshards it onto 1 rank(s)" in line
               for line in lines), lines[-20:]
    assert read_manifest(opt_state.optimizer_state_uri(ref))[0].summary["world_size"] == 1
    got = weights(ref.uri)
    assert max_diff(got, weights(refs[1].uri)) < 1e-6
    assert max_diff(got, weights(single_chain[1].uri)) < 1e-6


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_bf16_masters_are_continued_not_rounded(update_inputs, tiny_model):
    """bfloat16 under FSDP2: the DCP state holds float32 master shards that round to the bfloat16
    checkpoint but hold more; iteration 2 at lr 1e-30 ends with them unchanged (a restart from
    the bfloat16 weights would be off by > 1e-5)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cfg = fsdp(update_inputs[3])
    u1 = run_update(update_inputs, tiny_model, cfg, "fsdp-bf16-1", RUNNER, dtype="bfloat16")
    u2 = run_update(update_inputs, u1, cfg.model_copy(update={"lr": 1e-30}), "fsdp-bf16-2", RUNNER, dtype="bfloat16")
    assert_update_signal(u1)
    masters = []
    for u in (u1, u2):
        folder = opt_state.optimizer_state_uri(u)
        assert read_manifest(folder)[0].summary["bf16"] is True
        dcp_to_torch_save(f"{folder}/dcp", f"{folder}.pt")
        masters.append(torch.load(f"{folder}.pt", weights_only=False)["model"])
    m1, m2 = masters
    w1 = load_causal_lm(f"{u1.uri}/policy", dtype="bfloat16").state_dict()
    assert m1.keys() <= w1.keys() and m1["lm_head.weight"].dtype == torch.float32
    assert load_file(f"{u1.uri}/policy/model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16  # the
    # checkpoint is bfloat16 ...
    assert all(torch.equal(m1[k].bfloat16(), w1[k]) for k in m1)  # ... the masters' rounding
    assert max_diff(m1, {k: v.bfloat16() for k, v in m1.items()}) > 1e-5  # and they hold more than it
    assert max_diff(m2, m1) < 1e-12


@pytest.mark.rotation(7)  # long: one turn in 8 (tests/rotation.py; with group 7's FSDP tests)
def test_lora_with_gradient_checkpointing_matches_one_process(update_inputs, tiny_model):
    """LoRA (peft) and gradient checkpointing composed with FSDP2: the 2-rank adapters equal the
    single-process ones within 1e-6 (only adapters are sharded state; the frozen base is not saved)."""
    from safetensors.torch import load_file

    cfg = update_inputs[3].model_copy(update={"lora": LoraConfig(rank=4, alpha=8.0), "gradient_checkpointing": True})
    with one_thread():
        single = run_update(update_inputs, tiny_model, cfg, "lora-single")
    sharded = run_update(update_inputs, tiny_model, fsdp(cfg, reshard_after_forward=False), "lora-fsdp", RUNNER)
    a, b = (load_file(f"{u.uri}/policy/adapter_model.safetensors") for u in (single, sharded))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 1e-4  # the adapters moved from 0
    assert max_diff(a, b) < 1e-6
    opt = read_manifest(opt_state.optimizer_state_uri(sharded))[0]
    assert opt.summary["format"] == "fsdp"
    # adapters and their AdamW moments (447 kB with DCP's per-tensor records), not the base: its embedding alone is 6.3 MB
    assert sum(f.bytes for f in opt.files) < 1_000_000


def test_the_state_checks_name_both_sides(tmp_path, tiny_model):
    saved = FSDPCheckpoint(folder=str(tmp_path), world_size=2, bf16=False, source="run/iter=000001/ppo_update-optimizer")
    check_fsdp_state(saved, bf16=False)  # another world size is fine: DCP reshards
    with pytest.raises(FSDPStateError, match="saved by a float32 model but this update trains a bfloat16 model"):
        check_fsdp_state(saved, bf16=True)
    model = torch.nn.Linear(2, 2)
    settings = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    with pytest.raises(FSDPStateError, match="an FSDP2 sharded optimizer state cannot be continued by a single-process"):
        build_strategy(model, optim=settings, fsdp_state=saved)
    with pytest.raises(FSDPStateError, match="a single-process AdamW state .* cannot be continued by an FSDP2 update"):
        build_strategy(model, optim=settings, fsdp=FSDPConfig(), optimizer_state=str(tmp_path))
    zero = DeepSpeedCheckpoint(folder="z", tag="zero", world_size=2, zero_stage=3, bf16=False, source="zero-stage")
    with pytest.raises(FSDPStateError, match="zero-stage: a DeepSpeed ZeRO optimizer state cannot be continued by an FSDP2"):
        build_strategy(model, optim=settings, fsdp=FSDPConfig(), deepspeed_state=zero)
    assert layer_classes(load_causal_lm(tiny_model)) == {"LlamaDecoderLayer"}  # what gets one fully_shard each


# -- the resident FSDP2 trainer: ranks as Ray actors that keep their shards -------------------------


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_resident_fsdp_gang_keeps_its_state_and_equals_the_torchrun_updates(update_inputs, fsdp_chain, tiny_model,
                                                                            tmp_path):
    """orchestration.policy_ranks=2 with update.fsdp: 3 updates, the first two without writing weights
    or state (checkpoint.every=3), end with the weights of the 3 torchrun updates (each of which
    restored the DCP state from storage) bit for bit; the rollout worker pulls the gang's weights
    (``full_tensor`` on both ranks, rank 0 sends) and holds exactly the committed ones."""
    pytest.importorskip("ray")
    import ray

    from rft_core.config import RayConfig, WorkersConfig
    from rft_core.stages.lineage import has_weights
    from rft_core.workers.pool import run_resident, start_worker, stop_workers

    env = {"OMP_NUM_THREADS": "1"}
    workers = WorkersConfig(pool=str(tmp_path), threads=1, policy_ranks=2,
                            ray=RayConfig(options={"policy": {"runtime_env": {"env_vars": env}}}))
    root, r, a = update_inputs[:3]
    refs, policy = [], tiny_model
    try:
        for i in range(1, ITERATIONS + 1):
            inp = PPOUpdateInput(rollout=r, advantages=a, policy=policy, update=fsdp(update_inputs[3]), kl=KLConfig(),
                                 temperature=1.0, out=str(root / f"resident-fsdp-{i}"), save_checkpoint=i == ITERATIONS)
            policy = run_resident(inp, workers)
            refs.append(policy)
        rollout = start_worker(workers, "rollout")
        ray.get(rollout.inference_model.remote(tiny_model, dtype="float32", role="policy"))
        synced = ray.get(rollout.inference_model.remote(refs[-1], dtype="float32", role="policy")).state_dict()
        syncs = ray.get(rollout.stats.remote())["weight_syncs"]
    finally:
        stop_workers(workers.pool)
    assert syncs == 1 and [has_weights(x) for x in refs] == [False, False, True]
    staged, _ = fsdp_chain
    for ref, want in zip(refs, staged):
        assert read_shard(ref.uri).to_pydict()["policy_loss"] == read_shard(want.uri).to_pydict()["policy_loss"]
    got, want = weights(refs[-1].uri), weights(staged[-1].uri)
    assert all(torch.equal(got[k], want[k]) for k in want), max_diff(got, want)
    assert all(torch.equal(synced[k], v) for k, v in got.items())
    assert read_manifest(opt_state.optimizer_state_uri(refs[-1]))[0].summary["format"] == "fsdp"


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py; with the resident FSDP2 gang test above)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_resident_fsdp_lora_gang_syncs_its_adapters_or_its_merged_weights(update_inputs, tiny_model, tmp_path, dtype):
    """orchestration.policy_ranks=2 with update.fsdp and update.lora: 2 updates, the first
    weightless (checkpoint.every=2), each pulled by the rollout worker (``WorkersConfig.lora``).
    On a bfloat16 base it keeps the adapters and each sync gathers the float32 adapters alone onto
    rank 0 (``trained_adapters``): 16384 bytes (2 layers x rank 4 x 512 in+out features x 4
    bytes); in float32 it takes the merged weights, the gathered base and adapters merged on rank 0
    (``merged_tensors``: peft's merge on a meta-device twin). Version 1, on no storage, equals the
    single-process update within 1e-6 (the adapters moved); version 2 equals the committed adapter
    checkpoint loaded as stage mode loads it (adapters kept in bfloat16, merged in float32) bit for
    bit, every tensor."""
    pytest.importorskip("ray")
    import ray

    from rft_core.config import RayConfig, WorkersConfig
    from rft_core.stages.lineage import has_weights
    from rft_core.workers.pool import run_resident, start_worker, stop_workers

    lora = LoraConfig(rank=4, alpha=8.0)
    cfg = update_inputs[3].model_copy(update={"lora": lora})
    with one_thread():
        single = [run_update(update_inputs, tiny_model, cfg, f"lora-{dtype}-single-1", dtype=dtype)]
        single.append(run_update(update_inputs, single[0], cfg, f"lora-{dtype}-single-2", dtype=dtype))
    env = {"OMP_NUM_THREADS": "1"}
    workers = WorkersConfig(pool=str(tmp_path), threads=1, policy_ranks=2, lora=lora,
                            ray=RayConfig(options={"policy": {"runtime_env": {"env_vars": env}}}))
    root, r, a = update_inputs[:3]
    refs, synced, sent, policy = [], [], [], tiny_model
    try:
        rollout = start_worker(workers, "rollout")
        ray.get(rollout.inference_model.remote(tiny_model, dtype=dtype, role="policy"))
        for i in (1, 2):
            inp = PPOUpdateInput(rollout=r, advantages=a, policy=policy, update=fsdp(cfg), kl=KLConfig(),
                                 temperature=1.0, out=str(root / f"resident-fsdp-lora-{dtype}-{i}"),
                                 save_checkpoint=i == 2, dtype=dtype)
            policy = run_resident(inp, workers)
            refs.append(policy)
            model = ray.get(rollout.inference_model.remote(policy, dtype=dtype, role="policy"))
            synced.append({k: v.clone() for k, v in model.state_dict().items()})
            sent.append(ray.get(rollout.stats.remote())["weight_sync_bytes"])
    finally:
        stop_workers(workers.pool)
    assert [has_weights(x) for x in refs] == [False, True]
    want = [load_causal_lm(f"{u.uri}/policy", dtype=dtype).state_dict() for u in single]
    stored = load_causal_lm(f"{refs[1].uri}/policy", dtype=dtype).state_dict()
    assert synced[0].keys() == stored.keys() == want[0].keys()
    assert all(torch.equal(synced[1][k], v) for k, v in stored.items())
    if dtype == "bfloat16":
        assert sent == [16384, 2 * 16384]
        moved = [k for k in stored if ".lora_" in k]  # the adapters, float32 on the bfloat16 base
        assert moved and stored[moved[0]].dtype == torch.float32
        assert max(synced[0][k].abs().max().item() for k in moved if "lora_B" in k) > 1e-4  # moved from 0
    else:
        from rft_core.weightsync.plan import state_tensors

        whole = sum(t.numel() * 4 for t in state_tensors(load_causal_lm(tiny_model)).values())  # the tied head once
        assert sent == [whole, 2 * whole] and not any(".lora_" in k for k in stored)  # merged: a plain model
        moved = list(stored)
        init = load_causal_lm(tiny_model).state_dict()
        assert max((synced[0][k] - init[k]).abs().max().item() for k in moved) > 1e-4  # the merge moved the weights
    assert max_diff({k: synced[0][k] for k in moved}, {k: want[0][k] for k in moved}) < 1e-6
    assert max_diff({k: synced[1][k] for k in moved}, {k: want[1][k] for k in moved}) < 1e-6
    assert max_diff({k: synced[1][k] for k in moved}, {k: synced[0][k] for k in moved}) > 1e-5  # a new version


def test_an_adapter_gather_takes_the_adapters_alone_not_the_tied_head(tiny_model, own_process_group):
    """``full_state_dict(trainable_only=True)`` of a LoRA model on a bfloat16 base with a tied
    embedding and LM head (the tiny model's), on a world of one rank, with and without
    ``cpu_offload``: the float32 adapters and nothing else, equal to the unsharded model's, where
    torch's ``get_model_state_dict(ignore_frozen_params=True)`` of the model with its shards on the
    device also gathers the tied head (torch 2.13); the gather of every weight still has the base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rft_core.models.lora import apply_lora
    from rft_core.weightsync.trained import adapter_tensors

    def lora_model():
        model = load_causal_lm(tiny_model, dtype="bfloat16", trainable=True)
        return apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", base_path=tiny_model,
                          seed=3)

    want = {k: v.clone() for k, v in adapter_tensors(lora_model()).items()}
    optim = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    sharded = build_strategy(lora_model(), optim=optim, fsdp=FSDPConfig())
    got = sharded.full_state_dict(trainable_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert {t.dtype for t in got.values()} == {torch.float32}
    assert "base_model.model.lm_head.weight" in sharded.full_state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    assert set(get_model_state_dict(sharded.model, options=options)) - set(want) == {"base_model.model.lm_head.weight"}
    offloaded = build_strategy(lora_model(), optim=optim, fsdp=FSDPConfig(cpu_offload=True))
    got = offloaded.full_state_dict(trainable_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_a_merged_sync_of_one_fsdp_lora_rank_leaves_the_trainers_base_as_it_was(tiny_model, own_process_group,
                                                                                 cpu_offload):
    """``merged_tensors`` of a float32 FSDP2 LoRA trainer on a world of one rank, whose gathered
    tensors on the CPU are the trainer's own shards: twice the same merged weights, equal bit for
    bit to the single-process merge (``inference_tensors``: peft's merge on a copy), which moved the
    adapted weights, and the trainer's base unchanged (a merge into the gathered tensors added the
    adapters into the trainer's base at every sync)."""
    from rft_core.models.lora import apply_lora
    from rft_core.weightsync.trained import inference_tensors, merged_tensors

    model = apply_lora(load_causal_lm(tiny_model, trainable=True), rank=4, alpha=8.0, dropout=0.0,
                       target_modules="all-linear", base_path=tiny_model, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(1))
    want = {k: v.clone() for k, v in inference_tensors(model).items()}
    optim = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    sharded = build_strategy(model, optim=optim, fsdp=FSDPConfig(cpu_offload=cpu_offload))
    before = {k: v.clone() for k, v in sharded.full_state_dict().items()}
    first = {k: v.clone() for k, v in merged_tensors(sharded).items()}
    second = merged_tensors(sharded)
    assert first.keys() == want.keys() and all(torch.equal(first[k], want[k]) for k in want)
    assert all(torch.equal(second[k], want[k]) for k in want)
    init = load_causal_lm(tiny_model).state_dict()
    assert max((want[k] - init[k]).abs().max().item() for k in want) > 1e-3  # the merge moved the weights
    after = sharded.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_cpu_offload_on_one_rank_matches_one_process(tiny_model, own_process_group):
    """FSDP2 on a world of one rank (outside torchrun), with and without CPUOffloadPolicy, trains
    as the single process does: same gradient norms (4 steps), weights within 1e-6; in bfloat16
    the gathered checkpoint weights are bfloat16 (the float32 shards' rounding)."""
    from rft_core.training.update import UpdateData, ppo_update

    data = UpdateData(prompts=[[5, 6, 7], [9, 10], [11, 12, 13, 14], [15]], responses=[[8, 9], [3, 4, 5], [6], [7, 8]],
                      old_logprobs=[[-10.8, -10.8], [-10.8] * 3, [-10.8], [-10.8, -10.8]],  # ~ log(1/49152): unclipped
                      advantages=[[1.0, 1.0], [-1.0] * 3, [1.0], [-1.0, -1.0]])
    optim = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    settings = update_settings(micro_batch_size=1, train_batch_size=2, epochs=2)
    got = {}
    with one_thread():
        for name, kw, dtype in [("single", {}, "float32"), ("fsdp", {"fsdp": FSDPConfig()}, "float32"),
                                ("offload", {"fsdp": FSDPConfig(cpu_offload=True)}, "float32"),
                                ("bf16", {"fsdp": FSDPConfig(reshard_after_forward=False)}, "bfloat16")]:
            strategy = build_strategy(load_causal_lm(tiny_model, dtype=dtype, trainable=True), optim=optim, **kw)
            steps = ppo_update(strategy, data, settings, pad_token_id=2)
            weights_now = strategy.full_state_dict() if kw else strategy.model.state_dict()
            got[name] = ([s.grad_norm for s in steps], {k: v.detach().clone() for k, v in weights_now.items()})
    norms, single = got["single"]
    assert len(norms) == 4 and min(norms) > 1e-3
    init = load_causal_lm(tiny_model).state_dict()
    assert max_diff(single, {k: init[k] for k in single}) > 1e-3
    for name in ("fsdp", "offload"):
        assert got[name][0] == pytest.approx(norms, rel=1e-5), name
        assert max_diff(got[name][1], single) < 1e-6, name
    assert got["bf16"][1]["lm_head.weight"].dtype == torch.bfloat16
    assert got["bf16"][0] == pytest.approx(norms, rel=2e-2)  # bfloat16 compute: close, not equal


def test_a_one_rank_fsdp_critic_continues_its_state_in_process(update_inputs, tiny_model, own_process_group):
    """The sharded critic's state path in every run (the 2-rank tests are in the rotation): an
    FSDP2 critic on one rank in this process (no torchrun) commits its DCP state in
    ``critic-optimizer/`` and the next update continues it, ending with the single-process
    critic's weights (each continuing its own AdamW state) within 1e-6."""
    from rft_core.config import CriticConfig

    root, r, a, _, _ = update_inputs
    critic, values, start = random_head_critic(tiny_model, r, root / "fsdp1")
    cfg = CriticConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, value_clip=None)
    single = critic_chain(update_inputs, critic, values, cfg, "fsdp1-c")
    sharded = critic_chain(update_inputs, critic, values, cfg.model_copy(update={"fsdp": FSDPConfig()}), "fsdp1-s")
    restarted, = critic_chain(update_inputs, f"{single[0].uri}/critic", values, cfg, "fsdp1-restart", iterations=1)
    assert_critic_chain_continues(single, sharded, start=start, restarted=restarted, tol=1e-6,
                                  files=["critic-optimizer/dcp/.metadata", "critic-optimizer/dcp/__0_0.distcp"],
                                  state={"format": "fsdp", "tag": "dcp", "world_size": 1, "bf16": False})


@pytest.mark.rotation(7)  # long: one turn in 8 (tests/rotation.py)
def test_critic_update_under_fsdp_on_two_ranks_matches_one_process(update_inputs, tiny_model):
    """critic.fsdp: the critic trains through the same loop and FSDP2 strategy, and 2 ranks give the
    single-process critic's losses and weights (its value head sharded with the root) over two
    updates, the second continuing the first's sharded AdamW state (``critic-optimizer/dcp``) as
    one process continues its ``critic/optimizer.pt``."""
    from rft_core.config import CriticConfig

    root, r, a, _, _ = update_inputs
    critic, values, start = random_head_critic(tiny_model, r, root / "fsdp")  # every weight gets a gradient
    cfg = CriticConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, value_clip=None)
    single = critic_chain(update_inputs, critic, values, cfg, "fsdp-c")
    sharded = critic_chain(update_inputs, critic, values, cfg.model_copy(update={"fsdp": FSDPConfig()}), "fsdp-s",
                           RUNNER)
    assert read_manifest(sharded[0].uri)[0].summary["sharding"] == "fsdp2"
    restarted, = critic_chain(update_inputs, f"{single[0].uri}/critic", values, cfg, "fsdp-restart", iterations=1)
    assert_critic_chain_continues(single, sharded, start=start, restarted=restarted, tol=1e-6,
                                  files=["critic-optimizer/dcp/.metadata", "critic-optimizer/dcp/__0_0.distcp",
                                         "critic-optimizer/dcp/__1_0.distcp"],
                                  state={"format": "fsdp", "tag": "dcp", "world_size": 2, "bf16": False})


@pytest.mark.rotation(7)  # long (~62 s, its own torchrun chain): one turn in 8 (tests/rotation.py)
def test_a_resident_fsdp_critic_gang_keeps_its_state_and_equals_the_torchrun_updates(update_inputs, tiny_model,
                                                                                   tmp_path):
    """orchestration.critic_ranks=2 with critic.fsdp: two critic updates, and the values pass
    between them, run in a resident gang of 2 ranks (Ray actors) that keeps the critic's shards
    and AdamW state, and a third on a new gang that restores them from storage
    (``resident_critic_gang``). Each update's losses, weights and DCP state files equal the
    torchrun chain's (whose updates restored the DCP state from storage) bit for bit; the values
    pass (rank 0 alone, from storage) equals one process's values from the committed checkpoint
    bit for bit; after the first update no rank loaded a model but rank 0 for that values pass."""
    cfg = CriticConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, value_clip=None, fsdp=FSDPConfig())
    refs, staged = resident_critic_gang(update_inputs, tiny_model, tmp_path, cfg, "fsdp-gang")

    def files(ref):
        m, _ = read_manifest(ref.uri)
        # DCP's .metadata holds its folder's path and a random save id (torch.distributed.checkpoint StorageMeta)
        return {e.path: e.checksum for e in m.files if e.path != "critic-optimizer/dcp/.metadata"}

    for got, want in zip(refs, staged):
        assert files(got) == files(want) and "critic-optimizer/dcp/__1_0.distcp" in files(got)
