"""The policy's AdamW state as its own stage (rft_core.stages.optimizer_state): written in the
background and committed after the update, loaded and hashed by the next update, recomputed
exactly when its write was lost, reported when it failed; a DeepSpeed update's (ZeRO partitions)
is required like any other and continued only by a DeepSpeed update (the 2-rank runs are in
tests/rft_core/training/test_deepspeed_update.py)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rft_core import stages
from rft_core.config import load_config
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.stages import memo
from rft_core.stages import optimizer_state as opt_state
from rft_core.stages import writer
from rft_core.stages.checkpoints import check_policy_weights, policy_model_path
from rft_core.stages.contracts import AdvantagesInput, PPOUpdateInput, PromptsInput, RewardsInput, RolloutInput
from rft_core.stages.lineage import policy_checkpoint_uri
from rft_core.stages.retention import CheckpointPrunedError
from rft_core.training.checkpoint import OPTIMIZER_FILE, save_checkpoint
import rft_core.training.strategy as strategy_module
from rft_core.training.strategy import DeepSpeedStateError, SingleProcess
from schemas import commit_files, prune_files, read_manifest, read_shard, stage_uri
from tests.flows.conftest import _fake_score


@pytest.fixture
def cfg(tiny_model, monkeypatch):
    monkeypatch.setattr("rft_core.rewards.math.score_response", _fake_score)  # reward spread: nonzero advantages
    return load_config(None, {"policy.path": tiny_model, "data.prompts_per_iteration": 3, "data.size": 30,
                              "rollout.n_samples_per_prompt": 4, "rollout.max_new_tokens": 6, "rollout.batch_size": 12,
                              "kl.kl_coef": 0.0, "update.lr": 1e-3, "update.micro_batch_size": 4})


def _experience(cfg, root: str, i: int, policy) -> dict:
    """The committed inputs of iteration ``i``'s update (no actor or reference pass)."""
    p = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=cfg.policy.path, iteration=i,
                                        out=stage_uri(root, i, "prompts")))
    r = stages.rollout.run(RolloutInput(prompts=p, policy=policy if isinstance(policy, str) else f"{policy.uri}/policy",
                                        rollout=cfg.rollout, iteration=i, out=stage_uri(root, i, "rollout")))
    w = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=stage_uri(root, i, "rewards")))
    a = stages.advantages.run(AdvantagesInput(rollout=r, rewards=w, kl=cfg.kl, advantage=cfg.advantage,
                                              state=cfg.initial_state, out=stage_uri(root, i, "advantages")))
    return dict(rollout=r, advantages=a, update=cfg.update, kl=cfg.kl, temperature=cfg.rollout.temperature,
                out=stage_uri(root, i, "ppo_update"))


def _update(cfg, root, i, policy, **kw):
    return stages.update.run(PPOUpdateInput(**{**_experience(cfg, root, i, policy), "policy": policy, **kw}))


