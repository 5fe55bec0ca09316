"""SIGKILL while a rollout and the previous iteration's update run side by side
(``rollout.max_staleness: 1``, issue 28; see tests/faults.py): the rerun reuses every committed
stage, recomputes the interrupted ones from the same schedule (the rollout of iteration 2 samples
with the initial policy whatever had finished), and ends with the uninterrupted run's weights."""
from __future__ import annotations

import random

import pytest

from tests.faults import baseline_run, run_scenario, write_async_config


@pytest.fixture(scope="module")
def async_baseline(prefect_harness, tiny_model, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp("faults-async")
    config = write_async_config(d / "async.yaml", tiny_model)
    weights, durations = baseline_run(config, d / "baseline", PREFECT_API_URL.value())
    return config, weights, durations, PREFECT_API_URL.value(), d


# ppo_update of iteration 1 starts after its advantages commit, the rollout of iteration 2 after its
# prompts commit: both kills land while the other of the pair runs too
@pytest.mark.parametrize("target, iteration", [("ppo_update", 1), ("rollout", 2)])
def test_sigkill_during_the_overlap_then_rerun(async_baseline, target, iteration):
    config, weights, durations, api_url, d = async_baseline
    rng = random.Random(f"async-{target}-{iteration}")
    out = run_scenario(config, d / f"run-{target}-{iteration}", target, iteration, durations, weights, api_url, rng)
    assert out.rerun_ok, out.notes
    assert out.committed_untouched, "a committed stage was rewritten"
    assert out.all_valid, out.notes
    assert out.same_weights, "the resumed run's final weights differ from the uninterrupted run's"
