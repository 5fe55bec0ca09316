"""DeepSpeed ZeRO 1/2/3 on CPU with 2 ranks (torchrun, gloo, torch AdamW), through the shared
training loop: the policy update's and the critic update's losses of every step and their final
weights match the single-process update on the same data. The policy update keeps its ZeRO state
(AdamW moments and float32 master partitions, DeepSpeed's sharded checkpoint) in its optimizer
stage: 3 iterations, each a torchrun job starting from the previous one's committed policy and
optimizer stage, end with the single-process weights; a lost state is recomputed when its update
is resumed, another world size is refused by name, and bf16 masters carry over exactly."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from rft_core.config import CriticConfig, DeepSpeedConfig, KLConfig  # noqa: E402
from rft_core.models.loading import load_causal_lm  # noqa: E402
from rft_core.stages import optimizer_state as opt_state  # noqa: E402
from rft_core.stages import writer  # noqa: E402
from rft_core.stages.contracts import PPOUpdateInput  # noqa: E402
from rft_core.stages.runner import StageProcessError  # noqa: E402
from rft_core.training.strategy import (  # noqa: E402
    DeepSpeedCheckpoint,
    DeepSpeedStateError,
    OptimizerSettings,
    build_strategy,
    check_deepspeed_state,
)
from schemas import commit_files, read_manifest, read_shard  # noqa: E402
from schemas.columns import OPTIMIZER_STATE  # noqa: E402
from tests.rft_core.training.chain import (  # noqa: E402
    ITERATIONS, RUNNER, assert_critic_chain_continues, critic_chain, ds, max_diff, one_thread, random_head_critic,
    resident_critic_gang, run_update, weights)

# Each ZeRO stage (each test with its resident twin: they share the chain of updates) takes its
# turn in the rotation (tests/rotation.py, ~95 s each on 2 cores); stage 3 with the crashed ZeRO-3
# gang, which reads the same chain
ZERO_STAGES = [pytest.param(1, marks=pytest.mark.rotation(3)), pytest.param(2, marks=pytest.mark.rotation(4)),
               pytest.param(3, marks=pytest.mark.rotation(1))]

# what the removed warnings said; neither may appear in a DeepSpeed update's log any more
STALE_WARNINGS = ("starts AdamW afresh", "master weights live inside ZeRO for this update only")
# the shared inputs and chains: tests/rft_core/training/conftest.py (session fixtures update_inputs, single_chain, ds_chain)
_update, _weights, _max_diff, _ds = run_update, weights, max_diff, ds


@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
def test_zero_two_ranks_three_iterations_match_single_process(update_inputs, single_chain, ds_chain, tiny_model,
                                                              zero_stage):
    refs, logs = ds_chain(zero_stage)
    previous_opt = None
    diffs = []
    for i, (ref, want_ref, lines) in enumerate(zip(refs, single_chain, logs), start=1):
        manifest, _ = read_manifest(ref.uri)
        assert manifest.summary["world_size"] == 2 and manifest.summary["zero_stage"] == zero_stage
        want, got = read_shard(want_ref.uri).to_pydict(), read_shard(ref.uri).to_pydict()
        assert got["num_tokens"] == want["num_tokens"] and len(got["step"]) == 4
        assert got["policy_loss"] == pytest.approx(want["policy_loss"], abs=1e-5), i
        assert got["approx_kl"] == pytest.approx(want["approx_kl"], abs=1e-6), i
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), i
        # the ZeRO state is the update's optimizer stage: one partition per rank, committed last
        opt_manifest, opt_sha = read_manifest(opt_state.optimizer_state_uri(ref))
        assert opt_manifest.stage == "optimizer_state" and opt_manifest.inputs == {"ppo_update": ref.manifest_sha256}
        assert {k: opt_manifest.summary[k] for k in ("format", "world_size", "zero_stage", "bf16")} == {
            "format": "deepspeed", "world_size": 2, "zero_stage": zero_stage, "bf16": False}
        assert sorted(f.path for f in opt_manifest.files if f.path.endswith("optim_states.pt")) == [
            f"zero/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
        # the next update started from it: its manifest sha256 is an input (and in the config hash)
        assert manifest.inputs.get("optimizer") == previous_opt
        previous_opt = opt_sha
        assert not [line for line in lines if any(w in line for w in STALE_WARNINGS)]
        diffs.append(_max_diff(_weights(ref.uri), _weights(want_ref.uri)))
    init, last = load_causal_lm(tiny_model).state_dict(), _weights(single_chain[-1].uri)
    assert _max_diff(last, init) > 1e-2  # 12 Adam steps of lr 1e-3 moved the weights
    assert max(diffs) < 1e-6, diffs  # float rounding only, every iteration


def test_a_restarted_adamw_would_not_match(update_inputs, single_chain):
    """What the 1e-6 check above tells apart: iteration 2 with AdamW restarted (its policy given as
    a plain folder: no optimizer state) ends far from the continued single-process iteration 2."""
    with one_thread():
        fresh = _update(update_inputs, f"{single_chain[0].uri}/policy", update_inputs[3], "single2-fresh")
    assert _max_diff(_weights(fresh.uri), _weights(single_chain[1].uri)) > 1e-4


@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_a_lost_deepspeed_state_is_recomputed_when_its_update_is_resumed(update_inputs, ds_chain, tiny_model):
    refs, _ = ds_chain(2)
    u1 = refs[0]
    folder = Path(opt_state.optimizer_state_uri(u1))
    committed = {f.path: f.checksum for f in read_manifest(str(folder))[0].files}
    (folder / "_MANIFEST.json").unlink()  # the job died before rank 0 committed the partitions
    assert opt_state.optimizer_state_missing(u1)
    with pytest.raises(writer.OptimizerStateError, match=f"{folder}.*never committed.*Rerun the training flow"):
        opt_state.optimizer_state_ref(u1)  # what the next update would call: it cannot start without it
    again = _update(update_inputs, tiny_model, _ds(update_inputs[3], 2), "zero2-1", RUNNER)  # the resume
    assert again == u1  # the committed update is reused, untouched
    manifest, _ = read_manifest(str(folder))
    assert manifest.summary["recovered"] is True and manifest.summary["weights_match"] is True
    assert {f.path: f.checksum for f in manifest.files} == committed  # every partition bit-identical
    assert len(committed) >= 4  # the two partitions, the module states, `latest`, ...


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_another_world_size_is_refused_by_name(update_inputs, ds_chain):
    refs, _ = ds_chain(1)
    lines: list[str] = []
    one_rank = RUNNER.model_copy(update={"nproc_per_node": 1})
    with pytest.raises(StageProcessError):
        _update(update_inputs, refs[0], _ds(update_inputs[3], 1), "zero1-one-rank", one_rank, lines)
    assert any("saved by 2 ranks but this update runs on 1" in line for line in lines), lines[-20:]
    assert not Path(update_inputs[0] / "zero1-one-rank" / "_MANIFEST.json").exists()


@pytest.mark.rotation(1)  # long: one turn in 8, with the ZeRO-3 chain's other users (tests/rotation.py)
def test_the_state_of_other_weights_is_refused(update_inputs, ds_chain, tmp_path):
    """ZeRO-3: iteration 1's optimizer stage replaced by iteration 2's state (re-committed, so every
    checksum holds): the update from iteration 1's policy refuses it (its weight partitions differ
    from the loaded ones) instead of training on from other weights."""
    refs, _ = ds_chain(3)
    u1, u2 = refs[0], refs[1]
    folder, donor = Path(opt_state.optimizer_state_uri(u1)), Path(opt_state.optimizer_state_uri(u2))
    summary = read_manifest(str(donor))[0].summary
    shutil.rmtree(folder)
    shutil.copytree(donor, folder)
    (folder / "_MANIFEST.json").unlink()
    commit = opt_state.optimizer_commit(u1)
    commit_files(str(folder), stage=commit.stage, config_hash=commit.config_hash, inputs={"ppo_update": u1},
                 summary=summary, schema=OPTIMIZER_STATE, contract=commit.contract)
    lines: list[str] = []
    with pytest.raises(StageProcessError):
        _update(update_inputs, u1, _ds(update_inputs[3], 3), "zero3-2-other", RUNNER, lines)
    assert any("holds other weights than the checkpoint this update loaded" in line for line in lines), lines[-20:]


def test_deepspeed_state_checks_name_both_sides(tmp_path):
    saved = DeepSpeedCheckpoint(folder=str(tmp_path), tag="zero", world_size=2, zero_stage=2, bf16=False,
                                source="run/iter=000001/ppo_update-optimizer")
    check_deepspeed_state(saved, world_size=2, zero_stage=2, bf16=False)  # the same layout: continued
    with pytest.raises(DeepSpeedStateError, match=r"ppo_update-optimizer: .*saved by 2 ranks but this update runs on 4"):
        check_deepspeed_state(saved, world_size=4, zero_stage=2, bf16=False)
    with pytest.raises(DeepSpeedStateError, match="saved under ZeRO stage 2 but this update runs ZeRO stage 3"):
        check_deepspeed_state(saved, world_size=2, zero_stage=3, bf16=False)
    with pytest.raises(DeepSpeedStateError, match="saved by a float32 model but this update trains a bfloat16 model"):
        check_deepspeed_state(saved, world_size=2, zero_stage=2, bf16=True)
    model = torch.nn.Linear(2, 2)
    settings = OptimizerSettings(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    with pytest.raises(DeepSpeedStateError, match="cannot be continued by a single-process update"):
        build_strategy(model, optim=settings, deepspeed_state=saved)
    with pytest.raises(DeepSpeedStateError, match="cannot be continued by a DeepSpeed update"):
        build_strategy(model, optim=settings, deepspeed=DeepSpeedConfig(zero_stage=2), optimizer_state=str(tmp_path))


@pytest.mark.rotation(7)  # long: one turn in 8 (tests/rotation.py; out of group 6, measured at 1042 s with it)
def test_bf16_masters_are_continued_not_rounded(update_inputs, tiny_model):
    """DeepSpeed bf16: the float32 master partitions of iteration 1 (read back with DeepSpeed's
    zero_to_fp32) round to its bfloat16 checkpoint but hold more; iteration 2, at a learning rate
    too small to move any of them (1e-30), ends with them unchanged, not with their rounding."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = _ds(update_inputs[3], 2)
    lines: list[str] = []
    u1 = _update(update_inputs, tiny_model, cfg, "bf16-1", RUNNER, lines, dtype="bfloat16")
    u2 = _update(update_inputs, u1, cfg.model_copy(update={"lr": 1e-30}), "bf16-2", RUNNER, lines, dtype="bfloat16")
    assert not [line for line in lines if any(w in line for w in STALE_WARNINGS)]
    assert read_manifest(opt_state.optimizer_state_uri(u2))[0].summary["bf16"] is True
    m1, m2 = (get_fp32_state_dict_from_zero_checkpoint(opt_state.optimizer_state_uri(u), tag="zero") for u in (u1, u2))
    w1 = _weights(u1.uri)
    assert m1.keys() == m2.keys() and set(m1) <= set(w1) and m1["lm_head.weight"].dtype == torch.float32
    assert all(torch.equal(m1[k].bfloat16(), w1[k].bfloat16()) for k in m1)  # the checkpoint is their rounding
    assert _max_diff(m1, {k: v.bfloat16() for k, v in m1.items()}) > 1e-5  # ... and they hold more than it
    assert _max_diff(m2, m1) < 1e-12  # continued exactly (a restart from the rounding would be off by > 1e-5)
    assert all(torch.equal(m2[k].bfloat16(), v.bfloat16()) for k, v in _weights(u2.uri).items() if k in m2)


