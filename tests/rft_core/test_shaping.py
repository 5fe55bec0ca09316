"""Overlong penalty, Welford running moments, clipping: hand cases and float64 references."""
from __future__ import annotations

import statistics

import pytest
import torch

from rft_core.algorithms.shaping import RunningMoments, clip_with_fraction, normalize_rewards, overlong_penalty


def test_overlong_penalty_hand():
    # max 100, buffer 20 -> expected 80: len 70 -> 0; 90 -> -(10/20) = -0.5; 100 -> -1 (factor 1); factor 2 doubles
    lens = torch.tensor([70, 80, 90, 100])
    assert overlong_penalty(lens, max_new_tokens=100, buffer_len=20).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lens, max_new_tokens=100, buffer_len=20, penalty_factor=2.0).tolist() == [0.0, 0.0, -1.0, -2.0]
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lens, max_new_tokens=10, buffer_len=20)


def test_running_moments_equal_whole_stream():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1 for n in (5, 1, 12, 7)]
    m = RunningMoments()
    seen: list[float] = []
    for b in batches:
        m = m.update(b)
        seen += b.tolist()
        assert m.count == len(seen)
        assert m.mean == pytest.approx(statistics.fmean(seen), abs=1e-12)
        if len(seen) > 1:
            assert m.std == pytest.approx(statistics.stdev(seen), abs=1e-12)
    assert RunningMoments().std == 1.0 and RunningMoments().update(torch.tensor([])) == RunningMoments()


def test_normalize_and_clip_hand():
    m = RunningMoments().update(torch.tensor([1.0, 3.0]))  # mean 2, unbiased std sqrt(2)
    r = torch.tensor([4.0, 2.0], dtype=torch.float64)
    assert normalize_rewards(r, m, eps=0).tolist() == pytest.approx([2 / 2**0.5, 0.0])
    assert normalize_rewards(r, m, minus_mean=False, eps=0).tolist() == pytest.approx([4 / 2**0.5, 2 / 2**0.5])
    x, frac = clip_with_fraction(torch.tensor([[-3.0, 0.5, 2.0], [9.0, 0.0, 0.0]]), 1.0,
                                 mask=torch.tensor([[True, True, True], [False, True, True]]))
    assert x.tolist() == [[-1.0, 0.5, 1.0], [1.0, 0.0, 0.0]] and frac == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        clip_with_fraction(x, 0.0)
