"""Dynamic sampling: group selection across attempts, the refill data stream."""
from __future__ import annotations

import pyarrow as pa

from rft_core.data.prompts import iteration_indices, refill_indices
from rft_core.stages.dynamic import select_groups
from rft_core.stages.rewards import signal_prompt_ids


def _rewards(rows):
    return pa.table({"prompt_id": [p for p, _ in rows], "rewards": pa.array([r for _, r in rows], pa.float32())})


def test_select_groups_across_attempts():
    # attempt 0: a mixed, b flat, c flat; attempt 1: a again (duplicate), d mixed, e mixed
    a0 = _rewards([("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 0.0), ("c", 1.0), ("c", 1.0)])
    a1 = _rewards([("a", 1.0), ("a", 0.0), ("d", 0.0), ("d", 0.5), ("e", 1.0), ("e", 0.0)])
    assert signal_prompt_ids(a0) == ["a"]
    sel = select_groups([a0, a1], target=2)
    assert sel.kept == [(0, "a"), (1, "d")]  # e is not needed: the batch is full
    assert (sel.dropped_flat, sel.duplicates, sel.shortfall, sel.fallback) == (2, 1, 0, False)
    short = select_groups([a0], target=3)
    assert short.kept == [(0, "a")] and short.shortfall == 2


def test_no_signal_falls_back_to_first_attempt():
    flat = _rewards([("a", 0.0), ("a", 0.0), ("b", 1.0), ("b", 1.0)])
    sel = select_groups([flat, flat], target=2)
    assert sel.fallback and sel.kept == [(0, "a"), (0, "b")] and sel.shortfall == 2


def test_refill_stream_is_separate_and_deterministic():
    main = [iteration_indices(i, per_iteration=4, size=100, seed=1) for i in (1, 2, 3)]
    r = refill_indices(2, 1, per_iteration=4, size=100, seed=1)
    assert r == refill_indices(2, 1, per_iteration=4, size=100, seed=1)
    assert r != refill_indices(2, 2, per_iteration=4, size=100, seed=1) and len(set(r)) == 4
    # refills do not change the main order
    assert main == [iteration_indices(i, per_iteration=4, size=100, seed=1) for i in (1, 2, 3)]


def test_stage_summaries_hand():
    from rft_core.stages.rewards import rewards_summary
    from rft_core.stages.rollout import rollout_summary

    rewards = pa.table({"rewards": pa.array([1.0, 0.1, 0.0, 1.1], pa.float32()), "correct": [True, False, False, True],
                        "reward_metrics": pa.array([[("format", 0.0)], [("format", 1.0)], [], [("format", 1.0)]],
                                                   pa.map_(pa.string(), pa.float32()))})
    s = rewards_summary(rewards)
    # mean (1 + 0.1 + 0 + 1.1) / 4 = 0.55; 2 of 4 correct; format 2 of 4 (a source without it counts 0)
    assert s["reward_mean"] == __import__("pytest").approx(0.55) and s["accuracy"] == 0.5 and s["format_rate"] == 0.5
    rollout = pa.table({"response_token_ids": [[1, 2, 3], [4], [], [5, 6]], "finish_reason": ["stop", "length", "stop", "length"]})
    # lengths 3, 1, 0, 2 -> mean 1.5; 2 of 4 cut at max_new_tokens
    assert rollout_summary(rollout) == {"response_length_mean": 1.5, "truncated_fraction": 0.5}
