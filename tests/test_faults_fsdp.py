"""SIGKILL of a resident FSDP2 run (issue 47; see tests/faults.py and test_faults_resident.py):
``update.fsdp`` with ``orchestration.policy_ranks: 2`` and ``checkpoint.every: 3``, so the
policy of iterations 1 and 2 lives only in the two ranks' shards. The policy worker's rank 0
(its gang then fails as a whole) or the driver (the flow, its local Ray and every worker) is
SIGKILLed inside iteration 2's ``ppo_update``; the run (worker kill: it replaces the gang) and
its rerun rebuild the policy on two new ranks from the initial model by re-applying the
committed update of iteration 1, and the final weights equal the uninterrupted FSDP2 run's bit
for bit. The rewards vary inside each group (tests/varying.py).

Both rows take their turns in the rotation (tests/rotation.py; about 4 min each on 2 cores)."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("ray")

from tests.faults import assert_row, baseline_run, row, run_scenario, write_resident_config  # noqa: E402

ROWS = [row("ppo_update", "worker", group=1), row("ppo_update", "driver", group=2)]  # no resident row there


def write_fsdp_config(path, model: str):
    """``write_resident_config``'s run with FSDP2 over 2 policy ranks."""
    write_resident_config(path, model)
    text = path.read_text()
    assert "update: {lr: 1.0e-3, micro_batch_size: 2, epochs: 2}" in text
    path.write_text(text.replace("update: {lr: 1.0e-3, micro_batch_size: 2, epochs: 2}",
                                 "update: {lr: 1.0e-3, micro_batch_size: 2, epochs: 2, fsdp: {reshard_after_forward: true}}")
                    .replace("orchestration: {workers: resident}", "orchestration: {workers: resident, policy_ranks: 2}")
                    .replace("name: faults-resident", "name: faults-fsdp")
                    # 16 new tokens instead of 48: two ranks per update, and baseline_run's 10 min on a loaded machine
                    .replace("max_new_tokens: 48", "max_new_tokens: 16"))
    return path


@pytest.fixture(scope="module")
def fsdp_baseline(prefect_harness, tiny_model, tmp_path_factory):
    """(config, the uninterrupted resident FSDP2 run's final weights, its timeline, API URL, folder)."""
    from prefect.settings import PREFECT_API_URL

    d = tmp_path_factory.mktemp("faults-fsdp")
    api = PREFECT_API_URL.value()
    config = write_fsdp_config(d / "fsdp.yaml", tiny_model)
    weights, timeline = baseline_run(config, d / "baseline", api, final_iteration=3)
    return config, weights, timeline, api, d


@pytest.mark.parametrize("target, kill", ROWS)
def test_sigkill_resident_fsdp_then_rerun(fsdp_baseline, target, kill):
    config, weights, timeline, api_url, d = fsdp_baseline
    rng = random.Random(f"fsdp-{target}-{kill}")
    out = run_scenario(config, d / f"run-{target}-{kill}", target, 2, timeline, weights, api_url, rng, kill=kill,
                       final_iteration=3, timeout=900)
    assert_row(out)
