"""Checkpoint retention: pruning records what it removes before removing it, never rewrites a
manifest, never touches Parquet parts, keeps the last N iterations whole, keeps the weights of
the last few and of every N-th iteration by default, and a pruned checkpoint refuses to be
trained from instead of silently restarting the optimizer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

import schemas.shards as shards
from rft_core.config import ConfigError, load_config
from rft_core.stages import retention
from rft_core.stages.checkpoints import policy_checkpoint_dir, policy_model_path
from rft_core.config import CheckpointConfig
from rft_core.stages.retention import (
    CheckpointPrunedError,
    apply_retention,
    keeps_weights,
    prunable_files,
    prune_checkpoints,
)
from schemas import (
    ShardCorruptError,
    ShardNotCommittedError,
    commit_files,
    committed_ref,
    prune_files,
    pruned_files,
    read_manifest,
    read_shard,
    stage_uri,
    write_parts,
)
from schemas.columns import PPO_UPDATE

FILES = {"policy/config.json": b"{}", "policy/model.safetensors": b"w" * 1000, "policy/optimizer.pt": b"o" * 2000,
         "policy/tokenizer.json": b"{}"}


def _checkpoint_stage(run_root: str, iteration: int, stage: str = "ppo_update", subdir: str = "policy"):
    uri = stage_uri(run_root, iteration, stage)
    folder = Path(uri)
    for rel, data in FILES.items():
        (folder / rel.replace("policy/", f"{subdir}/")).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel.replace("policy/", f"{subdir}/")).write_bytes(data)
    table = pa.table({k: [] for k in PPO_UPDATE.schema.names}, schema=PPO_UPDATE.arrow) if stage == "ppo_update" else None
    rows = write_parts(table, uri, schema=PPO_UPDATE) if table is not None else {}
    return commit_files(uri, stage=stage, config_hash=f"h{iteration}", schema=PPO_UPDATE if table is not None else None,
                        rows_per_file=rows)


def test_prune_files_records_then_deletes_and_the_stage_stays_committed(tmp_path):
    ref = _checkpoint_stage(str(tmp_path), 1)
    manifest_before = Path(ref.uri, "_MANIFEST.json").read_bytes()
    assert prune_files(ref.uri, ["policy/optimizer.pt"], reason="test") == ["policy/optimizer.pt"]
    assert not Path(ref.uri, "policy/optimizer.pt").exists() and Path(ref.uri, "policy/model.safetensors").exists()
    assert pruned_files(ref.uri) == {"policy/optimizer.pt": "test"}
    assert Path(ref.uri, "_MANIFEST.json").read_bytes() == manifest_before  # never rewritten
    assert committed_ref(ref.uri, stage="ppo_update", config_hash="h1") == ref  # still reusable
    assert read_shard(ref).num_rows == 0  # the metrics parts still read and verify
    assert prune_files(ref.uri, ["policy/optimizer.pt"], reason="again") == []  # idempotent
    assert pruned_files(ref.uri) == {"policy/optimizer.pt": "test"}
    # a missing file that is NOT recorded is still corruption
    Path(ref.uri, "policy/tokenizer.json").unlink()
    with pytest.raises(ShardCorruptError, match="tokenizer.json but the file is missing"):
        committed_ref(ref.uri, stage="ppo_update", config_hash="h1")


def test_prune_files_refuses_parquet_parts_unknown_paths_and_uncommitted_stages(tmp_path):
    ref = _checkpoint_stage(str(tmp_path), 1)
    part = next(e.path for e in read_manifest(ref.uri)[0].files if e.rows is not None)
    with pytest.raises(ValueError, match=f"cannot prune '{part}': it is a Parquet part"):
        prune_files(ref.uri, [part], reason="x")
    with pytest.raises(ValueError, match="'policy/nope.bin': the manifest does not list it"):
        prune_files(ref.uri, ["policy/nope.bin"], reason="x")
    assert pruned_files(ref.uri) == {} and Path(ref.uri, part).exists()
    with pytest.raises(ShardNotCommittedError):
        prune_files(str(tmp_path / "never"), ["a"], reason="x")
    Path(ref.uri, "_PRUNED.json").write_text("[1, 2]")
    with pytest.raises(ShardCorruptError, match="_PRUNED.json: expected an object"):
        committed_ref(ref.uri, stage="ppo_update", config_hash="h1")


def test_a_crash_between_record_and_delete_leaves_a_consistent_stage(tmp_path):
    ref = _checkpoint_stage(str(tmp_path), 1)
    Path(ref.uri, "_PRUNED.json").write_text(json.dumps({"policy/optimizer.pt": "interrupted"}))  # recorded, not deleted
    assert committed_ref(ref.uri, stage="ppo_update", config_hash="h1") == ref
    assert prune_files(ref.uri, ["policy/optimizer.pt"], reason="x") == []  # already recorded: no-op
    Path(ref.uri, "policy/optimizer.pt").unlink()  # the delete finishing later is fine too
    assert committed_ref(ref.uri, stage="ppo_update", config_hash="h1") == ref


def test_prunable_files_by_mode():
    files = ["part-00000.parquet", "policy/config.json", "policy/model.safetensors", "policy/model-00001-of-00002.safetensors",
             "policy/model.safetensors.index.json", "policy/optimizer.pt", "policy/tokenizer.json", "critic/optimizer.pt"]
    assert prunable_files(files, "policy", "optimizer") == ["policy/optimizer.pt"]
    assert prunable_files(files, "policy", "weights") == [
        "policy/model-00001-of-00002.safetensors", "policy/model.safetensors", "policy/model.safetensors.index.json",
        "policy/optimizer.pt"]
    assert prunable_files(files, "critic", "weights") == ["critic/optimizer.pt"]
    with pytest.raises(ValueError, match="prune must be 'optimizer' or 'weights'"):
        prunable_files(files, "policy", "all")


def test_a_sharded_critics_state_is_its_optimizer_state_for_retention(tmp_path):
    """A DeepSpeed or FSDP2 critic keeps its AdamW state in ``critic-optimizer/`` beside its
    weights (``rft_core.stages.common.commit_trained``): pruning the optimizer state removes that
    folder's every file and leaves the weights loadable; the next update asking for the state
    is refused, naming the files."""
    from rft_core.stages.checkpoints import sharded_state_dir

    files = ["part-00000.parquet", "critic/config.json", "critic/model.safetensors", "critic-optimizer/latest",
             "critic-optimizer/zero/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "critic-optimizer/dcp/.metadata"]
    state = ["critic-optimizer/dcp/.metadata", "critic-optimizer/latest",
             "critic-optimizer/zero/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert prunable_files(files, "critic", "optimizer") == state
    assert prunable_files(files, "critic", "weights") == sorted(state + ["critic/model.safetensors"])
    assert prunable_files(files, "policy", "optimizer") == []  # another checkpoint's state is not this one's

    for i in (1, 2):  # a critic_update stage at iterations 1 and 2 with its sharded state
        uri = stage_uri(str(tmp_path), i, "critic_update")
        for rel, data in {"critic/config.json": b"{}", "critic/model.safetensors": b"w" * 1000,
                          "critic-optimizer/latest": b"zero",
                          "critic-optimizer/zero/rank_0_optim_states.pt": b"s" * 500}.items():
            Path(uri, rel).parent.mkdir(parents=True, exist_ok=True)
            Path(uri, rel).write_bytes(data)
        commit_files(uri, stage="critic_update", config_hash=f"h{i}")
    one = stage_uri(str(tmp_path), 1, "critic_update")
    assert sorted(p.relative_to(one).as_posix() for p in Path(one, "critic-optimizer").rglob("*") if p.is_file()) == [
        "critic-optimizer/latest", "critic-optimizer/zero/rank_0_optim_states.pt"]
    ref = committed_ref(one, stage="critic_update", config_hash="h1")
    assert Path(sharded_state_dir(ref, "critic")) == Path(one, "critic-optimizer")  # whole: handed out
    done = prune_checkpoints(str(tmp_path), 2, keep_last=1, prune="optimizer")
    assert done == {one: ["critic-optimizer/latest", "critic-optimizer/zero/rank_0_optim_states.pt"]}
    assert not Path(one, "critic-optimizer/latest").exists() and Path(one, "critic/model.safetensors").exists()
    assert policy_model_path(ref, "critic") == f"{one}/critic"  # the weights still load
    with pytest.raises(CheckpointPrunedError, match=r"critic-optimizer/latest, critic-optimizer/zero/rank_0_optim"
                                                    r"_states.pt were pruned \(checkpoint.keep_last=1 after iteration 2"):
        sharded_state_dir(ref, "critic")


@pytest.mark.parametrize("prune", ["optimizer", "weights"])
def test_prune_checkpoints_keeps_the_last_n_iterations_whole(tmp_path, prune):
    root = str(tmp_path / "run")
    refs = {i: _checkpoint_stage(root, i) for i in (1, 2, 3, 4)}
    critic = _checkpoint_stage(root, 1, stage="critic_update", subdir="critic")
    window = {"keep_weights_last": 2, "keep_weights_every": None}  # weights go with the optimizer state
    assert prune_checkpoints(root, 2, keep_last=2, prune=prune, **window) == {}  # nothing older than the last 2 yet
    done = prune_checkpoints(root, 4, keep_last=2, prune=prune, **window)
    gone = ["policy/optimizer.pt"] + (["policy/model.safetensors"] if prune == "weights" else [])
    assert done == {refs[1].uri: sorted(gone), refs[2].uri: sorted(gone),
                    critic.uri: sorted(p.replace("policy/", "critic/") for p in gone)}
    for i in (1, 2):
        left = sorted(p.name for p in Path(refs[i].uri, "policy").iterdir())
        assert left == sorted(Path(rel).name for rel in FILES if rel not in gone)
    for i in (3, 4):  # the last 2 are untouched
        assert sorted(p.name for p in Path(refs[i].uri, "policy").iterdir()) == sorted(Path(rel).name for rel in FILES)
        assert pruned_files(refs[i].uri) == {}
    assert prune_checkpoints(root, 4, keep_last=2, prune=prune, **window) == {}  # idempotent (a resume calls it again)
    # training from a pruned checkpoint is refused, never a silent fresh optimizer
    with pytest.raises(CheckpointPrunedError, match=r"optimizer.pt were pruned \(.*checkpoint.keep_last=2 after iteration 4\)"):
        policy_checkpoint_dir(refs[1])
    if prune == "weights":
        with pytest.raises(CheckpointPrunedError, match="model.safetensors"):
            policy_model_path(refs[2])
    else:
        assert policy_model_path(refs[2]) == f"{refs[2].uri}/policy"  # weights kept: still loadable
    assert policy_checkpoint_dir(refs[3]) == f"{refs[3].uri}/policy"
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune_checkpoints(root, 4, keep_last=0)


def test_checkpoint_config_validates():
    cfg = load_config(None, ["checkpoint.keep_last=2", "checkpoint.prune=optimizer", "checkpoint.keep_weights_every=null"])
    assert (cfg.checkpoint.keep_last, cfg.checkpoint.prune, cfg.checkpoint.keep_weights_every) == (2, "optimizer", None)
    # bounded by default: optimizer state of the last iteration, weights of the last 3 and every 10th
    d = load_config(None).checkpoint
    assert (d.keep_last, d.prune, d.keep_weights_last, d.keep_weights_every) == (1, "weights", 3, 10)
    assert load_config(None, ["checkpoint.keep_last=null"]).checkpoint.keep_last is None  # keep everything
    with pytest.raises(ConfigError, match="checkpoint.keep_last"):
        load_config(None, ["checkpoint.keep_last=0"])
    with pytest.raises(ConfigError, match="checkpoint.prune"):
        load_config(None, ["checkpoint.prune=everything"])
    with pytest.raises(ConfigError, match="checkpoint.keep_weights_every"):
        load_config(None, ["checkpoint.keep_weights_every=0"])


def test_keeps_weights_last_few_and_every_nth():
    # after iteration 25 with the defaults (last 3, every 10): 10, 20 and 23..25 keep their weights
    kept = [i for i in range(1, 26) if keeps_weights(i, 25, keep_weights_last=3, keep_weights_every=10)]
    assert kept == [10, 20, 23, 24, 25]
    assert [i for i in range(1, 6) if keeps_weights(i, 5, keep_weights_last=1, keep_weights_every=None)] == [5]
    assert [i for i in range(1, 8) if keeps_weights(i, 7, keep_weights_last=2, keep_weights_every=3)] == [3, 6, 7]


def test_default_retention_over_twelve_iterations(tmp_path):
    root = str(tmp_path / "run")
    refs = {i: _checkpoint_stage(root, i) for i in range(1, 13)}
    for i in range(1, 13):  # the flow applies retention after every iteration
        apply_retention(root, i, CheckpointConfig())
    for i in range(1, 12):  # every iteration but the last lost its optimizer state
        assert "policy/optimizer.pt" in pruned_files(refs[i].uri), i
    assert pruned_files(refs[12].uri) == {}
    with_weights = [i for i in range(1, 13) if Path(refs[i].uri, "policy/model.safetensors").exists()]
    assert with_weights == [10, 11, 12]  # 10: every 10th; 10-12: the last 3
    assert pruned_files(refs[1].uri)["policy/model.safetensors"] == (
        "checkpoint.prune=weights (keep_weights_last=3, keep_weights_every=10) after iteration 4")
    assert pruned_files(refs[11].uri) == {"policy/optimizer.pt": "checkpoint.keep_last=1 after iteration 12"}
    # iteration 10's weights stay loadable (eval, reference); its optimizer state is gone
    assert policy_model_path(refs[10]) == f"{refs[10].uri}/policy"
    with pytest.raises(CheckpointPrunedError, match=r"iter=000010/ppo_update: checkpoint file\(s\) policy/optimizer.pt"):
        policy_checkpoint_dir(refs[10])
    with pytest.raises(CheckpointPrunedError, match=r"policy/model.safetensors.*keep_weights_last=3"):
        policy_model_path(refs[9])
    # keep_last=None keeps everything
    assert apply_retention(str(tmp_path / "other"), 5, CheckpointConfig(keep_last=None)) == {}


def _weightless_stage(run_root: str, iteration: int):
    """A committed ppo_update whose weights stayed in a resident worker (checkpoint.every > 1)."""
    uri = stage_uri(run_root, iteration, "ppo_update")
    Path(uri).mkdir(parents=True)
    table = pa.table({k: [] for k in PPO_UPDATE.schema.names}, schema=PPO_UPDATE.arrow)
    rows = write_parts(table, uri, schema=PPO_UPDATE)
    return commit_files(uri, stage="ppo_update", config_hash=f"h{iteration}", schema=PPO_UPDATE, rows_per_file=rows,
                        summary={"weights_sha256": "0" * 64})


def test_the_last_checkpoint_stays_whole_between_checkpoints(tmp_path):
    """checkpoint.every=4: iterations 4 and 8 write weights. The last checkpoint before the current
    iteration keeps its weights and optimizer state however old, since a resume rebuilds the
    policies after it from it; an older checkpoint is pruned as usual."""
    from rft_core.stages.retention import latest_policy_checkpoint

    root = str(tmp_path / "run")
    cfg = CheckpointConfig(keep_last=1, keep_weights_last=1, keep_weights_every=None)
    refs = {}
    for i in range(1, 11):
        refs[i] = _checkpoint_stage(root, i) if i % 4 == 0 else _weightless_stage(root, i)
        apply_retention(root, i, cfg)
        assert latest_policy_checkpoint(root, i) == (None if i < 4 else 4 if i < 8 else 8)
        if i in (5, 6, 7):  # iteration 4 is the last checkpoint: whole, although older than keep_last
            assert pruned_files(refs[4].uri) == {} and policy_checkpoint_dir(refs[4])
    assert pruned_files(refs[8].uri) == {}
    assert set(pruned_files(refs[4].uri)) == {"policy/model.safetensors", "policy/optimizer.pt"}
    assert all(pruned_files(refs[i].uri) == {} for i in (1, 2, 3, 5, 6, 7, 9, 10))  # nothing to prune there


def test_what_the_next_rollouts_sample_with_keeps_its_weights_under_staleness(tmp_path):
    """rollout.max_staleness s = 4 with the default retention (keep_last 1, keep_weights_last 3,
    keep_weights_every 10): after every iteration i the checkpoints of versions i - 4 .. i, which
    the rollouts of the next iterations sample with, still have their weights (before, versions
    i - 4 and i - 3 lost them: a prefetched rollout failed with CheckpointPrunedError); older ones
    and every optimizer state but the last are pruned as without staleness. Between checkpoints
    (checkpoint.every 3, s = 2) the checkpoint the sampled versions are rebuilt from stays whole."""
    from rft_core.stages.retention import staleness_floor

    root = str(tmp_path / "run")
    refs = {}
    for i in range(1, 13):
        refs[i] = _checkpoint_stage(root, i)
        apply_retention(root, i, CheckpointConfig(), max_staleness=4)
        assert staleness_floor(root, i, 4) == max(1, i - 4)
        for v in range(max(1, i - 4), i + 1):  # the versions the next rollouts sample with: readable
            assert policy_model_path(refs[v]) == f"{refs[v].uri}/policy", (i, v)
        if i >= 8:  # outside that window the default retention applies (keep_weights_last 3 alone would drop i - 3)
            with pytest.raises(CheckpointPrunedError, match="keep_weights_last=3"):
                policy_model_path(refs[i - 5])
    assert [v for v in range(1, 13) if "policy/optimizer.pt" not in pruned_files(refs[v].uri)] == [12]
    with_weights = [v for v in range(1, 13) if Path(refs[v].uri, "policy/model.safetensors").exists()]
    assert with_weights == [8, 9, 10, 11, 12]  # 8-12: the window; 10 also every 10th
    # checkpoint.every=3 (stored weights at 3, 6, 9), s = 2: after iteration 9 the versions 7-9 are sampled next,
    # rebuilt from checkpoint 6, which keeps its weights and optimizer state; checkpoint 3 is pruned
    root = str(tmp_path / "every3")
    cfg = CheckpointConfig(every=3, keep_last=1, keep_weights_last=1, keep_weights_every=None)
    refs = {i: _checkpoint_stage(root, i) if i % 3 == 0 else _weightless_stage(root, i) for i in range(1, 10)}
    for i in range(1, 10):
        apply_retention(root, i, cfg, max_staleness=2)
    assert staleness_floor(root, 9, 2) == 6 and pruned_files(refs[6].uri) == {}
    assert set(pruned_files(refs[3].uri)) == {"policy/model.safetensors", "policy/optimizer.pt"}
    assert staleness_floor(root, 9, 0) is None and staleness_floor(root, 1, 2) == 1


def test_a_deepspeed_optimizer_stage_is_pruned_whole(tmp_path):
    """DeepSpeed's optimizer stage holds partitions, not optimizer.pt: past keep_last all of it goes,
    and loading it afterwards names it as pruned."""
    root = str(tmp_path / "run")
    for i in (1, 2):
        _checkpoint_stage(root, i)
        uri = stage_uri(root, i, "ppo_update-optimizer")
        files = {"latest": b"global_step1", "zero/global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"o" * 300,
                 "zero/global_step1/mp_rank_00_model_states.pt": b"m" * 100}
        for rel, data in files.items():
            Path(uri, rel).parent.mkdir(parents=True, exist_ok=True)
            Path(uri, rel).write_bytes(data)
        commit_files(uri, stage="optimizer_state", config_hash=f"o{i}", files=sorted(files),
                     summary={"format": "deepspeed"})
    apply_retention(root, 2, CheckpointConfig(keep_last=1, prune="optimizer"))
    opt1 = stage_uri(root, 1, "ppo_update-optimizer")
    assert set(pruned_files(opt1)) == {"latest", "zero/global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "zero/global_step1/mp_rank_00_model_states.pt"}
    assert not Path(opt1, "latest").exists() and Path(stage_uri(root, 2, "ppo_update-optimizer"), "latest").exists()
    from rft_core.stages.optimizer_state import optimizer_state_dir

    with pytest.raises(CheckpointPrunedError, match="ppo_update-optimizer"):
        optimizer_state_dir(committed_ref(opt1, stage="optimizer_state", config_hash="o1", check_files=False))


def _counting_manifest_reads(monkeypatch) -> list[str]:
    """Record every manifest read of retention and of ``prune_files`` (the URIs, in order)."""
    reads: list[str] = []
    real = shards.read_manifest

    def counted(uri):
        reads.append(uri)
        return real(uri)

    monkeypatch.setattr(shards, "read_manifest", counted)
    monkeypatch.setattr(retention, "read_manifest", counted)
    return reads


def _fresh_pass_prunes_nothing(root: str, iteration: int, cfg: CheckpointConfig) -> None:
    """What a new process would do after ``iteration`` (no settled iterations remembered) finds
    nothing left to prune: the remembered ones were in their final state."""
    saved = dict(retention._SETTLED)
    retention._SETTLED.clear()
    try:
        assert apply_retention(root, iteration, cfg) == {}
    finally:
        retention._SETTLED.clear()
        retention._SETTLED.update(saved)


def test_each_pass_reads_only_the_iterations_not_settled_yet(tmp_path, monkeypatch):
    """After each iteration retention read the manifests of every older iteration (4 stages each:
    O(n) reads per iteration, a GET each on object storage). An iteration whose checkpoints a pass
    left as every later pass would is skipped by later passes of the same process: after iteration
    40 a pass reads as many manifests as after iteration 12, and what is pruned is what a fresh
    process's pass would prune (it finds nothing more)."""
    root = str(tmp_path / "run")
    cfg = CheckpointConfig()  # keep_last 1, weights of the last 3 and every 10th
    reads = _counting_manifest_reads(monkeypatch)
    per_pass = {}
    for i in range(1, 41):
        _checkpoint_stage(root, i)
        _checkpoint_stage(root, i, stage="critic_update", subdir="critic")
        del reads[:]
        apply_retention(root, i, cfg)
        per_pass[i] = len(reads)
        _fresh_pass_prunes_nothing(root, i, cfg)
    # from iteration 5 on a pass reads the last checkpoint, the newest settled iteration and the 3
    # iterations not settled yet (the last 3 keep their weights until they are decided): 26 reads
    # (fewer when one of the three is a 10th, whose weights are decided at once), at 5 as at 40
    assert per_pass[40] == per_pass[5] and max(per_pass.values()) <= 26, sorted(per_pass.items())
    with_weights = [i for i in range(1, 41) if Path(stage_uri(root, i, "ppo_update"), "policy/model.safetensors").exists()]
    assert with_weights == [10, 20, 30, 38, 39, 40]
    assert [i for i in range(1, 41) if Path(stage_uri(root, i, "ppo_update"), "policy/optimizer.pt").exists()] == [40]
    # without the memo the same pass reads every older iteration again
    retention._SETTLED.clear()
    del reads[:]
    apply_retention(root, 40, cfg)
    assert len(reads) >= 4 * 39


