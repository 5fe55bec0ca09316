"""The Prefect flows end to end on a tiny random model: two iterations, every stage committed
and valid, the policy changed; then a crash in the update and a resume that reuses the
committed stages without touching their files."""
from __future__ import annotations

import gc
import hashlib
import json
import zlib
from pathlib import Path

import pytest
import torch

from rft_core.models.loading import load_causal_lm
from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg
from tests.weights import iteration_policy_folder

STAGES = ["prompts", "rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update"]


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_iterations_every_stage_valid(prefect_harness, tiny_model, tmp_path, fake_rewards, monkeypatch):
    import logging

    import prefect.flow_engine

    import flows.iteration
    import flows.train
    from flows.train import train

    heartbeats, send = [], prefect.flow_engine._send_heartbeats  # what each flow run's engine was set to send

    def recording(engine, *args, **kwargs):
        heartbeats.append((engine.flow.name, engine.heartbeat_seconds))
        return send(engine, *args, **kwargs)

    monkeypatch.setattr(prefect.flow_engine, "_send_heartbeats", recording)
    frozen, freeze = [], flows.train.freeze_grown_heap  # what each iteration's end froze (rft_core/heap.py)
    monkeypatch.setattr(flows.train, "freeze_grown_heap", lambda: frozen.append((freeze(), gc.get_freeze_count())))
    own_prompts, prompts_task = [], flows.iteration._prompts
    monkeypatch.setattr(flows.iteration, "_prompts",
                        lambda cfg, iteration, *a, **k: own_prompts.append(iteration) or prompts_task(cfg, iteration, *a, **k))
    cfg = flow_cfg(tiny_model, tmp_path / "run")
    said: list[str] = []  # what the stages log (Prefect's logging setup keeps it from pytest's caplog)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("rft_core.stages").addHandler(handler)
    try:
        result = train(cfg)
    finally:
        logging.getLogger("rft_core.stages").removeHandler(handler)
    assert [m["iteration"] for m in result.metrics] == [1, 2]
    # iteration 2's prompts ran beside iteration 1's update (flows/iteration.py's _prompts_ahead): committed after
    # iteration 1's advantages, and iteration 2 took them as they were (IterationResult.ahead_stages): no task run of
    # it found them committed, which would log "reusing committed shard"
    created = {(it, s): read_manifest(f"{cfg.run_root}/iter={it:06d}/{s}")[0].created_at
               for it, s in ((1, "advantages"), (2, "prompts"), (2, "rollout"))}
    assert created[(1, "advantages")] < created[(2, "prompts")] < created[(2, "rollout")]
    assert [m for m in said if "reusing committed shard" in m] == []
    assert own_prompts == [1]  # the iterations' own calls of the prompts task
    # the training flow sends heartbeats (Prefect's default every 180 s); its iterations none (flows/train.py)
    assert heartbeats == [("rft-train", 180), ("rl-iteration", None), ("rl-iteration", None)]
    # the first iteration's end froze this process's heap (torch, transformers, Prefect: over 100,000 objects), which
    # stayed frozen through the second; the run's end thawed it
    assert frozen[0][0] > 100_000 and frozen[1][1] > 100_000, frozen
    assert gc.get_freeze_count() == 0
    for it in (1, 2):
        for stage in STAGES:
            uri = f"{cfg.run_root}/iter={it:06d}/{stage}"
            table = read_shard(uri)  # validates manifest, checksums and schema
            manifest, _ = read_manifest(uri)
            assert table.num_rows == manifest.num_rows
        n = read_shard(f"{cfg.run_root}/iter={it:06d}/rollout").num_rows
        assert n == 3 * 4
    # prompts differ between iterations, samples are grouped by prompt
    p1 = read_shard(f"{cfg.run_root}/iter=000001/prompts").column("prompt_id").to_pylist()
    p2 = read_shard(f"{cfg.run_root}/iter=000002/prompts").column("prompt_id").to_pylist()
    assert len(set(p1)) == 3 and set(p1) != set(p2)
    # advantages sum to ~0 within each group (GRPO) and rewards had a spread
    adv = read_shard(f"{cfg.run_root}/iter=000001/advantages").to_pandas()
    firsts = adv.advantages.map(lambda a: a[0] if len(a) else 0.0)
    assert firsts.groupby(adv.prompt_id).sum().abs().max() < 1e-4
    # the policy changed, and iteration 2 started from iteration 1's checkpoint
    init = torch.cat([p.flatten() for p in load_causal_lm(tiny_model).parameters()])
    final = torch.cat([p.flatten() for p in load_causal_lm(result.final_policy_folder).parameters()])
    assert not torch.equal(init, final)
    m2, _ = read_manifest(f"{cfg.run_root}/iter=000002/rollout")
    upd1, _ = read_manifest(f"{cfg.run_root}/iter=000001/ppo_update")
    # the AdamW state is its own stage, written in the background and committed after the update
    opt1, _ = read_manifest(f"{cfg.run_root}/iter=000001/ppo_update-optimizer")
    assert [f.path for f in opt1.files] == ["optimizer.pt"] and opt1.stage == "optimizer_state"
    assert not (iteration_policy_folder(cfg.run_root, 1) / "optimizer.pt").exists()
    upd2, _ = read_manifest(f"{cfg.run_root}/iter=000002/ppo_update")
    assert upd2.inputs["optimizer"] == read_manifest(f"{cfg.run_root}/iter=000001/ppo_update-optimizer")[1]
    assert opt1.inputs == {"ppo_update": read_manifest(f"{cfg.run_root}/iter=000001/ppo_update")[1]}
    assert read_manifest(f"{cfg.run_root}/iter=000002/ppo_update-optimizer")[0].num_rows == 0  # committed before train() returned
    assert upd1.num_rows == 1
    lines = Path(cfg.run_root, "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [1, 2]
    assert {"reward_mean", "accuracy", "kl", "response_length", "policy_loss", "clip_frac", "seconds/rollout"} <= set(json.loads(lines[0]))


def test_default_skips_the_actor_stage_when_the_engine_log_probs_are_pi_old(prefect_harness, tiny_model, tmp_path,
                                                                           fake_rewards):
    """``recompute_old_logprobs: auto`` (the default) on the hf engine in float32 with one optimizer
    step: no actor stage, the update trains against the rollout's log-probs, and its first step
    measures them against the policy's own forward pass (equal to float32 rounding)."""
    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{"logprobs.recompute_old_logprobs": "auto"})
    assert cfg.logprobs.recompute_old_logprobs == "auto" and not cfg.recomputes_old_logprobs
    train(cfg)
    it = Path(cfg.run_root, "iter=000001")
    assert not (it / "actor_logprobs").exists()
    upd, _ = read_manifest(str(it / "ppo_update"))
    assert "actor_logprobs" not in upd.inputs and "ref_logprobs" in upd.inputs
    assert 0.0 <= upd.summary["old_logprobs_gap_kl"] < 1e-10  # 0.5 * mean((logp - engine logp)^2)
    assert upd.summary["optimizer_steps"] == 1


