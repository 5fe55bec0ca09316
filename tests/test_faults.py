"""SIGKILL fault injection into every stage (see tests/faults.py): the rerun completes, reuses
every committed stage untouched, all shards validate, and the final weights equal those of an
uninterrupted run (exact resume: data order, RNG, optimizer state, KL and reward state)."""
from __future__ import annotations

import random

import pytest

from schemas import read_manifest
from tests.faults import STAGE_ORDER, baseline_run, run_scenario, write_config


def _baseline(tmp_path_factory, name: str, write, model: str):
    """(config, final weights, stage durations, API URL, folder) of an uninterrupted run of the
    config ``write(path, model)`` writes."""
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp(name)
    config = write(d / f"{name}.yaml", model)
    weights, durations = baseline_run(config, d / "baseline", PREFECT_API_URL.value())
    return config, weights, durations, PREFECT_API_URL.value(), d


@pytest.fixture(scope="module")
def baseline(prefect_harness, tiny_model, tmp_path_factory):
    return _baseline(tmp_path_factory, "faults", write_config, tiny_model)


@pytest.mark.parametrize("target, iteration, phase", [(s, 1, "compute") for s in STAGE_ORDER]
                         + [("ppo_update", 1, "write"), ("ppo_update", 2, "compute"), ("ppo_update-optimizer", 1, "write")])
def test_sigkill_then_rerun(baseline, target, iteration, phase):
    config, weights, durations, api_url, d = baseline
    rng = random.Random(f"{target}-{iteration}-{phase}")
    out = run_scenario(config, d / f"run-{target}-{iteration}-{phase}", target, iteration, durations, weights, api_url, rng,
                       phase=phase)
    if phase == "write":  # killed while writing the checkpoint: it left files that no reader accepts
        assert out.killed and out.partial_files and out.interrupted.startswith("1: ppo_update"), out
    assert out.rerun_ok, out.notes
    if target == "ppo_update-optimizer":  # killed during the background write: the resume recomputed the state
        m, _ = read_manifest(str(d / f"run-{target}-{iteration}-{phase}" / "iter=000001" / target))
        assert m.summary.get("recovered", False) == out.interrupted.startswith("1: ppo_update-optimizer"), out
        assert m.summary.get("weights_match", True)
    assert out.committed_untouched, "a committed stage was rewritten"
    assert out.all_valid, out.notes
    assert out.same_weights, "the resumed run's final weights differ from the uninterrupted run's"


@pytest.fixture(scope="module")
def agent_baseline(prefect_harness, tiny_model, tmp_path_factory):
    from tests.faults import write_agent_config

    return _baseline(tmp_path_factory, "faults-agent", write_agent_config, tiny_model)


@pytest.mark.parametrize("iteration", [1, 2])
def test_sigkill_during_multi_turn_rollout_then_rerun(agent_baseline, iteration):
    """SIGKILL inside a multi-turn rollout (environment steps in flight): the rerun regenerates
    the same trajectories (per-trajectory seeds, a deterministic environment) and ends with the
    uninterrupted run's weights."""
    config, weights, durations, api_url, d = agent_baseline
    out = run_scenario(config, d / f"run-rollout-{iteration}", "rollout", iteration, durations, weights, api_url,
                       random.Random(f"agent-rollout-{iteration}"))
    assert out.killed, out
    assert out.rerun_ok, out.notes
    assert out.committed_untouched, "a committed stage was rewritten"
    assert out.all_valid, out.notes
    assert out.same_weights, "the resumed run's final weights differ from the uninterrupted run's"
