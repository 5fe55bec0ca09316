"""The rollout stage with ``rollout.agent``: one shard row per trajectory with its masks,
log-probs, tool calls and observations; shards that merge into the whole rollout; a VL policy
refused; a user environment's source in the config hash; the summary and the metrics; the
environment reward source through the rewards stage."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from rft_core.agents import StepResult
from rft_core.agents.calculator import CalculatorEnv
from rft_core.agents.view import segments
from rft_core.config import AgentConfig, RewardConfig, RolloutConfig
from rft_core.metrics import format_metrics_line, iteration_metrics
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.rewards.base import RewardError
from rft_core.stages import rewards as rewards_stage
from rft_core.stages import rollout as rollout_stage
from rft_core.stages.contracts import RewardsInput, RolloutInput, RolloutMergeInput
from schemas import StaleShardError, read_manifest, read_shard, write_shard
from schemas.columns import PROMPTS, ROLLOUT, policy_version_column, single_turn_columns

ENV = "tests.rft_core.stages.test_agent_rollout_stage:AnyTextCalculator"
RESET = "You may use the calculator."


class AnyTextCalculator(CalculatorEnv):
    """The real calculator, with every model turn read as a call (the tiny model writes
    gibberish): the call is ``<calc>{len(turn text)} * 7</calc>``; a turn ends at its first
    printable ASCII character (so turns are short); step reward len(text) % 2."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.stop_strings = tuple(chr(c) for c in range(33, 127))

    def reset(self, prompt):
        super().reset(prompt)
        return RESET

    def step(self, text):
        r = super().step(f"<calc>{len(text)} * 7</calc>")
        return StepResult(r.observation, float(len(text) % 2), False, r.info)


