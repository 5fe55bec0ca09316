"""Offline replay: another estimator on a saved run equals a direct run with that estimator;
a replay runs its stages where ``runners`` says, as training does."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from rft_core.stages import writer
from schemas import read_manifest, read_shard, stage_uri
from tests.flows.conftest import flow_cfg
from tests.weights import iteration_policy_files


@pytest.mark.rotation(0)  # long: one turn in 8 (tests/rotation.py)
def test_replay_with_other_estimator_matches_direct_run(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.replay import replay
    from flows.train import train

    grpo = flow_cfg(tiny_model, tmp_path / "grpo", iterations=2)
    train(grpo)
    rloo_direct = flow_cfg(tiny_model, tmp_path / "rloo", iterations=1, **{"advantage.estimator": "rloo"})
    train(rloo_direct)
    rloo_replay = flow_cfg(tiny_model, tmp_path / "replay", iterations=2, **{"advantage.estimator": "rloo", "update.lr": 2e-3})
    result = replay(grpo.run_root, rloo_replay)
    # iteration 1: same rollout (same seeds, same initial policy) -> the replayed advantages are the direct run's
    a = read_shard(f"{rloo_direct.run_root}/iter=000001/advantages").to_pandas().set_index("sample_id")
    b = read_shard(f"{rloo_replay.run_root}/iter=000001/advantages").to_pandas().set_index("sample_id")
    assert list(a.index) == list(b.index)
    assert max(abs(v) for row in a.advantages for v in row) > 0.1  # rewards that vary in a group: a real comparison
    for x, y in zip(a.advantages, b.advantages.loc[a.index]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # nothing was generated: the replay folder holds only the downstream stages
    root = tmp_path / "replay"
    assert sorted(p.name for p in (root / "iter=000001").iterdir()) == ["advantages", "ppo_update", "ppo_update-optimizer",
                                                                        "ppo_update-policy"]
    assert (root / "_REPLAY.json").exists() and (root / "metrics.jsonl").exists()
    assert [m["iteration"] for m in result.metrics] == [1, 2]
    assert read_shard(f"{result.final_policy.uri}").num_rows == 1

    # the same replay with the update in a subprocess (runners.ppo_update): the same commits
    sub = flow_cfg(tiny_model, tmp_path / "replay-sub", iterations=1, runners={"ppo_update": {"mode": "subprocess"}},
                   **{"advantage.estimator": "rloo", "update.lr": 2e-3})
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    task_logger = logging.getLogger("prefect.task_runs")  # the task logger gets the subprocess's output lines
    task_logger.addHandler(handler)
    try:
        replay(grpo.run_root, sub)
    finally:
        task_logger.removeHandler(handler)
    assert any("rft_core.stages: ppo_update committed" in line for line in lines), lines[-10:]
    want, _ = read_manifest(str(root / "iter=000001/ppo_update"))
    got, _ = read_manifest(str(tmp_path / "replay-sub/iter=000001/ppo_update"))
    # same metrics rows and weights, byte for byte (the config hashes differ: each chains its own
    # advantages manifest, whose timestamp differs); in process the weights were written in the
    # background (ppo_update-policy), the subprocess wrote them in its ppo_update
    assert [(f.path, f.checksum) for f in got.files if not f.path.startswith("policy/")] == \
        [(f.path, f.checksum) for f in want.files]
    assert iteration_policy_files(tmp_path / "replay-sub", 1) == iteration_policy_files(root, 1)
    assert any(f.path.startswith("policy/") for f in got.files)


def test_replay_refuses_missing_inputs(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.replay import replay
    from flows.train import train

    src = flow_cfg(tiny_model, tmp_path / "src", iterations=1, **{"kl.kl_coef": 0.0})
    train(src)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        replay(src.run_root, flow_cfg(tiny_model, tmp_path / "r1", iterations=1, **{"kl.kl_coef": 0.1}))
    with pytest.raises(ValueError, match="needs critic values"):
        replay(src.run_root, flow_cfg(tiny_model, tmp_path / "r2", iterations=1, **{"kl.kl_coef": 0.0, "advantage.estimator": "gae"}))
    from schemas import ShardNotCommittedError

    with pytest.raises(ShardNotCommittedError, match="nothing to replay"):
        replay(src.run_root, flow_cfg(tiny_model, tmp_path / "r3", iterations=2, **{"kl.kl_coef": 0.0}))
    # iteration 1 trained and queued its weights' background write; the failed replay returned once it
    # had landed (rft_core.api.release_run), so no write outlives it into tmp_path's removal or the next test
    r3 = stage_uri(str(tmp_path / "r3"), 1, "ppo_update-policy")
    assert writer.pending([r3]) == [] and read_manifest(r3)[0].stage == "policy_checkpoint"


@pytest.mark.rotation(1)  # long: one turn in 8 (tests/rotation.py); test_replay_refuses_missing_inputs runs every time
def test_replay_of_a_run_without_actor_stage_refuses_what_needs_it(prefect_harness, tiny_model, tmp_path, fake_rewards):
    """The default (``recompute_old_logprobs: auto``) skips the actor stage on-policy; a replay
    whose update needs that stage's outputs is refused before it trains, naming the option."""
    from flows.replay import replay
    from flows.train import train

    src = flow_cfg(tiny_model, tmp_path / "src", iterations=1, **{"logprobs.recompute_old_logprobs": "auto"})
    train(src)
    assert not (tmp_path / "src" / "iter=000001" / "actor_logprobs").exists()
    cfg = flow_cfg(tiny_model, tmp_path / "r", iterations=1, **{"update.entropy_top_fraction": 0.2})
    with pytest.raises(ValueError, match="update.entropy_top_fraction need.* the actor stage's old log-probs"):
        replay(src.run_root, cfg)
    assert not (tmp_path / "r" / "iter=000001" / "ppo_update").exists()
