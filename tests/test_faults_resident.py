"""SIGKILL with resident workers and ``checkpoint.every=3`` (issue 27; see tests/faults.py):
the driver (the flow, its local Ray and the workers with it) or one resident worker is killed
inside a stage of iteration 2, whose policy exists only in the workers' memory. The rerun (or,
for a worker kill, the run itself, which replaces the worker) rebuilds the policy from the
initial model by re-applying the committed updates, and ends with the uninterrupted run's
final weights bit for bit."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("ray")

from tests.faults import STAGE_ORDER, baseline_run, run_scenario, write_resident_config  # noqa: E402


@pytest.fixture(scope="module")
def resident_baseline(prefect_harness, tiny_model, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp("faults-resident")
    config = write_resident_config(d / "resident.yaml", tiny_model)
    weights, durations = baseline_run(config, d / "baseline", PREFECT_API_URL.value(), final_iteration=3)
    return config, weights, durations, PREFECT_API_URL.value(), d


# The stages that hold a model (and the advantages between them); prompts and rewards hold none and
# behave as in stage mode (tests/test_faults.py). All 11 rows (every stage for the driver, the four
# model stages for a worker) passed on 2026-11-25; CI runs these 7 (~8 min).
@pytest.mark.parametrize("target, kill", [(s, "driver") for s in STAGE_ORDER if s not in ("prompts", "rewards")]
                         + [(s, "worker") for s in ("rollout", "ppo_update")])
def test_sigkill_resident_then_rerun(resident_baseline, target, kill):
    config, weights, durations, api_url, d = resident_baseline
    rng = random.Random(f"resident-{target}-{kill}")
    out = run_scenario(config, d / f"run-{target}-{kill}", target, 2, durations, weights, api_url, rng, kill=kill,
                       final_iteration=3)
    assert out.rerun_ok, out.notes
    assert out.committed_untouched, "a committed stage was rewritten"
    assert out.all_valid, out.notes
    assert out.same_weights, "the resumed run's final weights differ from the uninterrupted run's"
    if kill == "worker":
        assert not any("did not survive" in n for n in out.notes), out.notes
