"""Checkpoint retention in the flow, with the default settings (optimizer state of the last
iteration only; weights of the last 3 iterations and of every 10th): a crash in iteration 4's
update resumes from iteration 3's kept optimizer state, older checkpoints lose their files,
a finished run resumes again without needing any pruned file, a pruned checkpoint refuses to be
evaluated with a message that names the files, and a replay of the pruned run still works
(shards are never pruned)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from schemas import pruned_files, read_shard
from tests.flows.conftest import flow_cfg


@pytest.mark.rotation(0)  # long: one turn in 8 (tests/rotation.py)
def test_default_retention_prunes_old_checkpoints_and_resume_still_works(prefect_harness, tiny_model, tmp_path,
                                                                         fake_rewards, monkeypatch):
    from flows.train import train
    from rft_core.stages import update as update_stage
    from rft_core.stages.retention import apply_retention
    from rft_core.stages.writer import wait_for_optimizer_writes
    from rft_core.training import strategy as strategy_lib

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=4)
    assert (cfg.checkpoint.keep_last, cfg.checkpoint.prune, cfg.checkpoint.keep_weights_last) == (1, "weights", 3)
    root = Path(cfg.run_root)
    real_update, real_read = update_stage.ppo_update, strategy_lib.read_optimizer_state
    calls, loaded = {"n": 0}, []

    def failing_fourth_time(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected fault in iteration 4's update")
        return real_update(*a, **kw)

    def spy_read(ckpt_dir, *a, **kw):
        state = real_read(ckpt_dir, *a, **kw)
        if ckpt_dir is not None:
            loaded.append((ckpt_dir, state is not None))
        return state

    monkeypatch.setattr(update_stage, "ppo_update", failing_fourth_time)
    monkeypatch.setattr(strategy_lib, "read_optimizer_state", spy_read)
    with pytest.raises(RuntimeError, match="injected fault"):
        train(cfg)
    # the pass after iteration 3 ran while its weights may still have been written in the background
    # (then iteration 2 stayed whole, the checkpoint a resume would start from); once they landed:
    wait_for_optimizer_writes()
    apply_retention(cfg.run_root, 3, cfg.checkpoint)
    it = {i: root / f"iter={i:06d}" / "ppo_update" for i in (1, 2, 3, 4)}
    opt = {i: root / f"iter={i:06d}" / "ppo_update-optimizer" for i in (1, 2, 3, 4)}
    w = {i: root / f"iter={i:06d}" / "ppo_update-policy" for i in (1, 2, 3, 4)}  # the weights, written in the background
    # iteration 3 committed: iterations 1 and 2 lost their optimizer state, every iteration kept its weights
    # (iteration 1's by the pass after iteration 2, or after 3 when iteration 2's weights were still pending)
    assert pruned_files(str(opt[1])) in [{"optimizer.pt": f"checkpoint.keep_last=1 after iteration {n}"}
                                         for n in (2, 3)]
    assert pruned_files(str(opt[2])) == {"optimizer.pt": "checkpoint.keep_last=1 after iteration 3"}
    assert not (opt[1] / "optimizer.pt").exists() and not (opt[2] / "optimizer.pt").exists()
    assert all(pruned_files(str(w[i])) == {} and (w[i] / "policy/model.safetensors").exists() for i in (1, 2, 3))
    assert (opt[3] / "optimizer.pt").exists() and pruned_files(str(opt[3])) == {}

    loaded.clear()
    result = train(cfg)  # resume: iteration 4's update starts from iteration 3's optimizer state
    assert loaded == [(str(opt[3]), True)]
    # after iteration 4: iteration 1 (older than the last 3) lost its weights too
    assert sorted(pruned_files(str(w[1]))) == ["policy/model.safetensors"]
    assert [pruned_files(str(w[i])) for i in (2, 3, 4)] == [{}, {}, {}]
    assert [pruned_files(str(it[i])) for i in (1, 2, 3, 4)] == [{}] * 4  # the updates' own stages hold no weights
    assert list(pruned_files(str(opt[3]))) == ["optimizer.pt"] and (opt[4] / "optimizer.pt").exists()
    assert result.final_policy.uri == str(it[4])
    assert read_shard(f"{it[1]}").num_rows == 1  # the pruned stages' metrics still read and verify

    n = calls["n"]
    again = train(cfg)  # a finished run resumes without loading any pruned checkpoint
    assert calls["n"] == n and [m["iteration"] for m in again.metrics] == [1, 2, 3, 4]
    assert again.final_policy == result.final_policy

    from rft_core.inspect import run_status

    status = {(r["iteration"], r["stage"]): r for r in run_status(cfg.run_root)}
    assert [status[(i, "ppo_update-policy")]["status"] for i in (1, 2, 3, 4)] == ["committed (pruned)"] + ["committed"] * 3
    assert [status[(i, "ppo_update-optimizer")]["status"] for i in (1, 2, 3, 4)] == ["committed (pruned)"] * 3 + ["committed"]
    on_disk = sum(f.stat().st_size for f in w[1].rglob("*") if f.is_file() and not f.name.startswith("_"))
    assert status[(1, "ppo_update-policy")]["bytes"] == on_disk  # what is left, not what the manifest listed
    gone = (w[4] / "policy" / "model.safetensors").stat().st_size
    assert status[(4, "ppo_update-policy")]["bytes"] - status[(1, "ppo_update-policy")]["bytes"] == \
        pytest.approx(gone, rel=0.01)

    # evaluating iteration 1's checkpoint says what is missing and why
    from rft_core.stages.checkpoints import policy_model_path
    from rft_core.stages.retention import CheckpointPrunedError
    from schemas import ShardRef

    with pytest.raises(CheckpointPrunedError, match=r"iter=000001/ppo_update-policy: checkpoint file\(s\) "
                                                    r"policy/model.safetensors were pruned \(checkpoint.prune=weights"):
        policy_model_path(ShardRef.from_manifest(str(it[1])))

    # a replay of the pruned run reads only shards, which are all kept
    from flows.replay import replay

    rcfg = flow_cfg(tiny_model, tmp_path / "replay", iterations=2, **{"advantage.estimator": "rloo"})
    replayed = replay(cfg.run_root, rcfg)
    assert [m["iteration"] for m in replayed.metrics] == [1, 2]


def test_the_last_pass_runs_again_once_the_background_writes_landed(prefect_harness, tiny_model, tmp_path, fake_rewards,
                                                                     monkeypatch):
    """The pass after the run's last iteration ran while that iteration's weights were still being
    written in the background (held back 2 s here), so it kept the iteration before whole (the
    checkpoint a resume would start from); the flow runs it again once the writes have landed, so
    a finished run leaves no optimizer state but the last one (``checkpoint.keep_last=1``)."""
    from flows.train import train
    from rft_core.stages import retention, writer

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=2)
    submit, latest = writer.submit, retention.latest_policy_checkpoint

    def slow_last_weights(uri, fn, *args, **kwargs):
        if uri.rstrip("/").endswith("iter=000002/ppo_update-policy"):
            write = fn

            def fn(*a):
                time.sleep(2.0)
                return write(*a)
        return submit(uri, fn, *args, **kwargs)

    keeps = []

    def spy_latest(run_root, iteration):
        keeps.append((iteration, latest(run_root, iteration)))
        return keeps[-1][1]

    monkeypatch.setattr(writer, "submit", slow_last_weights)
    monkeypatch.setattr(retention, "latest_policy_checkpoint", spy_latest)
    train(cfg)
    assert keeps[1:] == [(2, 1), (2, 2)]  # after iteration 2: its weights pending (kept 1), then landed (kept 2)
    opt = {i: Path(cfg.run_root) / f"iter={i:06d}" / "ppo_update-optimizer" for i in (1, 2)}
    assert pruned_files(str(opt[1])) == {"optimizer.pt": "checkpoint.keep_last=1 after iteration 2"}
    assert pruned_files(str(opt[2])) == {} and (opt[2] / "optimizer.pt").exists()