def _prompts(tok, root, n: int = 3):
    questions = [f"What is {7 + i} * {3 + i}?" for i in range(n)]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    table = pa.table({"prompt_id": [f"q{i}" for i in range(n)], "data_source": ["basic_arithmetic"] * n,
                      "question": questions, "prompt_text": texts,
                      "prompt_token_ids": [tok(t, add_special_tokens=False)["input_ids"] for t in texts],
                      "answer": [str((7 + i) * (3 + i)) for i in range(n)], "metadata_json": ["{}"] * n,
                      "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)]}, schema=PROMPTS.arrow)
    return write_shard(table, str(root / "prompts"), schema=PROMPTS, config_hash="p")


def _input(tiny_model, prompts, out, *, environment=ENV, batch_size=8, **agent):
    cfg = RolloutConfig(n_samples_per_prompt=2, batch_size=batch_size, temperature=1.0,
                        agent=AgentConfig(environment=environment, max_turns=3, **agent))
    return RolloutInput(prompts=prompts, policy=tiny_model, rollout=cfg, iteration=1, out=str(out))


@pytest.fixture(scope="module")
def agent_run(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-rollout")
    tok = load_tokenizer(tiny_model)
    prompts = _prompts(tok, root)
    ref = rollout_stage.run(_input(tiny_model, prompts, root / "rollout"))
    return root, tok, prompts, ref


def test_each_row_is_a_trajectory_with_its_masks_logprobs_and_tool_calls(tiny_model, agent_run):
    _, tok, prompts, ref = agent_run
    rows = read_shard(ref, stage="rollout").to_pylist()
    prompt_rows = {r["prompt_id"]: r for r in read_shard(prompts).to_pylist()}
    assert [r["sample_id"] for r in rows] == [f"q{p}#{k}" for p in range(3) for k in range(2)]
    teacher = batched_response_logprobs(load_causal_lm(tiny_model), [r["prompt_token_ids"] for r in rows],
                                        [r["response_token_ids"] for r in rows], pad_token_id=tok.pad_token_id)
    for row, lps in zip(rows, teacher):
        ids, mask, calls = row["response_token_ids"], row["action_mask"], row["tool_calls"]
        # the reset observation sits in the prompt, before the generation prompt
        assert RESET in tok.decode(row["prompt_token_ids"]) and RESET not in prompt_rows[row["prompt_id"]]["prompt_text"]
        segs = segments(mask)
        model_segs = [(a, b) for m, a, b in segs if m]
        obs_segs = [(a, b) for m, a, b in segs if not m]
        # 3 model turns, the observations of the first two appended, the third's recorded only
        assert row["num_turns"] == 3 == len(model_segs) and len(obs_segs) == 2 and segs[0][0] and segs[-1][0]
        assert row["finish_reason"] == "max_turns"
        texts = [tok.decode(ids[a:b], skip_special_tokens=True) for a, b in model_segs]
        assert [c["turn"] for c in calls] == [1, 2, 3]
        for text, c in zip(texts, calls):
            assert c["name"] == "calculator" and c["error"] is None and c["seconds"] >= 0.0
            assert json.loads(c["arguments"]) == {"expression": f"{len(text)} * 7"}
            assert c["observation"] == str(len(text) * 7)
        for (a, b), c in zip(obs_segs, calls):  # the observation tokens hold the tool's answer, in the tool role
            assert f"tool\n{c['observation']}" in tok.decode(ids[a:b], skip_special_tokens=False)
        assert row["env_reward"] == sum(len(t) % 2 for t in texts) and row["env_fallback"] is False
        assert row["env_error"] is None
        assert row["response_text"] == texts[-1]  # the last model turn: what the reward stage grades
        assert row["transcript"] == tok.decode(ids, skip_special_tokens=False)
        lp = row["rollout_logprobs"]
        assert all(lp[t] == 0.0 for t in range(len(ids)) if not mask[t])
        assert all(lp[t] < 0.0 for t in range(len(ids)) if mask[t])
        assert [lp[t] for t in range(len(ids)) if mask[t]] == pytest.approx([lps[t] for t in range(len(ids)) if mask[t]],
                                                                            abs=1e-4)


def test_summary_and_metrics_report_turns_tool_calls_and_model_tokens(agent_run):
    _, _, _, ref = agent_run
    rows = read_shard(ref, stage="rollout").to_pylist()
    s = read_manifest(ref.uri)[0].summary
    n_model = sum(sum(r["action_mask"]) for r in rows)
    assert s["environment"] == ENV and s["generated_tokens"] == n_model
    assert s["model_tokens_mean"] == pytest.approx(n_model / 6)
    assert (s["num_turns_mean"], s["tool_call_rate"], s["tool_calls_mean"], s["tool_error_frac"]) == (3.0, 1.0, 3.0, 0.0)
    assert s["env_reward_mean"] == pytest.approx(sum(r["env_reward"] for r in rows) / 6)
    assert s["max_turns_fraction"] == 1.0 and s["truncated_fraction"] == 0.0
    m = iteration_metrics(1, {"rollout": ref})
    assert (m["num_turns"], m["tool_call_rate"], m["tool_calls"]) == (3.0, 1.0, 3.0)
    assert " turns 3.000 tools 1.000 " in format_metrics_line(m)
    assert "turns" not in format_metrics_line({"iteration": 1, "reward_mean": 0.5})


def test_rollout_summary_by_hand():
    calls = [[{"turn": 1, "name": "calculator", "arguments": "{}", "observation": "4", "error": None, "seconds": 0.1},
              {"turn": 2, "name": None, "arguments": "", "observation": "error: x", "error": "x", "seconds": 0.2}], []]
    table = pa.table({"sample_id": ["a#0", "a#1"], "prompt_id": ["a", "a"], "sample_index": [0, 1],
                      "prompt_token_ids": [[1], [1]], "response_token_ids": [[5, 6, 7, 8], [9]], "response_text": ["", ""],
                      "rollout_logprobs": [[-1.0, -1.0, 0.0, -1.0], [-1.0]], "action_mask": [[True, True, False, True], [True]],
                      "finish_reason": ["stop", "env_error"], "images": [[], []], "videos": [[], []], "num_turns": [2, 1],
                      "tool_calls": calls, "env_reward": [1.0, 0.5], "env_fallback": [False, True], "env_error": [None, "down"],
                      "transcript": ["", ""], "policy_version": [0, 0]}, schema=ROLLOUT.arrow)
    assert rollout_stage.rollout_summary(table) == {"response_length_mean": 2.5, "truncated_fraction": 0.0}
    assert rollout_stage.rollout_summary(table, agent=True) == {
        "response_length_mean": 2.5, "truncated_fraction": 0.0, "model_tokens_mean": 2.0, "num_turns_mean": 1.5,
        "tool_call_rate": 0.5, "tool_calls_mean": 1.0, "tool_error_frac": 0.5, "env_reward_mean": 0.75,
        "env_fallback_frac": 0.5, "max_turns_fraction": 0.0}


def test_shards_merge_into_the_whole_rollout(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model)
    prompts = _prompts(tok, tmp_path, n=3)
    whole = _input(tiny_model, prompts, tmp_path / "whole", batch_size=1)  # no padding: bit-identical forwards
    parts = [rollout_stage.run(whole.model_copy(update={"shard": (i, 2), "out": str(tmp_path / f"part{i}")}))
             for i in range(2)]
    assert [p.num_rows for p in parts] == [4, 2]  # prompts 0, 2 and prompt 1, two samples each
    merged = rollout_stage.run_merge(RolloutMergeInput(rollout=whole.model_copy(update={"out": str(tmp_path / "merged")}),
                                                       parts=parts, out=str(tmp_path / "merged")))
    direct = rollout_stage.run(whole)

    def strip(ref):  # every column but the wall time of the environment steps
        rows = read_shard(ref, stage="rollout").to_pylist()
        for r in rows:
            r["tool_calls"] = [{k: v for k, v in c.items() if k != "seconds"} for c in r["tool_calls"]]
        return rows

    assert strip(merged) == strip(direct)
    s = read_manifest(merged.uri)[0].summary
    assert s["shards"] == 2 and s["environment"] == ENV and s["num_turns_mean"] == 3.0


def test_a_vision_language_policy_is_refused(tiny_model, tmp_path, monkeypatch):
    prompts = _prompts(load_tokenizer(tiny_model), tmp_path)
    monkeypatch.setattr(rollout_stage, "vl_processor_or_none", lambda path: object())
    with pytest.raises(ValueError, match="multi-turn rollouts take a text-only policy"):
        rollout_stage.run(_input(tiny_model, prompts, tmp_path / "rollout"))
    assert not (tmp_path / "rollout" / "_MANIFEST.json").exists()


def test_editing_a_user_environment_file_makes_the_committed_rollout_stale(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env_file = tmp_path / "my_env.py"
    env_file.write_text("from tests.rft_core.stages.test_agent_rollout_stage import AnyTextCalculator\n\n\n"
                        "class Env(AnyTextCalculator):\n    pass\n")
    prompts = _prompts(load_tokenizer(tiny_model), tmp_path, n=1)
    inp = _input(tiny_model, prompts, tmp_path / "rollout", environment="my_env.py:Env", max_total_tokens=40)
    first = rollout_stage.run(inp)
    assert rollout_stage.run(inp) == first  # unchanged file: reused
    env_file.write_text(env_file.read_text() + "# edited\n")
    with pytest.raises(StaleShardError):
        rollout_stage.run(inp)


def _rewards(tmp_path, rollout, prompts, reward: RewardConfig):
    return rewards_stage.run(RewardsInput(rollout=rollout, prompts=prompts, reward=reward, out=str(tmp_path / "rewards")))


ENV_RECIPE = RewardConfig.model_validate({
    "sources": {"env": {"type": "environment"}, "fmt": {"type": "format"}},
    "recipes": {"default": [{"source": "env", "weight": 0.5}, {"source": "fmt", "weight": 0.1}]},
    "default_recipe": "default"})


def test_the_environment_reward_source_scores_env_reward(agent_run, tmp_path):
    _, _, prompts, ref = agent_run
    out = read_shard(_rewards(tmp_path, ref, prompts, ENV_RECIPE), stage="rewards").to_pylist()
    rows = read_shard(ref, stage="rollout").to_pylist()
    assert [r["sample_id"] for r in out] == [r["sample_id"] for r in rows]
    for r, w in zip(rows, out):
        m = dict(w["reward_metrics"])
        assert m["env"] == r["env_reward"] and m["env.fallback"] == 0.0 and m["fmt"] == 0.0  # gibberish: no Answer line
        assert w["rewards"] == pytest.approx(0.5 * r["env_reward"])


def test_the_environment_source_refuses_a_single_turn_rollout(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model)
    prompts = _prompts(tok, tmp_path, n=1)
    n = 2
    table = pa.table({"sample_id": ["q0#0", "q0#1"], "prompt_id": ["q0"] * n, "sample_index": [0, 1],
                      "prompt_token_ids": [[1, 2]] * n, "response_token_ids": [[3], [4]], "response_text": ["a", "b"],
                      "rollout_logprobs": [[-1.0], [-1.0]], "action_mask": [[True], [True]], "finish_reason": ["stop"] * n,
                      "images": [[], []], "videos": [[], []], **single_turn_columns(["a", "b"]), **policy_version_column(2, 0)}, schema=ROLLOUT.arrow)
    rollout = write_shard(table, str(tmp_path / "rollout"), schema=ROLLOUT, config_hash="r")
    with pytest.raises(RewardError, match="sample q0#0 has no environment reward: its rollout was not multi-turn"):
        _rewards(tmp_path, rollout, prompts, ENV_RECIPE)
    fallback = ENV_RECIPE.model_copy(update={"sources": {**ENV_RECIPE.sources,
                                                         "env": ENV_RECIPE.sources["env"].model_copy(
                                                             update={"on_error": "fallback", "fallback": -1.0})}})
    out = read_shard(_rewards(tmp_path, rollout, prompts, fallback), stage="rewards").to_pylist()
    assert [w["rewards"] for w in out] == [-0.5, -0.5]
    assert all(dict(w["reward_metrics"])["env.fallback"] == 1.0 for w in out)


def test_dynamic_sampling_merge_keeps_the_trajectories_and_their_summary(agent_run, tmp_path):
    from rft_core.stages import dynamic
    from rft_core.stages.contracts import DynamicMergeInput

    _, _, prompts, ref = agent_run
    rewards = _rewards(tmp_path, ref, prompts, ENV_RECIPE)
    _, rollout, _ = dynamic.run_merge(DynamicMergeInput(attempts=[(prompts, ref, rewards)], target_groups=2,
                                                        out=str(tmp_path / "m-prompts"), out_rollout=str(tmp_path / "m-rollout"),
                                                        out_rewards=str(tmp_path / "m-rewards")))
    source = {r["sample_id"]: r for r in read_shard(ref, stage="rollout").to_pylist()}
    merged = read_shard(rollout, stage="rollout").to_pylist()
    assert merged and all(r == source[r["sample_id"]] for r in merged)  # whole rows, trajectory columns included
    s = read_manifest(rollout.uri)[0].summary
    assert s["environment"] == ENV and s["num_turns_mean"] == 3.0 and s["tool_call_rate"] == 1.0
    assert s["model_tokens_mean"] == pytest.approx(sum(sum(r["action_mask"]) for r in merged) / len(merged))
