"""Stage mode keeping its models in memory (``orchestration.keep_models``, ``rft_core.stages.memo``):
the same shards and weights, bit for bit, as every stage reading its model from storage; the
kept trainer and models are really used; a failed update leaves no half-trained trainer behind;
a damaged checkpoint is still refused. Rewards vary inside each group (``tests/varying.py``) and
the equality test asserts the advantages and gradients are not 0 first."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rft_core.counters import COUNTS
import rft_core.stages.memo as memo
from rft_core.stages.checkpoints import WeightlessPolicyError, policy_model_path
from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY, kept_in_memory, policy_checkpoint_uri, weights_stage
from rft_core.stages import optimizer_state as opt_state
from rft_core.stages import update as update_stage
from rft_core.stages.sources import load_from_storage
from schemas import ShardCorruptError, ShardRef, read_manifest, stage_uri
from tests.drive import drive
from tests.varying import assert_training_signal, varying_config
from tests.weights import iteration_policy_files, policy_files

STAGES = ("rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update")


def _cfg(model: str, root, keep: bool, *extra: str):
    return varying_config(model, root, f"orchestration.keep_models={str(keep).lower()}", "orchestration.workers=stage",
                          "logprobs.recompute_old_logprobs=true", "kl.kl_coef=0.05", "update.lr=1e-3", *extra,
                          iterations=3)


def _parts(root, it: int, stage: str) -> dict[str, str]:
    return {e.path: e.checksum for e in read_manifest(stage_uri(str(root), it, stage))[0].files}


@pytest.fixture(scope="module")
def storage_run(tiny_model, tmp_path_factory):
    """3 iterations with every stage reading its model from storage: the reference."""
    root = tmp_path_factory.mktemp("storage")
    memo.clear()
    COUNTS.clear()
    final = drive(_cfg(tiny_model, root, keep=False))
    return root, final, COUNTS["model_loads"]


def test_kept_models_give_the_storage_run_bit_for_bit(storage_run, tiny_model, tmp_path):
    root_s, final_s, loads_s = storage_run
    assert_training_signal(root_s, (1, 2, 3))
    assert memo.hits() == {}  # keep_models=false used nothing kept
    memo.clear()
    COUNTS.clear()
    # the weights written by the update itself (the background writes: the test after the next ones)
    cfg = _cfg(tiny_model, tmp_path, True, "checkpoint.async_weights=false")
    assert cfg.runner("ppo_update").keep_models and cfg.runner("rollout").keep_models and not cfg.background_checkpoint
    final = drive(cfg)
    assert_training_signal(tmp_path, (1, 2, 3))
    # every committed file of every stage (parts, the checkpoint's weights, the optimizer state) is the same
    for it in (1, 2, 3):
        for stage in STAGES:
            assert _parts(tmp_path, it, stage) == _parts(root_s, it, stage), (it, stage)
        assert _parts(tmp_path, it, "ppo_update-optimizer") == _parts(root_s, it, "ppo_update-optimizer"), it
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")
    # what was kept was used: the trainer by the updates of iterations 2 and 3, the next policy's
    # inference model made from it (rollouts of 2 and 3), the kept models by the other passes
    h = memo.hits()
    assert h["trainer"] == 2 and h["inference_from_trainer"] == 2 and h["inference"] >= 4, h
    # storage: 3 iterations x (rollout, actor, reference, update) = 12 reads; kept: iteration 1's
    # policy (shared by its rollout, actor and reference passes) and its trainer
    assert loads_s == 12 and COUNTS["model_loads"] == 2, (loads_s, COUNTS["model_loads"])


def test_a_failed_update_leaves_no_trainer_behind(storage_run, tiny_model, tmp_path, monkeypatch):
    """Iteration 2's update fails after its optimizer steps changed the kept trainer's weights:
    the rerun (same process, same run root) rebuilds the trainer from storage and ends with the
    storage run's weights."""
    root_s, final_s, _ = storage_run
    memo.clear()
    cfg = _cfg(tiny_model, tmp_path, keep=True)
    real = update_stage.run_update_steps
    failed: list[float] = []

    def steps_then_fail(trainer, inp, *args, **kwargs):
        out = real(trainer, inp, *args, **kwargs)
        if inp.policy_version == 1:
            failed.append(next(trainer.strategy.model.parameters()).detach().float().sum().item())
            raise RuntimeError("injected failure after the optimizer steps")
        return out

    monkeypatch.setattr(update_stage, "run_update_steps", steps_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        drive(cfg)
    assert failed and memo.hits()["trainer"] == 1  # the failed update had the kept trainer and stepped it
    monkeypatch.setattr(update_stage, "run_update_steps", real)
    before = memo.hits()["trainer"]
    final = drive(cfg)
    assert memo.hits()["trainer"] == before + 1  # iteration 2 rebuilt from storage; iteration 3 took it
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")


def test_a_damaged_checkpoint_is_refused_though_its_model_is_kept(storage_run, tiny_model, tmp_path):
    memo.clear()
    cfg = _cfg(tiny_model, tmp_path, keep=True)
    final = drive(cfg)
    with memo.keeping_models(True):
        model = load_from_storage(final, dtype="float32")
        assert load_from_storage(final, dtype="float32") is model  # kept
        weights = next(Path(weights_stage(final).uri, "policy").glob("*.safetensors"))  # ppo_update-policy
        weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
        with pytest.raises(ShardCorruptError, match=weights.name):
            load_from_storage(final, dtype="float32")


def _metric_parts(root, it: int) -> dict[str, str]:
    return {p: sha for p, sha in _parts(root, it, "ppo_update").items() if not p.startswith("policy/")}


@pytest.mark.parametrize("reads", ["the-trainer's-tensors", "host-copies"])
def test_weights_written_in_the_background_give_the_storage_run_bit_for_bit(storage_run, tiny_model, tmp_path,
                                                                           monkeypatch, reads):
    """``checkpoint.async_weights`` (default) in stage mode keeping its models: each update commits
    the weights' digest without them (``ppo_update`` has no ``policy/``), the writer thread commits
    them as ``ppo_update-policy`` after the optimizer stage, the next iteration's stages use the
    kept trainer meanwhile, and every shard, weight file and optimizer state equals the run whose
    stages read every model from storage. ``host-copies``: the weights and the AdamW state are
    staged in host buffers as CUDA ones are (CPU tensors stand for them, ``pin_memory`` patched),
    so the next update steps during the writes and waits for them only before it commits."""
    root_s, final_s, _ = storage_run
    memo.clear()
    if reads == "host-copies":
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
        monkeypatch.setattr(opt_state, "_STAGED", {})
        real_stage = opt_state.stage_on_host
        monkeypatch.setattr(opt_state, "stage_on_host", lambda state, **kw: real_stage(state, **{**kw, "device": "cpu"}))
        real_write = opt_state._write_policy
        staged: list[bool] = []
        monkeypatch.setattr(opt_state, "_write_policy",
                            lambda *a: staged.append(a[-1] is not None) or real_write(*a))
    cfg = _cfg(tiny_model, tmp_path, keep=True)
    assert cfg.checkpoint.async_weights is True and cfg.background_checkpoint  # the default
    assert not _cfg(tiny_model, tmp_path, keep=False).background_checkpoint  # the stages' own processes: no
    final = drive(cfg)
    if reads == "host-copies":
        assert staged == [True, True, True] and set(opt_state._STAGED) == {"optimizer", "policy"}
    assert_training_signal(tmp_path, (1, 2, 3))
    for it in (1, 2, 3):
        update = ShardRef.from_manifest(stage_uri(str(tmp_path), it, "ppo_update"))
        manifest = read_manifest(update.uri)[0]
        assert WEIGHTS_DIGEST_KEY in manifest.summary and not any(e.path.startswith("policy/") for e in manifest.files)
        held = weights_stage(update)
        assert held is not None and held.uri == policy_checkpoint_uri(update), it
        for stage in STAGES[:-1]:
            assert _parts(tmp_path, it, stage) == _parts(root_s, it, stage), (it, stage)
        assert _metric_parts(tmp_path, it) == _metric_parts(root_s, it), it
        assert _parts(tmp_path, it, "ppo_update-optimizer") == _parts(root_s, it, "ppo_update-optimizer"), it
        assert policy_files(update) == {p: sha for p, sha in _parts(root_s, it, "ppo_update").items()
                                        if p.startswith("policy/")}, it
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")
    h = memo.hits()  # the kept trainer served the updates of iterations 2 and 3 while its weights were written
    assert h["trainer"] == 2 and h["inference_from_trainer"] == 2, h


@pytest.mark.parametrize("lost", ["optimizer-and-weights", "weights"])
def test_a_lost_background_checkpoint_is_recomputed_in_stage_mode(storage_run, tiny_model, tmp_path, lost):
    """A crash during iteration 2's background write (its ``ppo_update`` committed with the digest
    only; the ``-policy`` stage, and the ``-optimizer`` stage before it, never committed; iteration
    3 never ran): the rerun in a fresh process (nothing kept) runs iteration 2's update again from
    its committed inputs, checks the recorded digest, commits what was lost, and iteration 3 trains
    from it to the storage run's weights, bit for bit."""
    root_s, final_s, _ = storage_run
    memo.clear()
    cfg = _cfg(tiny_model, tmp_path, keep=True)  # the weights written in the background (the default)
    drive(cfg)
    u2 = stage_uri(str(tmp_path), 2, "ppo_update")
    gone = ["ppo_update-policy"] + (["ppo_update-optimizer"] if lost == "optimizer-and-weights" else [])
    for stage in gone:
        shutil.rmtree(f"{u2}{stage.removeprefix('ppo_update')}")
    shutil.rmtree(Path(stage_uri(str(tmp_path), 3, "prompts")).parent)
    with pytest.raises(WeightlessPolicyError, match=r"written in the background .*ppo_update-policy.* never committed"):
        policy_model_path(ShardRef.from_manifest(u2))  # what eval or a new run would ask for before the rerun
    memo.clear()
    final = drive(cfg)
    m = read_manifest(f"{u2}-optimizer")[0]
    assert (m.summary.get("recovered"), m.summary.get("weights_match")) == (
        (True, True) if lost == "optimizer-and-weights" else (None, None)), m.summary
    assert policy_files(ShardRef.from_manifest(u2)) == iteration_policy_files(root_s, 2)
    assert _parts(tmp_path, 3, "rollout") == _parts(root_s, 3, "rollout")  # sampled by the recomputed policy 2
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")


def test_the_trainer_is_kept_for_its_own_version_and_settings_only():
    memo.clear()
    trainer = object()
    with memo.keeping_models(True):
        memo.keep_trainer("v1", "s", trainer)
        assert memo.take_trainer("v1", "other settings") is None
        assert memo.take_trainer("v1", "s") is None  # taken out by the first call, whatever it matched
        memo.keep_trainer("v1", "s", trainer)
        assert memo.take_trainer("v1", "s") is trainer and memo.take_trainer("v1", "s") is None
    memo.keep_trainer("v1", "s", trainer)  # outside keeping_models: nothing is kept or served
    with memo.keeping_models(True):
        assert memo.take_trainer("v1", "s") is None
    assert memo.inference_model("k", "float32", lambda: torch.nn.Linear(1, 1)) is not \
        memo.inference_model("k", "float32", lambda: torch.nn.Linear(1, 1))


def test_keep_models_auto_follows_the_engine(tiny_model, tmp_path):
    from rft_core.config import load_config

    hf = load_config(None, [f"policy.path={tiny_model}", f"run_root={tmp_path}", "orchestration.workers=stage"])
    assert hf.keeps_models and hf.runner("rollout").keep_models and hf.runner("prompts").keep_models
    vllm = load_config(None, [f"policy.path={tiny_model}", f"run_root={tmp_path}", "orchestration.workers=stage",
                              "rollout.engine=vllm"])
    assert not vllm.keeps_models and not vllm.runner("ppo_update").keep_models
    off = load_config(None, [f"policy.path={tiny_model}", f"run_root={tmp_path}", "orchestration.keep_models=false"])
    assert not off.runner("ref_logprobs").keep_models


def test_the_optimizer_state_file_has_no_crc_and_loads_exactly(tmp_path):
    """``save_optimizer_state`` skips the zip records' CRC-32 (the manifest's checksum checks the
    file): the records' CRC fields are 0 and ``read_optimizer_state`` gives the tensors back exactly."""
    import zipfile

    from rft_core.training.checkpoint import OPTIMIZER_FILE, read_optimizer_state, save_optimizer_state

    p = torch.nn.Parameter(torch.randn(300, 7, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    save_optimizer_state(opt.state_dict(), tmp_path / OPTIMIZER_FILE)
    data = [i for i in zipfile.ZipFile(tmp_path / OPTIMIZER_FILE).infolist() if "/data/" in i.filename]
    assert data and all(i.CRC == 0 for i in data)
    back = read_optimizer_state(tmp_path)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(back["state"][0][key], opt.state_dict()["state"][0][key])


def test_kept_models_on_remote_storage(storage_run, tiny_model, tmp_path, monkeypatch):
    """On memory:// (remote storage: checkpoints are read through the download cache) the kept
    trainer and the policies made from it serve iterations 2 and 3, and the run ends with the
    weights of the local run that read every model from storage."""
    _, final_s, _ = storage_run
    monkeypatch.setenv("RFT_CACHE_DIR", str(tmp_path / "cache"))
    memo.clear()
    final = drive(_cfg(tiny_model, f"memory://memo/{tmp_path.name}", keep=True))
    assert memo.hits()["trainer"] == 2 and memo.hits()["inference_from_trainer"] == 2
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")


def _weightless(root, it: int) -> bool:
    update = ShardRef.from_manifest(stage_uri(str(root), it, "ppo_update"))
    return kept_in_memory(update) and weights_stage(update) is None and not opt_state.optimizer_state_committed(update)


def test_checkpoint_every_in_stage_mode_gives_the_storage_run_bit_for_bit(storage_run, tiny_model, tmp_path):
    """``checkpoint.every=3`` in stage mode keeping its models: the updates of iterations 1 and 2
    commit their metrics and the digest of their weights, no weights and no optimizer stage; the
    kept trainer and the policies made from it serve the next stages; every shard and the final
    weights equal the run whose every update wrote its checkpoint and whose stages read every model
    from storage."""
    root_s, final_s, _ = storage_run
    memo.clear()
    COUNTS.clear()
    cfg = _cfg(tiny_model, tmp_path, True, "checkpoint.every=3")
    assert [cfg.is_checkpoint(i) for i in (1, 2, 3)] == [False, False, True]
    final = drive(cfg)
    assert_training_signal(tmp_path, (1, 2, 3))
    assert _weightless(tmp_path, 1) and _weightless(tmp_path, 2) and not _weightless(tmp_path, 3)
    for it in (1, 2, 3):
        for stage in STAGES[:-1]:
            assert _parts(tmp_path, it, stage) == _parts(root_s, it, stage), (it, stage)
        assert _metric_parts(tmp_path, it) == _metric_parts(root_s, it), it
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")
    assert _parts(tmp_path, 3, "ppo_update-optimizer") == _parts(root_s, 3, "ppo_update-optimizer")
    h = memo.hits()
    assert h["trainer"] == 2 and h["inference_from_trainer"] == 2, h
    assert COUNTS["model_loads"] == 2 and not COUNTS.get("recovered_updates"), dict(COUNTS)


def test_a_rerun_rebuilds_the_policy_stage_mode_kept_in_memory(storage_run, tiny_model, tmp_path):
    """A crash after iteration 2 of a ``checkpoint.every=3`` stage-mode run (its policy lived in
    the process's memory only): the rerun in a fresh process (nothing kept) rebuilds it before
    iteration 3's rollout, re-applying the two committed updates to the initial model (each
    checked against its recorded digest), and ends with the storage run's weights, bit for bit."""
    root_s, final_s, _ = storage_run
    memo.clear()
    cfg = _cfg(tiny_model, tmp_path, True, "checkpoint.every=3")
    drive(cfg, stop_after=2)
    assert _weightless(tmp_path, 2)
    u2 = ShardRef.from_manifest(stage_uri(str(tmp_path), 2, "ppo_update"))
    with pytest.raises(WeightlessPolicyError):
        load_from_storage(u2, dtype="float32")  # a process that keeps no models cannot serve it
    memo.clear()
    COUNTS.clear()
    final = drive(cfg)
    assert COUNTS["recovered_updates"] == 2, dict(COUNTS)
    assert memo.hits()["inference_from_trainer"] == 1 and memo.hits()["trainer"] == 1, memo.hits()
    for stage in STAGES[:-1]:
        assert _parts(tmp_path, 3, stage) == _parts(root_s, 3, stage), stage
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")


def test_a_failed_update_rebuilds_the_policy_stage_mode_kept_in_memory(storage_run, tiny_model, tmp_path,
                                                                      monkeypatch):
    """Iteration 3's update of a ``checkpoint.every=3`` stage-mode run fails after its optimizer
    steps moved the kept trainer (taken out of the memo, so nothing half-trained is kept); the
    retry in the same process finds no trainer for policy 2, which lived in memory only, rebuilds
    it from the initial model and the two committed updates, and ends with the storage run's weights."""
    root_s, final_s, _ = storage_run
    memo.clear()
    cfg = _cfg(tiny_model, tmp_path, True, "checkpoint.every=3")
    real = update_stage.run_update_steps
    failed: list[int] = []

    def steps_then_fail(trainer, inp, *args, **kwargs):
        out = real(trainer, inp, *args, **kwargs)
        if inp.policy_version == 2 and not failed:
            failed.append(inp.policy_version)
            raise RuntimeError("injected failure after the optimizer steps")
        return out

    monkeypatch.setattr(update_stage, "run_update_steps", steps_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        drive(cfg)
    assert failed == [2] and _weightless(tmp_path, 2)
    COUNTS.clear()
    final = drive(cfg)
    assert COUNTS["recovered_updates"] == 2, dict(COUNTS)
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rebuild_that_differs_from_the_recorded_digest(storage_run, tiny_model, tmp_path, monkeypatch, device):
    """The rebuild re-applies iterations 1 and 2 and gets other weights than their manifests
    recorded (the digests are replaced to force it). On the CPU, where the updates are
    deterministic, that means the inputs changed: ``RecoveryError`` naming the update. On a CUDA
    device (the trainer's device patched), whose kernels need not give the same bits twice, each
    mismatch is logged and counted (``inexact_rebuilds``) and the run goes on to its end."""
    from rft_core.stages import recovery
    from rft_core.stages.lineage import RecoveryError

    memo.clear()
    cfg = _cfg(tiny_model, tmp_path, True, "checkpoint.every=3")
    drive(cfg, stop_after=2)
    memo.clear()
    COUNTS.clear()
    real = recovery.committed_digest
    monkeypatch.setattr(recovery, "committed_digest", lambda ref: real(ref)[:-1] + ("1" if real(ref)[-1] != "1" else "2"))
    monkeypatch.setattr(recovery, "strategy_device", lambda strategy: torch.device(device))
    if device == "cpu":
        with pytest.raises(RecoveryError, match=r"iter=000001/ppo_update gave other weights .* on the CPU"):
            drive(cfg)
        return
    final = drive(cfg)
    assert COUNTS["inexact_rebuilds"] == 2 and COUNTS["recovered_updates"] == 2, dict(COUNTS)
    root_s, final_s, _ = storage_run  # the weights were the same, only the recorded digests were replaced
    assert policy_files(final, suffix=".safetensors") == policy_files(final_s, suffix=".safetensors")
