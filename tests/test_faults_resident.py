"""SIGKILL with resident workers and ``checkpoint.every=3`` (issue 27; see tests/faults.py):
the driver (the flow and its local Ray, the workers with it) or one resident worker is killed
inside a stage of iteration 2, whose policy exists only in the workers' memory. The rerun (or,
for a worker kill, the run itself, which replaces the worker) rebuilds the policy from the
initial model by re-applying the committed updates. Each row asserts that the kill was sent and
landed in the stage it names (for a worker, the driver's log names the worker and the stage),
that the interrupted stage was redone, and that the final weights equal STAGE MODE's bit for bit
(an uninterrupted run with every stage loading its model, checkpoint every iteration; the
uninterrupted resident run equals it too). The rewards vary inside each group
(tests/varying.py).

Rows (docs/reliability.md, docs/scale.md): the driver in each of the 7 stages, a worker in each
of the 4 model stages; CI runs those marked ``ci=True``, ``make test-faults-all`` all 11."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("ray")

from tests.faults import (  # noqa: E402
    STAGE_ORDER,
    assert_row,
    baseline_run,
    row,
    run_scenario,
    write_resident_config,
)

CI_DRIVER = ("rollout", "ppo_update")  # CI's time: ~2 min a row on 2 cores; the rest in make test-faults-all
CI_WORKER = ("ppo_update",)
ROWS = ([row(s, "driver", ci=s in CI_DRIVER) for s in STAGE_ORDER]
        + [row(s, "worker", ci=s in CI_WORKER) for s in ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update")])


@pytest.fixture(scope="module")
def resident_baseline(prefect_harness, tiny_model, tmp_path_factory):
    """(resident config, stage mode's final weights, the resident run's timeline, API URL, folder):
    the uninterrupted resident run ends with stage mode's weights bit for bit."""
    import torch
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp("faults-resident")
    api = PREFECT_API_URL.value()
    stage_weights, _ = baseline_run(write_resident_config(d / "stage.yaml", tiny_model, stage=True), d / "stage", api,
                                    final_iteration=3)
    config = write_resident_config(d / "resident.yaml", tiny_model)
    resident_weights, timeline = baseline_run(config, d / "baseline", api, final_iteration=3)
    assert torch.equal(resident_weights, stage_weights), "the uninterrupted resident run differs from stage mode"
    return config, stage_weights, timeline, api, d


@pytest.mark.parametrize("target, kill", ROWS)
def test_sigkill_resident_then_rerun(resident_baseline, target, kill):
    config, stage_weights, timeline, api_url, d = resident_baseline
    rng = random.Random(f"resident-{target}-{kill}")
    out = run_scenario(config, d / f"run-{target}-{kill}", target, 2, timeline, stage_weights, api_url, rng, kill=kill,
                       final_iteration=3)
    assert_row(out)
    if kill == "worker":
        assert not any("did not survive" in n for n in out.notes), out.notes
