"""SIGKILL fault injection into every stage (see tests/faults.py): each row asserts that the kill
was sent and landed in the stage and iteration it names (from the committed manifests at the
kill), that the rerun redid the interrupted stage, reused every committed stage untouched, that
all shards validate, and that the final weights equal those of an uninterrupted run (exact
resume: data order, RNG, optimizer state, KL and reward state). The rewards vary inside each
group (tests/varying.py), so the weights compared come from real policy-gradient updates.

The rows of docs/reliability.md's local-disk table: CI runs those marked ``ci=True``; ``make
test-faults-all`` runs all of them."""
from __future__ import annotations

import random

import pytest

from schemas import read_manifest
from tests.faults import STAGE_ORDER, assert_row, baseline_run, row, run_scenario, write_config

# CI: the kill in iteration 1 of a model stage, of a stage between them and of the update (the
# other 4 compute rows: make test-faults-all; CI's time, issue 39)
CI_COMPUTE = ("rollout", "advantages", "ppo_update")
ROWS = ([row(s, 1, "compute", ci=s in CI_COMPUTE) for s in STAGE_ORDER]
        + [row(s, 1, "write", ci=s == "ppo_update") for s in STAGE_ORDER]
        + [row("rollout", 2, "compute", ci=False), row("ppo_update", 2, "compute", ci=True),
           row("ppo_update", 2, "write", ci=False), row("ppo_update-optimizer", 1, "write", ci=True)])


def _baseline(tmp_path_factory, name: str, write, model: str):
    """(config, final weights, timeline, API URL, folder) of an uninterrupted run of the config
    ``write(path, model)`` writes (``baseline_run`` asserts its advantages are not all 0)."""
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp(name)
    config = write(d / f"{name}.yaml", model)
    weights, timeline = baseline_run(config, d / "baseline", PREFECT_API_URL.value())
    return config, weights, timeline, PREFECT_API_URL.value(), d


@pytest.fixture(scope="module")
def baseline(prefect_harness, tiny_model, tmp_path_factory):
    return _baseline(tmp_path_factory, "faults", write_config, tiny_model)


@pytest.mark.parametrize("target, iteration, phase", ROWS)
def test_sigkill_then_rerun(baseline, target, iteration, phase):
    config, weights, timeline, api_url, d = baseline
    rng = random.Random(f"{target}-{iteration}-{phase}")
    out = run_scenario(config, d / f"run-{target}-{iteration}-{phase}", target, iteration, timeline, weights, api_url, rng,
                       phase=phase)
    assert_row(out)
    if phase == "write":  # killed while writing: it left files (its lock, parts, checkpoint files) no reader accepts
        assert out.partial_files and out.interrupted.startswith(f"{iteration}: "), out
    if target == "ppo_update-optimizer":  # killed during the background write: the resume recomputed the state
        root = d / f"run-{target}-{iteration}-{phase}{'' if out.attempts == 1 else f'-retry{out.attempts}'}"
        m, _ = read_manifest(str(root / "iter=000001" / target))
        assert m.summary.get("recovered") is True and m.summary.get("weights_match", True), m.summary


@pytest.fixture(scope="module")
def agent_baseline(prefect_harness, tiny_model, tmp_path_factory):
    from tests.faults import write_agent_config

    return _baseline(tmp_path_factory, "faults-agent", write_agent_config, tiny_model)


@pytest.mark.parametrize("iteration", [1, 2])
def test_sigkill_during_multi_turn_rollout_then_rerun(agent_baseline, iteration):
    """SIGKILL inside a multi-turn rollout (environment steps in flight): the rerun regenerates
    the same trajectories (per-trajectory seeds, a deterministic environment) and ends with the
    uninterrupted run's weights."""
    config, weights, timeline, api_url, d = agent_baseline
    out = run_scenario(config, d / f"run-rollout-{iteration}", "rollout", iteration, timeline, weights, api_url,
                       random.Random(f"agent-rollout-{iteration}"))
    assert_row(out)