def _state(folder) -> dict:
    return torch.load(Path(folder) / OPTIMIZER_FILE, map_location="cpu", weights_only=True)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for k in a["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][k][name], b["state"][k][name]), (k, name)


def test_background_write_commits_and_the_next_update_continues_from_it(cfg, tmp_path):
    root = str(tmp_path / "run")
    u1 = _update(cfg, root, 1, cfg.policy.path, background_optimizer=True)
    writer.wait_for_optimizer_writes()
    if hasattr(os, "setpriority"):  # the writer thread yields the CPU to the stages (nice +10)
        import threading

        assert writer._EXECUTOR.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result() == 10
    m, sha = read_manifest(opt_state.optimizer_state_uri(u1))
    assert m.stage == "optimizer_state" and m.num_rows == 0 and [f.path for f in m.files] == [OPTIMIZER_FILE]
    assert m.inputs == {"ppo_update": u1.manifest_sha256} and m.config_hash == opt_state.optimizer_commit(u1).config_hash
    assert read_shard(opt_state.optimizer_state_uri(u1)).num_rows == 0  # validates as a stage of its own
    s1 = _state(opt_state.optimizer_state_uri(u1))
    assert all(float(v["step"]) == 1 and v["exp_avg"].abs().sum() > 0 for v in s1["state"].values())
    assert not Path(u1.uri, "policy", OPTIMIZER_FILE).exists()  # not in the weights folder any more

    u2 = _update(cfg, root, 2, u1)  # synchronous: committed before it returns
    m2, _ = read_manifest(u2.uri)
    assert m2.inputs["optimizer"] == sha  # the state it started from is part of its identity
    s2 = _state(opt_state.optimizer_state_uri(u2))
    assert all(float(v["step"]) == 2 for v in s2["state"].values())  # AdamW continued, not restarted
    # a pruned state (checkpoint.keep_last) is refused, never replaced by a fresh optimizer
    prune_files(opt_state.optimizer_state_uri(u1), [OPTIMIZER_FILE], reason="checkpoint.keep_last=1 (test)")
    with pytest.raises(CheckpointPrunedError, match=r"optimizer.pt were pruned \(checkpoint.keep_last=1 \(test\)\)"):
        opt_state.optimizer_state_dir(opt_state.optimizer_state_ref(u1))
    assert opt_state.optimizer_state_dir(opt_state.optimizer_state_ref(u2)) == opt_state.optimizer_state_uri(u2)


def test_a_lost_write_is_recomputed_exactly_when_the_update_is_resumed(cfg, tmp_path, caplog):
    root = str(tmp_path / "run")
    u1 = _update(cfg, root, 1, cfg.policy.path)
    folder = Path(opt_state.optimizer_state_uri(u1))
    want = _state(folder)
    assert all(v["exp_avg"].abs().sum() > 0 for v in want["state"].values())  # moments a recompute must match
    upd_files = {p: p.stat().st_mtime_ns for p in Path(u1.uri).rglob("*") if p.is_file()}
    # a crash during the write: no manifest, a truncated file and the dead writer's lock left behind
    shutil.rmtree(folder)
    folder.mkdir()
    (folder / OPTIMIZER_FILE).write_bytes(b"\x00" * 100)
    (folder / ".writer.lock").write_text(json.dumps({"token": "x", "host": os.uname().nodename, "pid": 2 ** 22 + 7,
                                                     "since": 0}))
    assert opt_state.optimizer_state_missing(u1)
    with pytest.raises(writer.OptimizerStateError, match=f"{folder}.*never committed.*Rerun the training flow"):
        _update(cfg, root, 2, u1)  # the next update cannot start without it
    assert not Path(stage_uri(root, 2, "ppo_update"), "_MANIFEST.json").exists()

    with caplog.at_level("INFO", logger="rft_core.stages"):
        again = _update(cfg, root, 1, cfg.policy.path)  # the resume of iteration 1
    assert again == u1  # the committed update is reused, untouched
    assert {p: p.stat().st_mtime_ns for p in Path(u1.uri).rglob("*") if p.is_file()} == upd_files
    m, _ = read_manifest(str(folder))
    assert m.summary["recovered"] is True and m.summary["weights_match"] is True
    _assert_same_state(_state(folder), want)  # bit-identical: same inputs, same seeds
    assert "weights match the commit" in caplog.text
    assert not opt_state.optimizer_state_missing(u1)
    _update(cfg, root, 2, u1)  # and training goes on


def test_a_failed_background_write_is_reported_once_then_recomputed(cfg, tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    real_save = torch.save

    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(opt_state.torch, "save", disk_full)
    u1 = _update(cfg, root, 1, cfg.policy.path, background_optimizer=True)
    uri = opt_state.optimizer_state_uri(u1)
    with pytest.raises(writer.OptimizerStateError, match=f"{uri}: the background write .*No space left"):
        writer.wait_for_optimizer_writes()
    writer.wait_for_optimizer_writes()  # reported once: nothing pending any more
    assert not Path(uri, "_MANIFEST.json").exists() and not Path(uri, ".writer.lock").exists()  # lock released
    monkeypatch.setattr(opt_state.torch, "save", real_save)
    assert _update(cfg, root, 1, cfg.policy.path) == u1
    assert read_manifest(uri)[0].summary["recovered"] is True


@pytest.mark.parametrize("copied", [False, True], ids=["reading-its-tensors", "reading-a-host-copy"])
def test_the_next_update_trains_during_the_write_and_steps_after_it(cfg, tmp_path, monkeypatch, copied):
    """Stage mode keeping its trainer: update 2 finds its commit (its config hash holds the
    optimizer stage's config hash, known before the write ends) and runs its forward and backward
    passes while update 1's optimizer state is still being written. Its optimizer step waits for
    a write that reads the trainer's own tensors; a write from a host copy (``stage_on_host``, a
    CUDA state; here CPU tensors stand for it, as in the staging test below) lets it step during
    the write, and its commit waits. Either way it ends bit for bit where the same updates end
    with synchronous writes."""
    sync_root, root = str(tmp_path / "sync"), str(tmp_path / "background")
    with memo.keeping_models(True):
        r1 = _update(cfg, sync_root, 1, cfg.policy.path)
        r2 = _update(cfg, sync_root, 2, r1)
    memo.clear()
    release, real_save = threading.Event(), opt_state.save_optimizer_state

    def held_save(state, path):  # the write of update 1's state goes on until update 2 trains (or steps)
        assert release.wait(120), "update 2 never reached its backward pass (its step) while the write was held"
        real_save(state, path)

    monkeypatch.setattr(opt_state, "save_optimizer_state", held_save)
    if copied:
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
        monkeypatch.setattr(opt_state, "_STAGED", {})
        real_stage = opt_state.stage_on_host
        monkeypatch.setattr(opt_state, "stage_on_host", lambda state, **kw: real_stage(state, device="cpu", **kw))
    with memo.keeping_models(True):
        u1 = _update(cfg, root, 1, cfg.policy.path, background_optimizer=True)
        manifest = Path(opt_state.optimizer_state_uri(u1), "_MANIFEST.json")
        assert opt_state.writes_pending(u1) and not manifest.exists()
        assert opt_state.writes_reading_tensors(u1) == ([] if copied else opt_state.writes_pending(u1))
        seen: dict[str, list[bool]] = {"backward": [], "step": []}
        real_backward, real_step = SingleProcess.backward, strategy_module.clip_and_step

        def backward(self, loss):
            seen["backward"].append(manifest.exists())
            if not copied:
                release.set()
            return real_backward(self, loss)

        def step(*a, **kw):
            seen["step"].append(manifest.exists())
            release.set()
            return real_step(*a, **kw)

        monkeypatch.setattr(SingleProcess, "backward", backward)
        monkeypatch.setattr(strategy_module, "clip_and_step", step)
        u2 = _update(cfg, root, 2, u1)
        assert memo.hits()["trainer"] == 1  # the kept trainer, whose state the writer was reading
    assert seen["backward"][0] is False and seen["step"]  # trained during the write
    assert seen["step"][0] is (not copied)  # stepped after it (its own tensors) or during it (a copy)
    assert manifest.exists() and read_manifest(u2.uri)[0].inputs["optimizer"] == read_manifest(manifest.parent.as_posix())[1]
    inp2 = PPOUpdateInput(**_experience(cfg, root, 2, u1), policy=u1)  # its committed inputs, reused
    assert u2.config_hash == inp2.config_hash(optimizer=read_manifest(manifest.parent.as_posix())[0].config_hash)
    m1, m2 = read_manifest(r1.uri)[0], read_manifest(r2.uri)[0]
    assert m2.summary["grad_norm"] > 0 and {f.checksum for f in m1.files} != {f.checksum for f in m2.files}  # it moved
    assert {f.path: f.checksum for f in read_manifest(u2.uri)[0].files} == {f.path: f.checksum for f in m2.files}
    writer.wait_for_optimizer_writes()
    _assert_same_state(_state(opt_state.optimizer_state_uri(u1)), _state(opt_state.optimizer_state_uri(r1)))
    _assert_same_state(_state(opt_state.optimizer_state_uri(u2)), _state(opt_state.optimizer_state_uri(r2)))
    opt_state.release_host_staging()


def _adamw_state(steps: int, seed: int = 0, width: int = 4) -> tuple[torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(steps):
        model(torch.randn(2, width)).square().sum().backward()
        opt.step()
    return opt, {**opt.state_dict(), "master_weights": {"weight": model.weight.detach().clone()}, "master_dtype": "bfloat16"}


def test_a_device_state_is_staged_on_the_host_in_reused_buffers(monkeypatch, tmp_path):
    """``stage_on_host`` through torch's BlockingAsyncStager. This CPU build has no page-locked
    memory (torch.Tensor.pin_memory raises "Cannot access accelerator device"): it is replaced by
    the identity, and CPU tensors stand for the device ones (``device="cpu"``)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(opt_state, "_STAGED", {})
    opt, state = _adamw_state(2)
    assert opt_state.stage_on_host(state) == (state, False)  # no CUDA tensor: written as it is
    staged, reused = opt_state.stage_on_host(state, device="cpu")
    assert reused and staged["param_groups"] == state["param_groups"] and staged["master_dtype"] == "bfloat16"
    _assert_same_state(staged, state)
    assert torch.equal(staged["master_weights"]["weight"], state["master_weights"]["weight"])
    ptr, layout = staged["state"][0]["exp_avg"].data_ptr(), opt_state._STAGED["optimizer"][0]
    assert ptr != state["state"][0]["exp_avg"].data_ptr()
    want = {k: {n: t.clone() for n, t in v.items()} for k, v in state["state"].items()}
    opt.param_groups[0]["params"][0].grad = torch.ones_like(opt.param_groups[0]["params"][0])
    opt.step()  # the optimizer moves on: the staged copy does not
    assert not torch.equal(state["state"][0]["exp_avg"], want[0]["exp_avg"])
    _assert_same_state(staged, {"state": want})
    opt_state.save_optimizer_state(staged, tmp_path / OPTIMIZER_FILE)
    _assert_same_state(_state(tmp_path), {"state": want})  # what the writer writes from it

    again, reused = opt_state.stage_on_host(state, device="cpu")  # same layout: the same buffers, new values
    assert reused and again["state"][0]["exp_avg"].data_ptr() == ptr and float(again["state"][0]["step"]) == 3
    _assert_same_state(again, state)
    busy = Future()  # a write still running, which may read those buffers: a fresh copy instead
    monkeypatch.setitem(writer._PENDING, "memory://run/iter=000001/ppo_update-optimizer", writer._Write(busy, False, "optimizer"))
    fresh, reused = opt_state.stage_on_host(state, device="cpu")
    assert not reused and fresh["state"][0]["exp_avg"].data_ptr() != ptr
    _assert_same_state(fresh, state)
    busy.set_result(None)  # done (joined or not): the buffers are free again
    assert opt_state.stage_on_host(state, device="cpu")[0]["state"][0]["exp_avg"].data_ptr() == ptr
    _, other = _adamw_state(1, width=5)  # another layout: buffers of its own
    staged5, reused = opt_state.stage_on_host(other, device="cpu")
    assert reused and staged5["state"][0]["exp_avg"].shape == (3, 5) and opt_state._STAGED["optimizer"][0] != layout
    monkeypatch.setattr(opt_state.psutil, "virtual_memory", lambda: SimpleNamespace(available=100))
    assert opt_state.stage_on_host(state, device="cpu") == (state, False)  # over half the host's memory: as it is
    opt_state.release_host_staging()
    assert opt_state._STAGED == {}


def test_a_models_weights_staged_on_the_host_are_written_as_its_own_save(tiny_model, tmp_path, monkeypatch):
    """The policy weights a background checkpoint writes from a host copy (``_staged_weights``,
    buffers "policy", CPU tensors standing for CUDA ones): the copy does not move with the model,
    and ``save_checkpoint(state_dict=...)`` writes the same files, byte for byte, as the model's
    own save before it moved (tied embeddings included)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(opt_state, "_STAGED", {})
    model, tok = load_causal_lm(tiny_model, dtype="float32", trainable=True), load_tokenizer(tiny_model)
    weights = model.state_dict()
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()  # tied
    monkeypatch.setattr(opt_state, "stage_on_host", partial(opt_state.stage_on_host, device="cpu"))
    staged, reused = opt_state._staged_weights(weights)
    assert reused and set(opt_state._STAGED) == {"policy"} and list(staged) == list(weights)
    assert staged["lm_head.weight"] is staged["model.embed_tokens.weight"]  # still one tensor
    assert staged["lm_head.weight"].data_ptr() != weights["lm_head.weight"].data_ptr()  # a copy
    save_checkpoint(model, tok, None, tmp_path / "own")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the trainer moves on: the staged copy does not
    save_checkpoint(model, tok, None, tmp_path / "staged", state_dict=staged)

    def files(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    assert files(tmp_path / "own") == files(tmp_path / "staged") and "model.safetensors" in files(tmp_path / "own")


def test_a_reader_joins_the_pending_write_of_the_weights_it_asks_for(cfg, tmp_path, monkeypatch):
    """Stage mode with ``background_checkpoint``: while the writer thread still writes update 1's
    weights, the check of the kept model's files passes without them (``check_policy_weights``:
    nothing on storage yet), and a reader that asks for the folder (``policy_model_path``) waits
    for the write and gets the committed ``ppo_update-policy/policy``."""
    release, real_write = threading.Event(), opt_state._write_policy

    def held_write(*args):
        assert release.wait(120), "the reader never asked for the weights"
        return real_write(*args)

    monkeypatch.setattr(opt_state, "_write_policy", held_write)
    with memo.keeping_models(True):
        u1 = _update(cfg, str(tmp_path / "run"), 1, cfg.policy.path, background_optimizer=True,
                     background_checkpoint=True)
    uri = policy_checkpoint_uri(u1)
    assert opt_state.writes_pending(u1) == [opt_state.optimizer_state_uri(u1), uri]
    assert not Path(u1.uri, "policy").exists() and not Path(uri, "_MANIFEST.json").exists()
    check_policy_weights(u1)  # the kept trainer is what is being written: nothing to check, no wait
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(policy_model_path(u1)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not got  # waiting for the write
    release.set()
    reader.join(120)
    assert got == [f"{uri}/policy"] and Path(got[0], "model.safetensors").exists()
    assert opt_state.writes_pending(u1) == [opt_state.optimizer_state_uri(u1)]  # the policy write was joined
    writer.wait_for_optimizer_writes()
    memo.clear()


def _committed_stage(uri: str, stage: str, summary: dict):
    Path(uri).mkdir(parents=True)
    return commit_files(uri, stage=stage, config_hash="h", files=[], summary=summary)


def test_a_deepspeed_update_without_its_state_is_missing_never_restarted(tmp_path):
    """A DeepSpeed update has an optimizer stage like any other (its ZeRO partitions): one that
    never committed (a job killed before rank 0's manifest, or a run written before DeepSpeed kept
    its state) is reported missing, and the next update refuses to start AdamW afresh."""
    update = _committed_stage(str(tmp_path / "iter=000001" / "ppo_update"), "ppo_update",
                              {"world_size": 2, "zero_stage": 2})
    assert opt_state.optimizer_state_missing(update)  # so resuming that iteration recomputes it
    with pytest.raises(writer.OptimizerStateError, match="ppo_update-optimizer: .*never committed.*Rerun the training"):
        opt_state.optimizer_state_ref(update)


def test_an_optimizer_state_is_continued_only_by_the_kind_of_update_that_wrote_it(tmp_path):
    torch_state = _committed_stage(str(tmp_path / "a-optimizer"), "optimizer_state", {"seconds": 0.1})
    zero_state = _committed_stage(str(tmp_path / "b-optimizer"), "optimizer_state",
                                  {"format": "deepspeed", "tag": "zero", "world_size": 2, "zero_stage": 3, "bf16": False})
    with pytest.raises(DeepSpeedStateError, match=f"{tmp_path}/a-optimizer: .*written by a single-process update and "
                                                  "cannot be continued by a DeepSpeed update"):
        opt_state.saved_optimizer_state(torch_state, deepspeed=True)
    with pytest.raises(DeepSpeedStateError, match=f"{tmp_path}/b-optimizer: .*written by a DeepSpeed update and "
                                                  "cannot be continued by a single-process update"):
        opt_state.saved_optimizer_state(zero_state, deepspeed=False)
    assert opt_state.saved_optimizer_state(None, deepspeed=True) == (None, None)
    from rft_core.stages.sharded_state import sharded_checkpoint

    saved = sharded_checkpoint(read_manifest(zero_state.uri)[0].summary, "/local/copy", source=zero_state.uri)
    assert (saved.folder, saved.tag, saved.world_size, saved.zero_stage, saved.bf16, saved.source) == (
        "/local/copy", "zero", 2, 3, False, zero_state.uri)
    assert sharded_checkpoint(read_manifest(torch_state.uri)[0].summary, "/x", source=torch_state.uri) is None


def test_a_critics_state_is_continued_only_by_the_kind_of_critic_update_that_wrote_it(tmp_path):
    """The critic's AdamW state (``rft_core.stages.critic._saved_state``): a single-process
    critic's ``critic/optimizer.pt`` and a sharded critic's ``critic-optimizer/`` are each
    continued by their own kind of update only, and a sharded critic update committed before its
    state was kept is refused instead of restarting AdamW silently (the checks come before any
    process group or download)."""
    from rft_core.config import CriticConfig, DeepSpeedConfig, FSDPConfig
    from rft_core.stages.critic import _saved_state

    single, zero, fsdp = CriticConfig(), CriticConfig(deepspeed=DeepSpeedConfig(zero_stage=2)), CriticConfig(fsdp=FSDPConfig())
    one = _committed_stage(str(tmp_path / "one"), "critic_update", {"seconds": 1.0})
    sharded = _committed_stage(str(tmp_path / "zero"), "critic_update", {"world_size": 2, "zero_stage": 2, "optimizer": {
        "format": "deepspeed", "tag": "zero", "world_size": 2, "zero_stage": 2, "bf16": False}})
    before = _committed_stage(str(tmp_path / "before"), "critic_update", {"world_size": 2, "sharding": "fsdp2"})
    assert _saved_state("/initial/critic", fsdp) == {}  # an initial critic: AdamW afresh
    with pytest.raises(DeepSpeedStateError, match=f"{tmp_path}/one: .*written by a single-process update and cannot be "
                                                  "continued by an FSDP2 update; keep critic.deepspeed and critic.fsdp"):
        _saved_state(one, fsdp)
    with pytest.raises(DeepSpeedStateError, match=f"{tmp_path}/zero: .*written by a DeepSpeed update and cannot be "
                                                  "continued by a single-process update"):
        _saved_state(sharded, single)
    with pytest.raises(DeepSpeedStateError, match=f"{tmp_path}/zero: .*written by a DeepSpeed update and cannot be "
                                                  "continued by an FSDP2 update"):
        _saved_state(sharded, fsdp)
    for cfg in (zero, fsdp, single):
        with pytest.raises(DeepSpeedStateError, match=f"{tmp_path}/before: this sharded critic update kept no optimizer "
                                                      "state"):
            _saved_state(before, cfg)
    # the hash: a sharded critic update's holds sharded_optimizer (its stages of before are stale), a
    # single-process one's and every critic_values stage's are what they were
    from rft_core.stages.contracts import CriticUpdateInput, CriticValuesInput
    from rft_core.stages.critic import _critic_commit

    kw = {"rollout": one, "model": "/initial/critic", "out": str(tmp_path / "c")}
    upd = {c: CriticUpdateInput(advantages=one, critic_values=one, critic=cfg, **kw) for c, cfg in
           (("single", single), ("zero", zero), ("fsdp", fsdp))}
    assert _critic_commit(upd["single"]).config_hash == upd["single"].config_hash()
    for c in ("zero", "fsdp"):
        assert _critic_commit(upd[c]).config_hash == upd[c].config_hash(sharded_optimizer="continued") != \
            upd[c].config_hash()
    values = CriticValuesInput(critic=fsdp, **kw)
    assert _critic_commit(values).config_hash == values.config_hash()


def test_a_refused_critic_state_names_the_critics_settings(tmp_path):
    """A DeepSpeed critic state resumed on another world size, or an FSDP2 one in another dtype,
    is refused naming the critic's keys (runners.critic_update, critic.model.dtype, its critic/
    folder), not the policy's; the policy's refusals are what they were."""
    from rft_core.stages.sharded_state import sharded_checkpoint
    from rft_core.training.fsdp import FSDPStateError, check_fsdp_state
    from rft_core.training.zero import check_deepspeed_state

    zero = {"format": "deepspeed", "tag": "zero", "world_size": 2, "zero_stage": 2, "bf16": False}
    critic = sharded_checkpoint(zero, "/f", source="iter=1/critic_update", role="critic")
    with pytest.raises(DeepSpeedStateError, match=r"saved by 2 ranks but this update runs on 4.*keep "
                                                  r"runners.critic_update.nproc_per_node .* and critic.deepspeed .*its "
                                                  r"critic/ folder as critic.model.path"):
        check_deepspeed_state(critic, world_size=4, zero_stage=2, bf16=False)
    with pytest.raises(DeepSpeedStateError, match=r"\(critic.model.dtype changed\)"):
        check_deepspeed_state(critic, world_size=2, zero_stage=2, bf16=True)
    policy = sharded_checkpoint(zero, "/f", source="iter=1/ppo_update-optimizer")
    with pytest.raises(DeepSpeedStateError, match=r"keep runners.ppo_update.nproc_per_node .*policy.path"):
        check_deepspeed_state(policy, world_size=4, zero_stage=2, bf16=False)
    fsdp = {"format": "fsdp", "tag": "dcp", "world_size": 2, "bf16": True}
    with pytest.raises(FSDPStateError, match=r"\(critic.model.dtype changed\); keep critic.model.dtype"):
        check_fsdp_state(sharded_checkpoint(fsdp, "/f", source="c", role="critic"), bf16=False)
    with pytest.raises(FSDPStateError, match=r"\(policy.dtype changed\)"):
        check_fsdp_state(sharded_checkpoint(fsdp, "/f", source="p"), bf16=False)


def test_a_sharded_critics_state_is_handed_over_as_the_critics(tmp_path, monkeypatch):
    """``_saved_state`` of a DeepSpeed or FSDP2 critic update: the state in its
    ``critic-optimizer/`` folder (resolved once per node), marked as the critic's, so a refusal
    names the critic's settings."""
    from rft_core.config import CriticConfig, DeepSpeedConfig, FSDPConfig
    from rft_core.stages import critic as critic_stage
    from rft_core.stages import sharded_state

    seen = []
    monkeypatch.setattr(sharded_state, "folder_once_per_node",
                        lambda resolve, *, source, init: seen.append((source, init)) or "/node/copy")
    zero = _committed_stage(str(tmp_path / "zero"), "critic_update", {"world_size": 2, "zero_stage": 2, "optimizer": {
        "format": "deepspeed", "tag": "zero", "world_size": 2, "zero_stage": 2, "bf16": True}})
    fsdp = _committed_stage(str(tmp_path / "fsdp"), "critic_update", {"world_size": 2, "sharding": "fsdp2", "optimizer": {
        "format": "fsdp", "tag": "dcp", "world_size": 2, "bf16": False}})
    ds_state = critic_stage._saved_state(zero, CriticConfig(deepspeed=DeepSpeedConfig(zero_stage=2)))["deepspeed_state"]
    assert (ds_state.folder, ds_state.tag, ds_state.world_size, ds_state.bf16, ds_state.role) == (
        "/node/copy", "zero", 2, True, "critic")
    fsdp_state = critic_stage._saved_state(fsdp, CriticConfig(fsdp=FSDPConfig()))["fsdp_state"]
    assert (fsdp_state.folder, fsdp_state.world_size, fsdp_state.role) == ("/node/copy/dcp", 2, "critic")
    assert [s for s, _ in seen] == [zero.uri, fsdp.uri]
    assert [init.__name__ for _, init in seen] == ["init_distributed", "init_process_group"]


def test_a_failed_peer_releases_the_critics_writer_lock(tmp_path):
    """``commit_trained``'s sharded state (``_save_sharded_state``): when a peer fails while rank 0
    holds the stage's writer lock (here: the all-reduce after the lock reports a failed rank),
    every rank raises and the lock is released, so a rerun takes the stage at once."""
    from rft_core.stages.common import _save_sharded_state
    from rft_core.training.strategy import DeepSpeedStrategy

    class PeerFailed(DeepSpeedStrategy):  # rank 0 of 2, its peer failed; nothing of DeepSpeed is started
        def __init__(self):
            self.rank, self.world_size = 0, 2

        def all_reduce_sum(self, values):
            return [v + 1.0 for v in values]

    uri = str(tmp_path / "iter=000001" / "critic_update")
    with pytest.raises(writer.OptimizerStateError, match=r"taking the writer lock failed on 1 other rank"):
        _save_sharded_state(uri, PeerFailed(), "critic")
    assert not Path(uri, ".writer.lock").exists() and not Path(uri, "critic-optimizer").exists()
