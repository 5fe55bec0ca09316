"""The pure helpers of the learning benchmark's TRL arm (benchmarks/learning_trl.py, issue 19):
the GRPOConfig mapping of configs/grpo_learning.yaml, the refusals, TRL's log rows folded into
iterations, the spread over seeds and the Welch comparison of the mean gains, and the report
section on synthetic results. Nothing here imports TRL or trains."""
from __future__ import annotations

import math

import pytest

from benchmarks.learning_trl import (
    compare_gains,
    grpo_config_kwargs,
    iteration_metrics,
    report_section,
    spread,
    steps_per_iteration,
    t_critical_95,
    unmapped_settings,
)
from rft_core.config import load_config


@pytest.fixture
def cfg():
    return load_config("configs/grpo_learning.yaml", [])


def test_mapping_of_the_learning_preset(cfg):
    # 8 prompts x 8 samples = 64 per iteration, 32 per optimizer step, micro-batches of 8
    assert steps_per_iteration(cfg) == 2
    g = grpo_config_kwargs(cfg, seed=3, output_dir="/tmp/unused")
    assert g["max_steps"] == 24
    assert (g["per_device_train_batch_size"], g["gradient_accumulation_steps"], g["steps_per_generation"]) == (8, 4, 8)
    assert g["per_device_train_batch_size"] * g["steps_per_generation"] == 64  # TRL's generation batch
    assert (g["num_generations"], g["temperature"], g["max_completion_length"], g["learning_rate"]) == (8, 0.8, 64, 1e-5)
    assert (g["beta"], g["epsilon"], g["epsilon_high"], g["num_iterations"]) == (0.0, 0.2, 0.2, 1)
    assert (g["loss_type"], g["scale_rewards"], g["shuffle_dataset"], g["seed"]) == ("dapo", "group", False, 3)
    assert unmapped_settings(cfg) == []


def test_refusals_and_bad_batch_sizes():
    assert unmapped_settings(load_config("configs/grpo_learning.yaml", ["kl.kl_coef=0.01"]))
    assert unmapped_settings(load_config("configs/grpo_learning.yaml", ["update.loss_agg=seq-mean-token-mean"]))
    with pytest.raises(ValueError, match="multiple"):
        steps_per_iteration(load_config("configs/grpo_learning.yaml", ["update.train_batch_size=24"]))


def test_iteration_metrics_take_the_generating_step():
    logs = [{"step": 1, "reward": 0.2, "completions/mean_length": 40.0, "loss": 0.1},
            {"step": 2, "loss": 0.0, "policy_loss": 0.0},  # no generation in the second step
            {"step": 3, "reward": 0.4, "completions/mean_length": 30.0},
            {"step": 4, "loss": 0.0}, {"step": 4, "train_runtime": 9.0}]
    assert iteration_metrics(logs, 2) == [{"iteration": 1, "reward_mean": 0.2, "response_length": 40.0},
                                          {"iteration": 2, "reward_mean": 0.4, "response_length": 30.0}]


def test_spread_and_welch_comparison():
    assert spread([0.1]) == {"n": 1, "mean": 0.1, "sd": 0.0, "min": 0.1, "max": 0.1}
    assert t_critical_95(4.0) == 2.776 and t_critical_95(4.9) == 2.776 and t_critical_95(100) == 1.96
    c = compare_gains([0.087, 0.067, 0.100], [0.120, 0.133, 0.147])
    se = math.sqrt(spread([0.087, 0.067, 0.100])["sd"] ** 2 / 3 + spread([0.120, 0.133, 0.147])["sd"] ** 2 / 3)
    assert c["diff"] == pytest.approx(0.084667 - 0.133333, abs=1e-5) and c["se"] == pytest.approx(se)
    assert 2 <= c["df"] <= 4 and c["verdict"] == "lower"  # t ~ -3.9, beyond 3.18 (df ~ 3.8)
    assert compare_gains([0.08, 0.10, 0.06], [0.09, 0.07, 0.11])["verdict"] == "within the noise"
    assert compare_gains([0.08], [0.09, 0.07])["verdict"] == "unknown"


def test_report_section_renders(cfg):
    ev = {"accuracy": 0.1, "accuracy_stderr": 0.024, "reward_mean": 0.103, "response_length_mean": 47.1, "num_prompts": 150}

    def after(acc):
        return {**ev, "accuracy": acc, "reward_mean": acc + 0.01}

    ours = [{"seed": s, "after": after(a)} for s, a in ((0, 0.187), (1, 0.167))]
    trl = [{"seed": s, "after": after(a), "train_seconds": 700.0, "trl_version": "1.16.0",
            "grpo_config": grpo_config_kwargs(cfg, seed=s, output_dir="x"),
            "metrics": [{"iteration": i, "reward_mean": 0.1 * i, "response_length": 30.0} for i in range(1, 5)]}
           for s, a in ((0, 0.2), (1, 0.18))]
    text = "\n".join(report_section(ev, ours, trl, cfg, "runs/learning"))
    assert "| TRL after, seed 1 | 0.180 ± 0.024 |" in text and "0.200 → 0.300" in text
    assert "**TRL held-out accuracy gain: +0.090" in text and "ours minus TRL -0.013" in text
    assert "32 sequences per optimizer step (2 per generation)" in text and "`loss_type='dapo'`" in text