def test_a_failed_scoring_stage_lets_its_siblings_commit_before_the_flow_fails(prefect_harness, tiny_model, tmp_path,
                                                                               fake_rewards, monkeypatch):
    """The stages that read only the rollout run together (``flows/iteration.py``'s ``_score``).
    When one fails (the reference pass: its model folder is missing, so it fails at once) the flow
    waits for the others before it raises: they commit, and a retry reuses them. Here the rewards
    task starts late (its engine's ``begin_run`` held 2 s, as a loaded machine or a concurrency
    slot can hold it); a flow that raised at once would leave Prefect's task runner to cancel it
    before it executes (``ThreadPoolTaskRunner.__exit__``: ``CancelledError``), as
    tests/flows/test_deployment.py saw on 2026-11-30."""
    import time

    import prefect.task_engine

    from rft_core.models.hub import ModelLoadError
    from flows.train import train

    begin = prefect.task_engine.SyncTaskRunEngine.begin_run

    def late_rewards(engine):
        if engine.task.name == "rewards":
            time.sleep(2.0)
        return begin(engine)

    monkeypatch.setattr(prefect.task_engine.SyncTaskRunEngine, "begin_run", late_rewards)
    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{"reference.path": str(tmp_path / "missing"),
                                                                   "logprobs.recompute_old_logprobs": False})
    with pytest.raises(ModelLoadError, match="missing"):
        train(cfg)
    committed = {s: (tmp_path / "run" / "iter=000001" / s / "_MANIFEST.json").exists()
                 for s in ("rollout", "ref_logprobs", "rewards")}
    assert committed == {"rollout": True, "ref_logprobs": False, "rewards": True}, committed


