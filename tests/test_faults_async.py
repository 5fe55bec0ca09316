"""SIGKILL while a rollout and the previous iteration's update run side by side
(``rollout.max_staleness: 1``, issue 28; see tests/faults.py): each row asserts that the kill
landed while both stages of the pair were in flight (both could start, neither had committed),
that the rerun redid both, reused every committed stage, recomputed the interrupted ones from the
same schedule (the rollout of iteration 2 samples with the initial policy whatever had finished),
and ended with the uninterrupted run's weights. The rewards vary inside each group
(tests/varying.py).

With partial rollouts (``rollout.partial``, issue 48) the kill lands in iteration 2's rollout
while it continues the sequences iteration 1 carried (mid-chunk: after the rollout's log line
that it starts generating, and nothing of the chunk is committed); the rerun continues the same carried sequences from the committed carry and ends
with the uninterrupted run's weights (iteration 3 trains the groups iteration 1 started)."""
from __future__ import annotations

import pytest

from tests.faults import assert_row, async_row, partial_baseline, partial_row, row, scenario_baseline, write_async_config


@pytest.fixture(scope="module")
def async_baseline(prefect_harness, tiny_model, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL

    return scenario_baseline(tmp_path_factory.mktemp("faults-async"), write_async_config, tiny_model,
                             PREFECT_API_URL.value())


# the kill waits until ppo_update of iteration 1 (after its advantages) and the rollout of
# iteration 2 (after its prompts) can both run, and lands where both ran in the uninterrupted run;
# each row in its turn of the rotation (tests/rotation.py), both with make test-faults-all
ROWS = [row("ppo_update", 1, ("rollout", 2), group=4), row("rollout", 2, ("ppo_update", 1), group=4)]  # one baseline


@pytest.mark.parametrize("target, iteration, other", ROWS)
def test_sigkill_during_the_overlap_then_rerun(async_baseline, target, iteration, other):
    out = async_row(async_baseline, target, iteration, other)
    assert out.overlap_live, f"the kill did not land while both {target} {iteration} and {other} ran: {out.notes}"
    assert_row(out)


@pytest.fixture(scope="module")
def partial(prefect_harness, tiny_model, tmp_path_factory):
    """The uninterrupted partial-rollout run (``tests.faults.partial_baseline``)."""
    from prefect.settings import PREFECT_API_URL

    return partial_baseline(tmp_path_factory.mktemp("faults-partial"), tiny_model, PREFECT_API_URL.value())


@pytest.mark.rotation(7)  # out of group 3, estimated at ~38 min with it (2026-11-28); tests/rotation.py
def test_sigkill_mid_chunk_of_a_partial_rollout_then_rerun(partial):
    from schemas import read_manifest

    out = partial_row(partial)
    # the kill came after the rollout said it starts generating (rft_core.stages.rollout), and nothing of it committed
    assert out.line_at is not None and out.line_at < out.kill_time, out.notes
    assert_row(out)
    summary = read_manifest(f"{out.run_root}/iter=000002/rollout")[0].summary
    assert summary["partial_continued_sequences"] == 16 and summary["partial_carried_groups"] == 8  # what was redone
