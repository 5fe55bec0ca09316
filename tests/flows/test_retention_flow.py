"""Checkpoint retention in the flow: with checkpoint.keep_last=1 a crash in iteration 3's update
resumes from iteration 2's kept optimizer state, older checkpoints lose their files, and a
finished run resumes again without needing any pruned file."""
from __future__ import annotations

from pathlib import Path

import pytest

from schemas import pruned_files, read_shard
from tests.flows.conftest import flow_cfg


def test_keep_last_prunes_old_checkpoints_and_resume_still_works(prefect_harness, tiny_model, tmp_path, fake_rewards,
                                                                  monkeypatch):
    from flows.train import train
    from rft_core.stages import update as update_stage
    from rft_core.training import strategy as strategy_lib

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=3, **{"checkpoint.keep_last": 1, "checkpoint.prune": "weights"})
    root = Path(cfg.run_root)
    real_update, real_load = update_stage.ppo_update, strategy_lib.load_optimizer_state
    calls, loaded = {"n": 0}, []

    def failing_third_time(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault in iteration 3's update")
        return real_update(*a, **kw)

    def spy_load(opt, ckpt_dir, **kw):
        ok = real_load(opt, ckpt_dir, **kw)
        loaded.append((ckpt_dir, ok))
        return ok

    monkeypatch.setattr(update_stage, "ppo_update", failing_third_time)
    monkeypatch.setattr(strategy_lib, "load_optimizer_state", spy_load)
    with pytest.raises(RuntimeError, match="injected fault"):
        train(cfg)
    it = {i: root / f"iter={i:06d}" / "ppo_update" for i in (1, 2, 3)}
    opt = {i: root / f"iter={i:06d}" / "ppo_update-optimizer" for i in (1, 2, 3)}
    # iteration 2 committed, so iteration 1 was pruned; iteration 2 (needed by 3) is whole
    assert sorted(pruned_files(str(it[1]))) == ["policy/model.safetensors"]
    assert pruned_files(str(opt[1])) == {"optimizer.pt": "checkpoint.keep_last=1 (prune=weights) after iteration 2"}
    assert not (opt[1] / "optimizer.pt").exists() and (it[1] / "policy/config.json").exists()
    assert (opt[2] / "optimizer.pt").exists() and pruned_files(str(it[2])) == {} and pruned_files(str(opt[2])) == {}

    loaded.clear()
    result = train(cfg)  # resume: iteration 3's update starts from iteration 2's optimizer state
    assert loaded == [(str(opt[2]), True)]
    assert sorted(pruned_files(str(it[2]))) == ["policy/model.safetensors"] and list(pruned_files(str(opt[2]))) == ["optimizer.pt"]
    assert (it[3] / "policy/model.safetensors").exists() and (opt[3] / "optimizer.pt").exists()
    assert result.final_policy.uri == str(it[3])
    assert read_shard(f"{it[1]}").num_rows == 1  # the pruned stages' metrics still read and verify

    n = calls["n"]
    again = train(cfg)  # a finished run resumes without loading any pruned checkpoint
    assert calls["n"] == n and [m["iteration"] for m in again.metrics] == [1, 2, 3]
    assert again.final_policy == result.final_policy

    from rft_core.inspect import run_status

    status = {(r["iteration"], r["stage"]): r for r in run_status(cfg.run_root)}
    assert [status[(i, "ppo_update")]["status"] for i in (1, 2, 3)] == ["committed (pruned)"] * 2 + ["committed"]
    assert [status[(i, "ppo_update-optimizer")]["status"] for i in (1, 2, 3)] == ["committed (pruned)"] * 2 + ["committed"]
    on_disk = sum(f.stat().st_size for f in it[1].rglob("*") if f.is_file() and not f.name.startswith("_"))
    assert status[(1, "ppo_update")]["bytes"] == on_disk  # what is left, not what the manifest listed
    gone = (it[3] / "policy" / "model.safetensors").stat().st_size
    assert status[(3, "ppo_update")]["bytes"] - status[(1, "ppo_update")]["bytes"] == pytest.approx(gone, rel=0.01)