def test_crash_in_update_then_resume_reuses_committed_stages(prefect_harness, tiny_model, tmp_path, fake_rewards, monkeypatch):
    from flows.train import train
    from rft_core.stages.writer import wait_for_optimizer_writes
    from rft_core.stages import update as update_stage

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=2, **{"checkpoint.keep_last": None})
    real = update_stage.ppo_update
    calls = {"n": 0}

    def failing_second_time(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault in iteration 2's update")
        return real(*a, **kw)

    monkeypatch.setattr(update_stage, "ppo_update", failing_second_time)
    with pytest.raises(RuntimeError, match="injected fault"):
        train(cfg)
    wait_for_optimizer_writes()  # iteration 1's background checkpoint, as this process's exit would
    root = Path(cfg.run_root)
    assert not (root / "iter=000002/ppo_update/_MANIFEST.json").exists()
    before = _snapshot(root)
    assert "iter=000002/advantages/_MANIFEST.json" in before

    calls_before = calls["n"]
    result = train(cfg)  # the same training again: resumes
    assert calls["n"] == calls_before + 1  # only iteration 2's update ran again
    after = _snapshot(root)
    # every stage file (derived views such as metrics.jsonl and tensorboard/ are rewritten by design)
    committed = {k: v for k, v in before.items() if k.startswith("iter=") and not k.startswith("iter=000002/ppo_update")}
    changed = [k for k, v in committed.items() if after.get(k) != v]
    assert changed == []  # every committed file untouched (same mtime and checksum)
    assert read_shard(f"{cfg.run_root}/iter=000002/ppo_update").num_rows == 1
    assert [m["iteration"] for m in result.metrics] == [1, 2]


def test_changed_config_does_not_overwrite_committed_run(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.train import train
    from schemas.shards import StaleShardError

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1)
    train(cfg)
    before = _snapshot(Path(cfg.run_root))
    with pytest.raises(StaleShardError, match="Use a new run root"):
        train(flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{"rollout.temperature": 0.5}))
    after = _snapshot(Path(cfg.run_root))
    assert {k: v for k, v in after.items() if k.startswith("iter=")} == {k: v for k, v in before.items() if k.startswith("iter=")}


def steps_tokens(result) -> int:
    return sum(row["num_tokens"] for row in read_shard(result.final_policy.uri).to_pylist())


