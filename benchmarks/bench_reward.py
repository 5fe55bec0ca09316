"""The reward of ``benchmarks/gpu_bench.py`` (issue 44): a deterministic score of a completion's
text that both frameworks compute the same way, so that a random-initialised policy (whose
completions never reach an answer) still trains on non-zero advantages.

``completion_reward(text)`` = CRC-32 of the UTF-8 text modulo 1000, divided by 999: a number in
[0, 1] that differs between almost any two different completions, so every group of sampled
completions has mixed rewards and non-zero group-normalised advantages in both frameworks.
Stdlib only: it is imported by our reward stage (``reward.sources.<name>: {type: python,
function: "benchmarks/bench_reward.py:sample_reward"}``) and by TRL's ``GRPOTrainer``.
"""
from __future__ import annotations

import zlib


def completion_reward(text: str) -> float:
    """CRC-32 (``zlib.crc32``) of ``text`` encoded as UTF-8, modulo 1000, over 999: in [0, 1]."""
    return (zlib.crc32(text.encode("utf-8")) % 1000) / 999.0


def sample_reward(sample) -> float:
    """Our reward source's per-sample call (``call: sample``): ``completion_reward`` of the
    decoded response (``rft_core.rewards.base.RewardSample.response``)."""
    return completion_reward(sample.response)


def trl_reward(completions, **_kwargs) -> list[float]:
    """TRL's reward function (``GRPOTrainer(reward_funcs=[trl_reward])``): ``completion_reward``
    of each completion; a conversational completion is a list of messages, its text the last
    message's ``content``."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [completion_reward(t) for t in texts]
