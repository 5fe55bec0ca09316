"""Reward source ``environment``: the multi-turn environment's own reward of each trajectory.

A multi-turn rollout (``rollout.agent``, ``rft_core.agents``) records per trajectory
``env_reward``, the SUM of the rewards its environment returned from ``step`` (None counted as
0), and ``env_fallback``, True when the environment failed and ``env_reward`` is the configured
``rollout.agent.fallback_reward`` instead (``on_env_error: fallback``). This source scores a
sample with its ``env_reward`` and records ``reward_metrics['<source>.fallback'] = 1.0`` for a
fallback trajectory (0.0 otherwise), so the fallbacks stay visible in the rewards shard.

Recipes combine it with the other sources as usual, e.g. the correctness of the final answer
plus a small environment term (``docs/agents.md``).
"""
from __future__ import annotations

from typing import Sequence

from rft_core.rewards.base import RewardSample, SourceScore


class EnvironmentReward:
    """Source ``environment`` (``rft_core.config.EnvironmentSource``).

    ``score`` returns, per sample, ``SourceScore(env_reward, extras={"fallback": 0.0 | 1.0})``,
    or for a sample without an environment reward (``env_reward`` None: its rollout was
    single-turn, e.g. the greedy eval rollout or a run without ``rollout.agent``) a failed score
    whose message names the sample; the engine then raises ``RewardError`` (``on_error:
    raise``) or gives the source's ``fallback`` (``on_error: fallback``).
    """

    def __init__(self, cfg, name: str = "environment") -> None:
        self.cfg, self.name = cfg, name

    def score(self, samples: Sequence[RewardSample]) -> list[SourceScore]:
        out = []
        for s in samples:
            if s.env_reward is None:
                out.append(SourceScore(float("nan"), error=(
                    f"sample {s.sample_id} has no environment reward: its rollout was not multi-turn (rollout.agent is "
                    "not set, or it is the single-turn eval rollout); use the environment source with rollout.agent, or "
                    "on_error: fallback")))
                continue
            out.append(SourceScore(float(s.env_reward), extras={"fallback": 1.0 if s.env_fallback else 0.0},
                                   reason="environment fallback reward" if s.env_fallback else None))
        return out