@pytest.mark.parametrize("estimator, extra", [
    ("dr_grpo", {"update.loss_agg": "seq-mean-token-sum-norm"}),
    ("rloo", {"update.policy_loss.name": "dual_clip"}),
    ("reinforce", {"update.entropy_top_fraction": 0.2, "update.entropy_coef": 0.01}),
    ("cpgd", {"update.policy_loss.name": "cpgd", "shaping.clip_filter_like_weight": True}),
    ("reinforce_baseline", {"update.policy_loss.name": "gspo", "update.loss_agg": "seq-mean-token-mean"}),
])
@pytest.mark.rotation(0)  # long: one turn in 8 (tests/rotation.py)
def test_each_estimator_runs_one_iteration_in_the_flow(prefect_harness, tiny_model, tmp_path, fake_rewards, estimator, extra):
    import numpy as np

    from flows.train import train

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{"advantage.estimator": estimator, **extra})
    result = train(cfg)
    adv = read_shard(f"{cfg.run_root}/iter=000001/advantages").to_pandas()
    rewards = read_shard(f"{cfg.run_root}/iter=000001/rewards").to_pandas()
    flat = np.concatenate([np.asarray(a) for a in adv.advantages])
    assert np.isfinite(flat).all() and np.abs(flat).max() > 0
    if "update.entropy_top_fraction" in extra:  # ~20% of the response tokens were trained on
        assert steps_tokens(result) <= 0.2 * sum(len(a) for a in adv.advantages) + len(adv)
    if estimator in ("dr_grpo", "rloo", "cpgd"):  # outcome estimators: zero-sum within each group
        firsts = adv.advantages.map(lambda a: a[0])
        assert firsts.groupby(adv.prompt_id).sum().abs().max() < 1e-5
    else:  # batch-whitened token advantages: mean 0 over all response tokens
        assert abs(flat.mean()) < 1e-4
    assert rewards.rewards.nunique() > 1
    if "shaping.clip_filter_like_weight" in extra:
        assert result.metrics[0]["clip_filter_like_weight_mean"] > 0
    actor = read_shard(f"{cfg.run_root}/iter=000001/actor_logprobs").to_pandas()
    assert all(len(e) == len(o) and min(e) >= 0 for e, o in zip(actor.action_entropy, actor.old_logprobs))
    assert result.metrics[0]["entropy"] > 0
    steps = read_shard(f"{result.final_policy.uri}").to_pylist()
    assert len(steps) == 1 and np.isfinite(steps[0]["policy_loss"]) and steps[0]["grad_norm"] > 0


def result_state(cfg):
    from rft_core.config import TrainState

    return TrainState.model_validate(read_manifest(f"{cfg.run_root}/iter=000002/advantages")[0].summary["next_state"])


def test_state_kl_coefficient_and_reward_statistics_carry_across_iterations(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.train import train
    from rft_core.algorithms.kl import next_kl_coef

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=2, **{"kl.controller": "adaptive", "kl.target": 1e-6,
                                                              "kl.horizon": 24, "update.lr": 1e-2,
                                                              "shaping.reward_running_norm": True})
    result = train(cfg)
    m = result.metrics
    # the running reward statistics cover both iterations' 12 + 12 rewards
    assert result_state(cfg).reward_count == 24
    assert m[0]["kl_coef"] == 0.05 and m[0]["kl"] == 0.0  # policy == reference in iteration 1
    assert m[0]["next_kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 12 / 24))  # KL 0 < target: error -0.2
    assert m[1]["kl_coef"] == pytest.approx(m[0]["next_kl_coef"])  # iteration 2 used it
    # the policy moved away from the reference (k1 is unbiased but signed: a sampled estimate
    # of a small KL can come out negative; it is exactly 0 only while policy == reference)
    assert abs(m[1]["kl"]) > 1e-6
    assert m[1]["next_kl_coef"] == pytest.approx(next_kl_coef(m[1]["kl_coef"], m[1]["kl"], controller="adaptive",
                                                              target=1e-6, horizon=24, n_steps=12))


def test_ppo_with_critic_gae_two_iterations(prefect_harness, tiny_model, tmp_path, fake_rewards):
    import numpy as np

    from flows.train import train
    from rft_core.models.critic import load_critic

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=2, **{"advantage.estimator": "gae", "advantage.gae_lambda": 0.9,
                                                              "critic.lr": 1e-2})
    result = train(cfg)
    root = cfg.run_root
    for it in (1, 2):
        for stage in ("critic_values", "critic_update"):
            read_shard(f"{root}/iter={it:06d}/{stage}")  # committed and valid
    v1 = read_shard(f"{root}/iter=000001/critic_values").to_pandas()
    assert all(x == 0.0 for row in v1["values"] for x in row)  # a fresh critic's value head is zero
    adv = read_shard(f"{root}/iter=000001/advantages").to_pandas()
    shaped = adv.set_index("sample_id").shaped_rewards
    # V = 0 and KL = 0 (policy == reference) in iteration 1: the last token's return is the reward
    last_ret = adv.returns.map(lambda r: r[-1])
    np.testing.assert_allclose(last_ret.to_numpy(), shaped.loc[adv.sample_id].to_numpy(), atol=1e-5)
    # iteration 2 reads the critic trained in iteration 1 (values no longer all zero) and records it
    v2 = read_shard(f"{root}/iter=000002/critic_values").to_pandas()
    assert any(abs(x) > 1e-6 for row in v2["values"] for x in row)
    upd2, _ = read_manifest(f"{root}/iter=000002/critic_update")
    _, sha1 = read_manifest(f"{root}/iter=000001/critic_update")
    assert upd2.inputs["critic"] == sha1
    assert result.final_critic is not None and result.metrics[1]["value_loss"] > 0
    load_critic(f"{result.final_critic.uri}/critic")  # the final critic checkpoint loads


