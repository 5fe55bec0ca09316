"""SIGKILL of a resident critic gang (see tests/faults.py and test_faults_fsdp.py): PPO with GAE
and an FSDP2 critic held by ``orchestration.critic_ranks: 2`` Ray actors, 3 iterations with
``checkpoint.every: 3``. The gang's rank 0 is SIGKILLed inside iteration 2's ``critic_update``,
while the gang holds the shards and AdamW state the first update left; the run replaces the gang,
whose two new ranks restore them from iteration 1's committed critic and ``critic-optimizer/``
(rank 0 reading the weights: ``rft_core.training.fsdp.weights_on_rank0``) and run the update again;
the rerun reuses every committed stage, and the final policy equals the uninterrupted run's bit for
bit: iteration 3's values, and so its advantages and update, come from the critic update 2 trained.
The rewards vary inside each group (tests/varying.py).

The row takes its turn in the rotation (tests/rotation.py: group 0)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from tests.faults import assert_row, critic_gang_baseline, critic_gang_row, row  # noqa: E402


@pytest.fixture(scope="module")
def baseline(prefect_harness, tiny_model, tmp_path_factory):
    """The uninterrupted run (``tests.faults.critic_gang_baseline``)."""
    from prefect.settings import PREFECT_API_URL

    return critic_gang_baseline(tmp_path_factory.mktemp("faults-critic"), tiny_model, PREFECT_API_URL.value())


@pytest.mark.parametrize("target, kill", [row("critic_update", "worker", group=0)])
def test_sigkill_resident_critic_gang_then_rerun(baseline, target, kill):
    assert (target, kill) == ("critic_update", "worker")
    out = critic_gang_row(baseline)
    assert out.interrupted == "2: critic_update", out.interrupted
    assert_row(out)
