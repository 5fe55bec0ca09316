"""Multi-turn agentic RL through the flows (issue 20): two iterations of GRPO with the tiny model
and the calculator (every model turn read as a call, since the tiny model writes gibberish),
then a resume that reuses every stage, then a replay of the multi-turn run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rft_core.agents import StepResult
from rft_core.agents.calculator import CalculatorEnv
from rft_core.agents.view import render_trajectory, segments
from rft_core.api import sample_transcript
from rft_core.models.loading import load_tokenizer
from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg

ENV = "tests.flows.test_agent_flow:ScriptedCalculator"


class ScriptedCalculator(CalculatorEnv):
    """The built-in calculator with a scripted stand-in for the model's calls: every turn is the
    call ``<calc>{len(turn text)} * 7</calc>`` (answered by the real calculator), turns end at
    the first printable ASCII character, the reset shows a first observation, and each step
    rewards len(text) % 2 (a reward spread for GRPO)."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.stop_strings = tuple(chr(c) for c in range(33, 127))

    def reset(self, prompt):
        super().reset(prompt)
        return f"Question {prompt['prompt_id']}: use the calculator."

    def step(self, text):
        r = super().step(f"<calc>{len(text)} * 7</calc>")
        return StepResult(r.observation, float(len(text) % 2), False, r.info)


def agent_cfg(tiny_model, root, **extra):
    return flow_cfg(tiny_model, root, **{
        "rollout.agent": {"environment": ENV, "max_turns": 3, "max_total_tokens": 64},
        "reward.sources": {"correct": {"type": "math_answer"}, "env": {"type": "environment"}},
        "reward.recipes": {"default": [{"source": "correct", "weight": 1.0}, {"source": "env", "weight": 0.5}]},
        "reward.default_recipe": "default", **extra})


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in root.rglob("*") if p.is_file() and str(p.relative_to(root)).startswith("iter=")}


def _check_iteration(run_root: str, i: int, tok) -> None:
    it = f"{run_root}/iter={i:06d}"
    rows = read_shard(f"{it}/rollout", stage="rollout").to_pylist()
    assert len(rows) == 12  # 3 prompts x 4 samples
    for r in rows:
        mask = r["action_mask"]
        assert r["num_turns"] == 3 and r["finish_reason"] == "max_turns"
        assert [c["turn"] for c in r["tool_calls"]] == [1, 2, 3]
        assert all(c["name"] == "calculator" and c["observation"] is not None for c in r["tool_calls"])
        assert [m for m, _, _ in segments(mask)] == [True, False, True, False, True]  # observation tokens: False
        assert all(lp == 0.0 for lp, m in zip(r["rollout_logprobs"], mask) if not m)
    # advantages: one per response token, zero on observation tokens, the sample's GRPO advantage on model tokens
    adv = {a["sample_id"]: a for a in read_shard(f"{it}/advantages", stage="advantages").to_pylist()}
    rewards = {w["sample_id"]: w for w in read_shard(f"{it}/rewards", stage="rewards").to_pylist()}
    for r in rows:
        a, mask = adv[r["sample_id"]]["advantages"], r["action_mask"]
        assert len(a) == len(mask)
        assert all(x == 0.0 for x, m in zip(a, mask) if not m)
        assert len({x for x, m in zip(a, mask) if m}) == 1
        metrics = dict(rewards[r["sample_id"]]["reward_metrics"])
        assert metrics["env"] == r["env_reward"] and metrics["env.fallback"] == 0.0
        assert rewards[r["sample_id"]]["rewards"] == metrics["correct"] + 0.5 * r["env_reward"]
    # the update's statistics count the model's tokens only (one optimizer step over the rollout)
    steps = read_shard(f"{it}/ppo_update", stage="ppo_update").to_pylist()
    assert [s["num_tokens"] for s in steps] == [sum(sum(r["action_mask"]) for r in rows)]
    # a trajectory, turn by turn
    text = render_trajectory(rows[0], tokenizer=tok)
    assert text.count("--- model turn") == 3 and text.count("--- observation") == 2 and "calculator(" in text


@pytest.mark.rotation(1)  # long: one turn in 8 (tests/rotation.py)
def test_agent_run_two_iterations_resume_and_replay(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from flows.replay import replay
    from flows.train import train

    tok = load_tokenizer(tiny_model)
    cfg = agent_cfg(tiny_model, tmp_path / "run")
    result = train(cfg)
    for i in (1, 2):
        _check_iteration(cfg.run_root, i, tok)
    lines = [json.loads(x) for x in Path(cfg.run_root, "metrics.jsonl").read_text().splitlines()]
    assert [(m["iteration"], m["num_turns"], m["tool_call_rate"]) for m in lines] == [(1, 3.0, 1.0), (2, 3.0, 1.0)]
    assert all(m["model_tokens"] < m["response_length"] for m in lines)
    summary = read_manifest(f"{cfg.run_root}/iter=000001/rollout")[0].summary
    assert summary["environment"] == ENV
    shown = sample_transcript(cfg.run_root, 1, "%s#0" % read_shard(f"{cfg.run_root}/iter=000001/prompts").column("prompt_id")[0].as_py())
    assert "--- model turn 3" in shown and "reward " in shown and "question: " in shown

    # the same training again: every committed stage is reused, nothing is written
    before = _snapshot(Path(cfg.run_root))
    again = train(cfg)
    assert again.final_policy == result.final_policy
    assert _snapshot(Path(cfg.run_root)) == before

    # a replay of the multi-turn run with another estimator: reads the rollouts with their new columns
    rloo = agent_cfg(tiny_model, tmp_path / "replay", **{"advantage.estimator": "rloo"})
    replayed = replay(cfg.run_root, rloo)
    assert [m["num_turns"] for m in replayed.metrics] == [3.0, 3.0]
    for i in (1, 2):
        rows = read_shard(f"{cfg.run_root}/iter={i:06d}/rollout", stage="rollout").to_pylist()
        adv = {a["sample_id"]: a["advantages"] for a in
               read_shard(f"{rloo.run_root}/iter={i:06d}/advantages", stage="advantages").to_pylist()}
        for r in rows:
            assert len(adv[r["sample_id"]]) == len(r["action_mask"])
            assert all(x == 0.0 for x, m in zip(adv[r["sample_id"]], r["action_mask"]) if not m)
    assert sorted(os.listdir(Path(rloo.run_root, "iter=000001"))) == ["advantages", "ppo_update", "ppo_update-optimizer",
                                                                       "ppo_update-policy"]