def test_dynamic_sampling_keeps_only_groups_with_signal(prefect_harness, tiny_model, tmp_path, monkeypatch):
    import numpy as np

    from flows.train import train
    from rft_core.rewards.math import RewardResult

    def score(text, **kw):  # a prompt's group has spread only for some prompts: reward by prompt parity
        r = float(zlib.crc32(kw["question"].encode()) % 2) * float(zlib.crc32(text.encode()) % 2)
        return RewardResult(r, r >= 1.0, None, {"correctness": r, "format": 0.0})

    monkeypatch.setattr("rft_core.rewards.math.score_response", score)
    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1, **{"dynamic_sampling.enabled": True,
                                                              "dynamic_sampling.max_refills": 3})
    result = train(cfg)
    m = result.metrics[0]
    root = Path(cfg.run_root) / "iter=000001"
    tries = sorted(p.name for p in root.iterdir() if p.name.startswith("rewards-try"))
    assert len(tries) == m["dynamic_refills"] + 1 >= 1
    rewards = read_shard(str(root / "rewards")).to_pandas()
    rollout = read_shard(str(root / "rollout")).to_pandas()
    # every kept group has reward spread, and the three merged shards agree
    assert (rewards.groupby("prompt_id").rewards.nunique() > 1).all()
    assert set(rollout.prompt_id) == set(rewards.prompt_id) == set(read_shard(str(root / "prompts")).to_pandas().prompt_id)
    assert m["dynamic_groups_kept"] == rewards.prompt_id.nunique() == 3 - m["dynamic_shortfall"]
    flat = np.concatenate([np.asarray(a) for a in read_shard(str(root / "advantages")).to_pandas().advantages])
    assert np.abs(flat).max() > 0 and read_shard(str(root / "ppo_update")).num_rows == 1


@pytest.mark.rotation(1)  # long: one turn in 8 (tests/rotation.py); the other flow tests: local files, S3 in 3-4
def test_run_on_memory_filesystem(prefect_harness, tiny_model, tmp_path, fake_rewards, monkeypatch):
    """The same training with its run folder on memory:// (checkpoints go through upload and
    a checksum-keyed download cache; stage mode reading every model from storage,
    orchestration.keep_models=false: kept models skip the download)."""
    import fsspec

    from flows.train import train

    monkeypatch.setenv("RFT_CACHE_DIR", str(tmp_path / "cache"))
    root = f"memory://runs/{tmp_path.name}"
    cfg = flow_cfg(tiny_model, root, **{"orchestration.keep_models": False})
    result = train(cfg)
    fs = fsspec.filesystem("memory")
    for it in (1, 2):
        for stage in STAGES:
            read_shard(f"{root}/iter={it:06d}/{stage}")
    assert fs.exists(f"/runs/{tmp_path.name}/iter=000002/ppo_update/policy/model.safetensors")
    assert fs.exists(f"/runs/{tmp_path.name}/metrics.jsonl")
    assert fs.exists(f"/runs/{tmp_path.name}/iter=000002/ppo_update-optimizer/optimizer.pt")
    # iteration 2 loaded iteration 1's checkpoint and optimizer state through the download cache
    cached = sorted((tmp_path / "cache" / "checkpoints").iterdir(), key=lambda p: p.name.rsplit("-", 1)[1])
    assert [p.name.rsplit("-", 1)[1] for p in cached] == ["optimizer_state", "policy"]
    assert (cached[0] / "optimizer.pt").exists() and (cached[1] / "config.json").exists()
    # resume on memory:// reuses everything
    before = {p: fs.info(p)["created"] for p in fs.find(f"/runs/{tmp_path.name}") if p.endswith("_MANIFEST.json")}
    again = train(cfg)
    assert again.final_policy == result.final_policy
    assert {p: fs.info(p)["created"] for p in before} == before