def _background_checkpoint(run_root: str, iteration: int):
    """A resident checkpoint iteration (``checkpoint.async_weights``): its ppo_update commits the
    weights' digest and its input; returns a function that commits ``ppo_update-policy`` later,
    as the background write does (rft_core.stages.optimizer_state.commit_policy_checkpoint)."""
    uri = stage_uri(run_root, iteration, "ppo_update")
    Path(uri).mkdir(parents=True)
    table = pa.table({k: [] for k in PPO_UPDATE.schema.names}, schema=PPO_UPDATE.arrow)
    rows = write_parts(table, uri, schema=PPO_UPDATE)
    update = commit_files(uri, stage="ppo_update", config_hash=f"h{iteration}", schema=PPO_UPDATE, rows_per_file=rows,
                          summary={"weights_sha256": "0" * 64,
                                   "update_input": {"save_checkpoint": True, "background_checkpoint": True}})

    def commit_weights():
        sibling = stage_uri(run_root, iteration, "ppo_update-policy")
        for rel, data in FILES.items():
            if rel != "policy/optimizer.pt":
                Path(sibling, rel).parent.mkdir(parents=True, exist_ok=True)
                Path(sibling, rel).write_bytes(data)
        return commit_files(sibling, stage="policy_checkpoint", config_hash=f"p{iteration}",
                            files=sorted(r for r in FILES if r != "policy/optimizer.pt"), inputs={"ppo_update": update})

    return commit_weights


