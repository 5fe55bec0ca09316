"""An LLM judge in a training run (issue 48): a verdict per sample in the rewards shard, a Prefect
retry that asks the judge nothing, a rerun of the same run root with the judge server stopped
that completes from the stored verdicts, and a replay with the server still stopped."""
from __future__ import annotations

import pytest

from rft_core.rewards.judge import VERDICTS_FOLDER
from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg
from tests.rft_core.rewards.chat_server import ChatServer


def _cfg(tiny_model, root, srv: ChatServer, **extra):
    # 2 prompts x 4 samples; no reference or actor pass (not what this test is about)
    return flow_cfg(tiny_model, root, iterations=1, **{
        "data.prompts_per_iteration": 2, "kl.kl_coef": 0.0, "logprobs.recompute_old_logprobs": "auto",
        "reward.sources": {"judge": {"type": "llm_judge", "base_url": srv.base_url, "model": "judge-7b", "max_retries": 0}},
        "reward.recipes": {"judged": [{"source": "judge", "weight": 1.0}]}, "reward.default_recipe": "judged", **extra})


def test_a_judged_run_stores_its_verdicts_and_reruns_from_them_with_the_server_stopped(prefect_harness, tiny_model,
                                                                                        tmp_path, monkeypatch):
    from flows.replay import replay
    from flows.train import train

    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    srv = ChatServer().start()
    cfg = _cfg(tiny_model, tmp_path / "run", srv)
    killed: list[int] = []

    def kill(table):  # the rewards stage dies after its verdicts, before its commit: in both attempts
        killed.append(table.num_rows)
        raise RuntimeError("killed before the rewards commit")

    try:
        with monkeypatch.context() as m:
            m.setattr("rft_core.stages.rewards.rewards_summary", kill)
            with pytest.raises(RuntimeError, match="killed before the rewards commit"):
                train(cfg)
    finally:
        srv.stop()
    root = tmp_path / "run"
    assert killed == [8, 8]  # Prefect's retry of the task (retries=1) ran it again
    assert not (root / "iter=000001/rewards/_MANIFEST.json").exists()
    asked = len(srv.requests)
    stored = sorted((root / VERDICTS_FOLDER).glob("*/*.json"))
    assert 1 <= asked <= 8 and len(stored) == asked  # one request per distinct response; the retry asked none

    # the same run root, the server stopped: the rewards stage completes from the stored verdicts
    result = train(cfg)
    assert len(srv.requests) == asked
    rewards = f"{cfg.run_root}/iter=000001/rewards"
    rows = read_shard(rewards, stage="rewards").to_pylist()
    responses = {r["sample_id"]: r["response_text"] for r in read_shard(f"{cfg.run_root}/iter=000001/rollout").to_pylist()}
    assert len(rows) == 8
    for row in rows:
        (v,) = row["judge_verdicts"]  # a verdict per sample
        n = len(responses[row["sample_id"]])
        assert v["reply"].endswith(f"Score: {n % 11}") and v["score"] == pytest.approx(n % 11 / 10)
        assert row["rewards"] == pytest.approx(n % 11 / 10, abs=1e-6)  # the recipe: 1.0 x judge
        assert (v["judge_model"], v["endpoint"], v["error"]) == ("judge-7b", srv.base_url, None)
    judge = read_manifest(rewards)[0].summary["reward_sources"]["judge"]
    assert (judge["judge_requests"], judge["judge_stored"]) == (0, asked)
    advantages = read_shard(f"{cfg.run_root}/iter=000001/advantages").column("advantages").to_pylist()
    assert any(abs(a) > 0 for row in advantages for a in row)  # the judge's scores differ within groups
    assert result.metrics[0]["iteration"] == 1

    # rft replay, the server still stopped: the replay reads the rewards shard, never the judge
    out = replay(cfg.run_root, _cfg(tiny_model, tmp_path / "replay", srv, **{"advantage.estimator": "rloo"}))
    assert [m["iteration"] for m in out.metrics] == [1] and len(srv.requests) == asked
