"""Shared pieces of the flow tests: a deterministic fake reward and a tiny training config."""
from __future__ import annotations

import zlib

import pytest

from rft_core.config import load_config


def _fake_score(text, **kw):
    """Deterministic reward spread for a random model that never answers right: crc32 parity."""
    from rft_core.rewards.math import RewardResult

    r = float(zlib.crc32(text.encode()) % 2)
    return RewardResult(r, r >= 1.0, None, {"correctness": r, "format": 0.0})


@pytest.fixture
def fake_rewards(monkeypatch):
    monkeypatch.setattr("rft_core.rewards.math.score_response", _fake_score)


def flow_cfg(tiny_model, run_root, **extra):
    overrides = {
        "name": "flow-test", "run_root": str(run_root), "iterations": 2, "policy.path": tiny_model,
        "data.prompts_per_iteration": 3, "data.size": 50, "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 6, "rollout.batch_size": 8, "kl.kl_coef": 0.05, "update.lr": 1e-3,
        "update.micro_batch_size": 4,
        # the flow tests cover the actor stage; test_train_flow's auto test covers the default that skips it
        "logprobs.recompute_old_logprobs": True, **extra,
    }
    return load_config(None, overrides)


