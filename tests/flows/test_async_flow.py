"""Asynchronous RL on a fixed staleness schedule (issue 28, ``rollout.max_staleness``): with
s = 1 the rollout of iteration k samples with the policy of iteration k-2's update and runs
while iteration k-1's update trains; two fresh runs end with the same weights bit for bit; every
rollout row records its policy version. The rewards vary inside each group (``tests/varying.py``):
each equality test first asserts non-zero advantages and a policy gradient in every iteration it compares."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from schemas import read_manifest, read_shard, stage_uri
from tests.flows.conftest import flow_cfg
from tests.varying import REWARD, assert_training_signal
from tests.weights import iteration_policy_files


def _weights(run_root) -> dict[str, str]:
    return iteration_policy_files(run_root, 3)


def _window(uri: str) -> tuple[float, float]:
    m, _ = read_manifest(uri)
    end = dt.datetime.fromisoformat(m.created_at).timestamp()
    return end - float(m.summary["seconds"]) - float(m.summary.get("checkpoint_seconds", 0.0)), end


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_staleness_1_is_reproducible_and_records_versions(prefect_harness, tiny_model, tmp_path, monkeypatch):
    import flows.fanout
    from flows.train import train

    extra = {"iterations": 3, "rollout.max_staleness": 1, **REWARD}
    own_rollouts, rollout_task = [], flows.fanout.rollout  # the iterations' own calls of the rollout
    monkeypatch.setattr(flows.fanout, "rollout",
                        lambda *, inp, **kw: own_rollouts.append(inp.iteration) or rollout_task(inp=inp, **kw))
    a = train(flow_cfg(tiny_model, tmp_path / "a", **extra))
    assert own_rollouts == [1]  # 2 and 3 took the rollouts prefetched beside the updates (IterationResult.ahead_stages)
    assert_training_signal(tmp_path / "a", (1, 2, 3))
    b = train(flow_cfg(tiny_model, tmp_path / "b", **extra))
    assert _weights(tmp_path / "a") == _weights(tmp_path / "b") and _weights(tmp_path / "a")
    root = str(tmp_path / "a")
    versions = [set(read_shard(stage_uri(root, k, "rollout"), stage="rollout").column("policy_version").to_pylist())
                for k in (1, 2, 3)]
    assert versions == [{0}, {0}, {1}]  # max(0, k - 2)
    assert [m["staleness"] for m in a.metrics] == [0, 1, 1] and [m["policy_version"] for m in a.metrics] == [0, 0, 1]
    assert [read_manifest(stage_uri(root, k, "ppo_update"))[0].summary["policy_version"] for k in (1, 2, 3)] == [0, 1, 2]
    rollout3, _ = read_manifest(stage_uri(root, 3, "rollout"))
    assert rollout3.inputs["policy"] == read_manifest(stage_uri(root, 1, "ppo_update"))[1]  # its manifest checksum
    for m in a.metrics[1:]:  # stale rows are corrected: the behaviour weights and the behaviour-proximal KL
        assert 0 < m["rollout_is_weight_mean"] <= m["rollout_is_weight_max"] <= 2.0 and "rollout_kl" in m
    # iteration 2's actor pass scored its rollout (sampled by version 0) with version 1, the proximal policy that
    # iteration 2's update starts from: its old_logprobs are version 1's log-probs, not the rollout's own
    from rft_core.models.loading import load_causal_lm
    from rft_core.models.logprobs import batched_response_logprobs
    from tests.weights import iteration_policy_folder

    rows = read_shard(stage_uri(root, 2, "rollout"), stage="rollout").to_pydict()
    actor = read_shard(stage_uri(root, 2, "actor_logprobs"), stage="actor_logprobs").to_pydict()
    old = dict(zip(actor["sample_id"], actor["old_logprobs"]))
    version_1 = batched_response_logprobs(load_causal_lm(str(iteration_policy_folder(root, 1))), rows["prompt_token_ids"],
                                          rows["response_token_ids"], pad_token_id=2)
    gaps = [(abs(a - b), abs(a - c)) for sid, mine, behaviour in zip(rows["sample_id"], version_1, rows["rollout_logprobs"])
            for a, b, c in zip(mine, old[sid], behaviour)]
    assert max(g[0] for g in gaps) < 1e-5 and max(g[1] for g in gaps) > 1e-4, (max(gaps), max(g[1] for g in gaps))
    # the rollout of iteration k+1 ran while the update of iteration k trained (submitted before it)
    r2, u1 = _window(stage_uri(root, 2, "rollout")), _window(stage_uri(root, 1, "ppo_update"))
    assert r2[0] < u1[1], (r2, u1)
    # the replay flow reproduces the asynchronous run's updates from its shards, bit for bit
    from flows.replay import replay

    replayed = replay(root, flow_cfg(tiny_model, tmp_path / "replay", **extra))
    assert _weights(tmp_path / "replay") == _weights(tmp_path / "a")
    assert [m["policy_loss"] for m in replayed.metrics] == [m["policy_loss"] for m in a.metrics]
    # resident workers (checkpoint every 3): the rollout worker samples iteration k+1 with version k-1 while the
    # trainer trains iteration k, in two processes; the same weights
    pytest.importorskip("ray")
    train(flow_cfg(tiny_model, tmp_path / "resident", **extra, **{"orchestration.workers": "resident",
                                                                  "checkpoint.every": 3}))
    assert _weights(tmp_path / "resident") == _weights(tmp_path / "a")


@pytest.mark.rotation(6)  # long: one turn in 8 (tests/rotation.py)
def test_retention_keeps_what_a_stale_rollout_samples_with(prefect_harness, tiny_model, tmp_path):
    """rollout.max_staleness=2 with checkpoint.keep_weights_last=1: the rollout of iteration i + 1,
    prefetched during iteration i, samples with version i - 2, which the retention pass of
    iteration i - 1 would have pruned (the run failed with CheckpointPrunedError in iteration 3,
    2026-12-01); the flow's retention keeps the versions the next rollouts sample with
    (``staleness_floor``), so 5 iterations finish, and what no rollout needs any more is pruned."""
    from flows.train import train
    from schemas import pruned_files
    from tests.weights import iteration_policy_folder

    cfg = flow_cfg(tiny_model, tmp_path, iterations=5, **REWARD, **{
        "rollout.max_staleness": 2, "checkpoint.keep_weights_last": 1, "checkpoint.keep_weights_every": None})
    train(cfg)
    for it in (1, 2):  # versions no later rollout samples with: their weights went
        pruned = pruned_files(f"{stage_uri(str(tmp_path), it, 'ppo_update')}-policy")
        assert "policy/model.safetensors" in pruned, (it, pruned)
    for it in (3, 4, 5):  # versions 3-5 are what the rollouts of iterations 6-8 would sample with (a longer run)
        assert (iteration_policy_folder(tmp_path, it) / "model.safetensors").exists()


def test_staleness_0_records_the_previous_iteration_as_the_version(prefect_harness, tiny_model, tmp_path):
    from flows.train import train

    train(flow_cfg(tiny_model, tmp_path, iterations=2))
    for k in (1, 2):
        col = read_shard(stage_uri(str(tmp_path), k, "rollout"), stage="rollout").column("policy_version").to_pylist()
        assert set(col) == {k - 1}
    assert json.loads(Path(stage_uri(str(tmp_path), 2, "rollout"), "_MANIFEST.json").read_text())["summary"][
        "staleness"] == 0


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_staleness_2_resident_keeps_two_versions_and_equals_stage_mode(prefect_harness, tiny_model, tmp_path):
    """s = 2 with resident workers: the rollout worker keeps a copy of each of the last two policy
    versions (the rollout of iteration k samples with version k-3 while the actor pass of
    iteration k-1 needs version k-2); the weights and every rollout equal stage mode's, and no
    version is synced twice."""
    pytest.importorskip("ray")
    from flows.train import train

    extra = {"iterations": 4, "rollout.max_staleness": 2, **REWARD}
    train(flow_cfg(tiny_model, tmp_path / "stage", **extra))
    assert_training_signal(tmp_path / "stage", (1, 2, 3, 4))
    res = train(flow_cfg(tiny_model, tmp_path / "resident", **extra, **{"orchestration.workers": "resident",
                                                                        "checkpoint.every": 4}))
    for run in ("stage", "resident"):
        versions = [set(read_shard(stage_uri(str(tmp_path / run), k, "rollout"), stage="rollout")
                        .column("policy_version").to_pylist()) for k in (1, 2, 3, 4)]
        assert versions == [{0}, {0}, {0}, {1}]  # max(0, k - 3)
    last = lambda run: iteration_policy_files(tmp_path / run, 4)  # noqa: E731
    assert last("resident") == last("stage") and last("stage")
    for k in (1, 2, 3, 4):
        parts = [{e.path: e.checksum for e in read_manifest(stage_uri(str(tmp_path / run), k, "rollout"))[0].files}
                 for run in ("stage", "resident")]
        assert parts[0] == parts[1], k
    # versions 1, 2 and 3 reached the rollout worker once each (the actor passes of iterations 2-4)
    assert res.metrics[-1]["run/weight_syncs"] == 3