def test_a_checkpoint_whose_weights_commit_after_a_pass_is_pruned_by_a_later_one(tmp_path, monkeypatch):
    """Every iteration writes its weights in the background, and each write commits only after
    the next iteration's pass has looked (slow storage): that pass judged an iteration whose weights
    were not there yet, the case that made remembering settled iterations unsafe when done
    naively. With keep_weights_last=1 each one's weights still go once a newer checkpoint is on
    storage, and a fresh process's pass finds nothing more to prune at any point."""
    root = str(tmp_path / "run")
    cfg = CheckpointConfig(keep_last=1, keep_weights_last=1, keep_weights_every=None)
    reads = _counting_manifest_reads(monkeypatch)
    in_flight = []
    for i in range(1, 13):
        in_flight.append(_background_checkpoint(root, i))
        if len(in_flight) > 2:
            in_flight.pop(0)()  # iteration i - 2's weights commit while iteration i runs
        del reads[:]
        apply_retention(root, i, cfg)
        assert len(reads) <= 24, (i, reads)
        _fresh_pass_prunes_nothing(root, i, cfg)
    assert not Path(stage_uri(root, 11, "ppo_update-policy")).exists()  # iterations 11 and 12 still writing
    for commit in in_flight:
        commit()
    apply_retention(root, 13, cfg)
    _fresh_pass_prunes_nothing(root, 13, cfg)
    kept = [i for i in range(1, 13) if Path(stage_uri(root, i, "ppo_update-policy"), "policy/model.safetensors").exists()]
    assert kept == [12]  # the last checkpoint; every earlier one lost its weights once a newer one was on storage
    assert all("policy/model.safetensors" in pruned_files(stage_uri(root, i, "ppo_update-policy")) for i in range(1, 12))


def test_a_run_root_started_again_is_pruned_again(tmp_path):
    """The run root deleted and a new run started in it, in the same process: what a pass
    remembered of the old run no longer holds (the newest remembered iteration's update is another
    manifest, or not there), so the new run's checkpoints are pruned as the first run's were."""
    root = str(tmp_path / "run")
    cfg = CheckpointConfig(keep_last=1, keep_weights_last=2, keep_weights_every=None)
    for attempt in (1, 2):
        for i in range(1, 8 if attempt == 1 else 6):
            _checkpoint_stage(root, i)
            apply_retention(root, i, cfg)
            _fresh_pass_prunes_nothing(root, i, cfg)
        last = 7 if attempt == 1 else 5
        with_weights = [i for i in range(1, last + 1)
                        if Path(stage_uri(root, i, "ppo_update"), "policy/model.safetensors").exists()]
        assert with_weights == [last - 1, last], attempt
        if attempt == 1:
            shutil.rmtree(root)