@pytest.mark.rotation(7)  # long: one turn in 8 (tests/rotation.py; out of group 6, measured at 941 s with it)
def test_critic_update_under_zero2_on_two_ranks_matches_one_process(update_inputs, tiny_model):
    """The critic trains through the same loop and strategies as the policy: ZeRO-2 over 2 ranks
    gives the single-process critic's losses and weights over two updates, the second continuing
    the first's ZeRO state (``critic-optimizer/``: AdamW moments and float32 master partitions)."""
    root, r, a, _, _ = update_inputs
    # a random value head and its own old values (a fresh critic's zero head gives the backbone no first
    # gradient); targets: the advantage shard's returns (+-1)
    critic, values, start = random_head_critic(tiny_model, r, root)
    cfg = CriticConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, value_clip=None)
    single = critic_chain(update_inputs, critic, values, cfg, "c")
    sharded = critic_chain(update_inputs, critic, values, cfg.model_copy(update={"deepspeed": DeepSpeedConfig(zero_stage=2)}),
                           "zero2-c", RUNNER)
    assert read_manifest(sharded[0].uri)[0].summary["world_size"] == 2
    restarted, = critic_chain(update_inputs, f"{single[0].uri}/critic", values, cfg, "c-restart", iterations=1)
    assert_critic_chain_continues(
        single, sharded, start=start, restarted=restarted, tol=1e-5,
        files=["critic-optimizer/latest", "critic-optimizer/zero/mp_rank_00_model_states.pt",
               "critic-optimizer/zero/zero_pp_rank_0_mp_rank_00_optim_states.pt",
               "critic-optimizer/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        state={"format": "deepspeed", "tag": "zero", "world_size": 2, "zero_stage": 2, "bf16": False})


@pytest.mark.rotation(0)  # long (~77 s, its own torchrun chain): one turn in 8 (tests/rotation.py)
def test_a_resident_zero3_critic_gang_keeps_its_state_and_equals_the_torchrun_updates(update_inputs, tiny_model,
                                                                                    tmp_path):
    """orchestration.critic_ranks=2 with critic.deepspeed ZeRO-3: the gang (Ray actors keeping the
    critic's partitions and ZeRO state; a new gang for the third update, restoring them from
    storage) gives the torchrun updates' losses and weights bit for bit, and its values pass
    (rank 0 alone, from storage) one process's values from the checkpoint
    (``resident_critic_gang``); each update commits every rank's ZeRO partition."""
    cfg = CriticConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, value_clip=None,
                       deepspeed=DeepSpeedConfig(zero_stage=3))
    refs, staged = resident_critic_gang(update_inputs, tiny_model, tmp_path, cfg, "zero3-gang")
    for ref in (*refs, *staged):
        m, _ = read_manifest(ref.uri)
        assert m.summary["optimizer"]["zero_stage"] == 3 and m.summary["optimizer"]["world_size"] == 2
        assert {"critic-optimizer/zero/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "critic-optimizer/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= {e.path for e in m.files}


# -- the resident DeepSpeed trainer (issue 27): ranks as Ray actors that keep ZeRO's state -----------


def _resident_workers(pool: str):
    from rft_core.config import RayConfig, WorkersConfig

    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return WorkersConfig(pool=pool, threads=1, policy_ranks=2,
                         ray=RayConfig(options={"policy": {"runtime_env": {"env_vars": env}}}))


def _resident_chain(update_inputs, tiny_model, workers, zero_stage: int, tag: str, *, stop_after: int | None = None,
                    start: list | None = None):
    """ITERATIONS updates in the resident policy gang of ``workers``, as checkpoint.every=3 runs
    them: the first two keep their weights in the ranks' memory, the last commits weights and the
    ZeRO state. ``start``: refs committed by an earlier (crashed) gang, continued from."""
    from rft_core.workers.pool import run_resident

    root, r, a = update_inputs[:3]
    refs, policy = list(start or []), (start[-1] if start else tiny_model)
    for i in range(len(refs) + 1, (stop_after or ITERATIONS) + 1):
        inp = PPOUpdateInput(rollout=r, advantages=a, policy=policy, update=_ds(update_inputs[3], zero_stage), kl=KLConfig(),
                             temperature=1.0, out=str(root / f"{tag}-{i}"), save_checkpoint=i == ITERATIONS)
        policy = run_resident(inp, workers)
        refs.append(policy)
    return refs


@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
def test_resident_zero_gang_keeps_its_state_and_equals_the_torchrun_updates(update_inputs, single_chain, ds_chain,
                                                                            tiny_model, zero_stage, tmp_path):
    """Two ranks kept as Ray actors for the run (orchestration.policy_ranks=2): 3 updates, the
    first two without writing weights or ZeRO state (checkpoint.every=3), end with the weights of
    the 3 torchrun updates that each restored ZeRO's state from storage, bit for bit, and so
    within 1e-6 of the single process; every step's loss is the torchrun one."""
    pytest.importorskip("ray")
    from rft_core.workers.pool import stop_workers
    from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY, has_weights
    from rft_core.weightsync.digest import method_of

    import ray

    from rft_core.workers.pool import start_worker

    workers = _resident_workers(str(tmp_path))
    try:
        refs = _resident_chain(update_inputs, tiny_model, workers, zero_stage, f"resident-zero{zero_stage}")
        # the rollout worker pulls the gang's weights (a ZeRO-3 gather on both ranks) through shared memory (one CPU host)
        rollout = start_worker(workers, "rollout")
        ray.get(rollout.inference_model.remote(tiny_model, dtype="float32", role="policy"))
        synced = ray.get(rollout.inference_model.remote(refs[-1], dtype="float32", role="policy")).state_dict()
        syncs = ray.get(rollout.stats.remote())["weight_syncs"]
    finally:
        stop_workers(workers.pool)
    assert syncs == 1
    assert all(torch.equal(synced[k], v) for k, v in _weights(refs[-1].uri).items())
    staged, _ = ds_chain(zero_stage)
    for ref, want in zip(refs, staged):
        assert read_shard(ref.uri).to_pydict()["policy_loss"] == read_shard(want.uri).to_pydict()["policy_loss"]
    assert [has_weights(r) for r in refs] == [False, False, True]
    assert method_of(read_manifest(refs[0].uri)[0].summary[WEIGHTS_DIGEST_KEY]) == "xxh3"  # gathered to the CPU
    got, want = _weights(refs[-1].uri), _weights(staged[-1].uri)
    assert all(torch.equal(got[k], want[k]) for k in want), _max_diff(got, want)
    assert _max_diff(got, _weights(single_chain[-1].uri)) < 1e-6
    opt_manifest, _ = read_manifest(opt_state.optimizer_state_uri(refs[-1]))
    assert opt_manifest.summary["world_size"] == 2 and opt_manifest.summary["zero_stage"] == zero_stage


@pytest.mark.rotation(1)  # long: one turn in 8, with the ZeRO-3 chain's other users (tests/rotation.py)
def test_a_crashed_zero3_gang_is_rebuilt_exactly_from_the_committed_updates(update_inputs, ds_chain, tiny_model,
                                                                            tmp_path):
    """Both ranks of the gang are SIGKILLed after 2 weightless updates (a crash: their memory is
    gone, nothing is flushed); a new gang rebuilds the policy from the initial model by
    re-applying both committed updates on its 2 ranks (digests checked on rank 0), then the third
    update ends with the uninterrupted weights."""
    pytest.importorskip("ray")
    import os
    import signal
    import time

    import ray

    from rft_core.workers.pool import stop_workers, worker_handle, worker_stats

    workers = _resident_workers(str(tmp_path))
    try:
        first = _resident_chain(update_inputs, tiny_model, workers, 3, "crash-zero3", stop_after=2)
        pids = [ray.get(worker_handle(workers.pool, "policy", rank=r).ping.remote()) for r in (0, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

        def state(pid: int) -> str:
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return "gone"

        deadline = time.monotonic() + 30
        while any(state(pid) not in ("gone", "Z", "X") for pid in pids):  # dead, or not yet reaped by the raylet
            assert time.monotonic() < deadline, {pid: state(pid) for pid in pids}
            time.sleep(0.05)
        # the next update finds the gang dead (RayActorError), starts a new one and runs again (pool.run_resident)
        refs = _resident_chain(update_inputs, tiny_model, workers, 3, "crash-zero3", start=first)
        new = [ray.get(worker_handle(workers.pool, "policy", rank=r).ping.remote()) for r in (0, 1)]
        assert not set(new) & set(pids)
        stats = worker_stats(workers.pool)
        assert stats["policy"]["recovered_updates"] == 2 and stats["policy-rank1"]["recovered_updates"] == 2
    finally:
        stop_workers(workers.pool)
    got, want = _weights(refs[-1].uri), _weights(ds_chain(3)[0][-1].uri)
    assert all(torch.equal(got[k], want[k]) for k in want), _max_diff(got, want)