def test_task_retry_reuses_committed_stages(prefect_harness, tiny_model, tmp_path, monkeypatch):
    """A stage that fails once is retried by Prefect (rewards has retries=1); the retry and the
    stages after it run, nothing committed is recomputed."""
    from flows.train import train
    from tests.flows.conftest import _fake_score

    calls = {"n": 0}

    def flaky(text, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("grader unavailable (injected)")
        return _fake_score(text, **kw)

    monkeypatch.setattr("rft_core.rewards.math.score_response", flaky)
    from rft_core.engines.hf import HFEngine

    generate, generations = HFEngine.generate, {"n": 0}

    def counted(self, *args, **kw):
        generations["n"] += 1
        return generate(self, *args, **kw)

    monkeypatch.setattr(HFEngine, "generate", counted)
    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=1)
    train(cfg)
    assert calls["n"] == 1 + 12  # one failed call, then the 12 samples of the retry
    assert generations["n"] == 1  # the rollout ran once: the retry did not regenerate
    assert read_shard(f"{cfg.run_root}/iter=000001/rewards").num_rows == 12
    assert read_shard(f"{cfg.run_root}/iter=000001/ppo_update").num_rows == 1


def test_observability_outputs(prefect_harness, tiny_model, tmp_path, fake_rewards):
    """TensorBoard events hold every iteration once (also after a resume), the curve image and
    the markdown sample artifact exist."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flows.train import train

    import datetime as dt

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=2)
    train(cfg)
    resumed_at = dt.datetime.now(dt.timezone.utc)
    train(cfg)  # a resume rewrites, it does not duplicate

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("reward_mean")]
    assert steps == [1, 2]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000

    async def artifact():
        async with get_client() as client:
            # the newest one: other tests of the session's Prefect server write the same key
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["samples-iter-000001"])),
                                               sort=ArtifactSort.CREATED_DESC)
            return arts[0].data if arts else ""

    import asyncio

    md = asyncio.run(artifact())
    assert "| question | answer | response_text | rewards |" in md and md.count("\n| ") >= 8

    async def curve_versions():
        async with get_client() as client:
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["metrics-curve"])))
            return [a.data.splitlines()[0] for a in arts if cfg.run_root in (a.description or "")]

    # the default observe.curve_every_s (60 s) draws the curve after each call's last iteration only
    assert asyncio.run(curve_versions()) == ["### Metrics over 2 iteration(s)"] * 2

    # the resume's "reusing committed shard" lines (rft_core logger) reach the task run logs
    from prefect.client.schemas.filters import LogFilter, LogFilterName, LogFilterTimestamp
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()

    async def stage_logs():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(name=LogFilterName(any_=["rft_core.stages"]),
                                                               timestamp=LogFilterTimestamp(after_=resumed_at)))

    reused = [lg for lg in asyncio.run(stage_logs()) if "reusing committed shard" in lg.message and str(tmp_path) in lg.message]
    assert {lg.message.split(":")[0] for lg in reused} >= {"prompts", "rollout", "rewards", "ppo_update"}
    assert all(lg.task_run_id is not None for lg in reused)
