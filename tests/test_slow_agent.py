"""The multi-turn calculator preset (configs/grpo_agent_calc.yaml) on the real SmolLM2-135M-Instruct:
one iteration through the training flow, smaller (4 prompts x 4 samples)."""
from __future__ import annotations

import json

import pytest

from rft_core.agents.calculator import evaluate, format_number
from rft_core.agents.view import segments
from rft_core.config import load_config
from rft_core.models.loading import DEFAULT_MODEL, load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.rewards.math import extract_answer
from schemas import read_manifest, read_shard, stage_uri

pytestmark = pytest.mark.slow


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_agent_preset_one_iteration_on_smollm2(prefect_harness, tmp_path):
    from flows.train import train

    cfg = load_config("configs/grpo_agent_calc.yaml", {"run_root": str(tmp_path / "run"), "iterations": 1,
                                                       "data.prompts_per_iteration": 4, "rollout.n_samples_per_prompt": 4,
                                                       "update.train_batch_size": 16})  # the preset's 32 > 4 x 4
    result = train(cfg)
    root = cfg.run_root
    rows = read_shard(stage_uri(root, 1, "rollout"), stage="rollout").to_pylist()
    assert len(rows) == 16
    tok = load_tokenizer(DEFAULT_MODEL)
    calls = [c for r in rows for c in r["tool_calls"] if c["name"] == "calculator"]
    assert calls, "with the worked example in the system prompt the model calls the calculator"
    for c in calls:  # every observation is the real calculator's answer (or its refusal)
        expr = json.loads(c["arguments"])["expression"]
        try:
            want = format_number(evaluate(expr))
        except Exception:  # noqa: BLE001 - a refused expression: the observation says why
            assert c["error"] is not None and c["observation"].startswith("error: calculator")
            continue
        assert c["observation"] == want and c["error"] is None
    teacher = batched_response_logprobs(load_causal_lm(DEFAULT_MODEL), [r["prompt_token_ids"] for r in rows],
                                        [r["response_token_ids"] for r in rows], pad_token_id=tok.pad_token_id,
                                        temperature=cfg.rollout.temperature)
    for r, lps in zip(rows, teacher):
        mask, ids = r["action_mask"], r["response_token_ids"]
        model_segs = [(a, b) for m, a, b in segments(mask) if m]
        assert len(model_segs) == r["num_turns"] <= 3
        # the graded text is the last model turn, decoded from the model's own tokens
        assert r["response_text"] == tok.decode(ids[model_segs[-1][0]:model_segs[-1][1]], skip_special_tokens=True)
        # rollout log-probs are the sampling distribution's (temperature 0.8) on model tokens, 0 on observations
        for t, (lp, m) in enumerate(zip(r["rollout_logprobs"], mask)):
            assert (abs(lp - lps[t]) < 2e-3) if m else lp == 0.0
    rewards = {w["sample_id"]: w for w in read_shard(stage_uri(root, 1, "rewards"), stage="rewards").to_pylist()}
    for r in rows:  # graded on the final answer only
        assert rewards[r["sample_id"]]["extracted_answer"] == extract_answer(r["response_text"])[0]
    steps = read_shard(stage_uri(root, 1, "ppo_update"), stage="ppo_update").to_pylist()
    assert sum(s["num_tokens"] for s in steps) == sum(sum(r["action_mask"]) for r in rows)
    m = result.metrics[0]
    summary = read_manifest(stage_uri(root, 1, "rollout"))[0].summary
    assert m["num_turns"] == summary["num_turns_mean"] >= 1.0 and 0.0 < m["tool_call_rate"] <= 1.0
