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

import pytest

pytest.importorskip("ray")

from tests.faults import assert_row, fsdp_baseline, fsdp_row, row  # noqa: E402

ROWS = [row("ppo_update", "worker", group=1), row("ppo_update", "driver", group=2)]  # no resident row there


@pytest.fixture(scope="module")
def baseline(prefect_harness, tiny_model, tmp_path_factory):
    """The uninterrupted resident FSDP2 run (``tests.faults.fsdp_baseline``), built once for both rows."""
    from prefect.settings import PREFECT_API_URL

    return fsdp_baseline(tmp_path_factory.mktemp("faults-fsdp"), tiny_model, PREFECT_API_URL.value())


@pytest.mark.parametrize("target, kill", ROWS)
def test_sigkill_resident_fsdp_then_rerun(baseline, target, kill):
    assert_row(fsdp_row(baseline, target, kill))
