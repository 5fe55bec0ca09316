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
of the 4 model stages, and the driver during iteration 3's checkpoint, which the policy worker
writes in the background (issue 44); CI runs them in the rotation of ``tests/rotation.py`` (each
row at least once in 8 consecutive landings), ``make test-faults-all`` all 12."""
from __future__ import annotations

import datetime as dt

import pytest

pytest.importorskip("ray")

from rft_core.stages.recovery import WEIGHTS_DIGEST_KEY  # noqa: E402
from schemas import read_manifest  # noqa: E402
from tests.faults import (  # noqa: E402
    STAGE_ORDER,
    assert_row,
    resident_baseline,
    resident_checkpoint_row,
    resident_row,
    row,
)

# Every row is in the rotation (tests/rotation.py): a CI run runs the rows of one group of 8;
# make test-faults-all runs all 12. The rows share a two-run baseline (~200 s on 2 cores), so they
# go to 4 groups (5, 6, 7, 0), 2 to 4 each (group 5 also has the checkpoint-write test below), not
# one to every group.
_KILLS = [(s, "driver") for s in STAGE_ORDER] + [(s, "worker") for s in ("rollout", "actor_logprobs", "ref_logprobs",
                                                                        "ppo_update")]
ROWS = [row(s, k, group=(5, 6, 7, 0)[i % 4]) for i, (s, k) in enumerate(_KILLS)]


@pytest.fixture(scope="module")
def baseline(prefect_harness, tiny_model, tmp_path_factory):
    """Stage mode's final weights and the uninterrupted resident run's timeline (which ends with
    stage mode's weights bit for bit), built once for every row."""
    from prefect.settings import PREFECT_API_URL

    return resident_baseline(tmp_path_factory.mktemp("faults-resident"), tiny_model, PREFECT_API_URL.value())


@pytest.mark.parametrize("target, kill", ROWS)
def test_sigkill_resident_then_rerun(baseline, target, kill):
    out = resident_row(baseline, target, kill)
    assert_row(out)
    if kill == "worker":
        assert not any("did not survive" in n for n in out.notes), out.notes


@pytest.mark.rotation(5)  # with the resident rows of group 5 (the baseline is shared); tests/rotation.py
def test_sigkill_during_the_background_checkpoint_write_then_rerun(baseline):
    """Issue 44: the driver (its Ray, the policy worker with it) is killed while the policy worker
    writes iteration 3's checkpoint in the background (``ppo_update-policy``: writer lock taken, the
    AdamW stage before it committed, no manifest). The previous checkpoint (the initial model) is
    the one the rerun starts from: it rebuilds iteration 3's policy by re-applying the three
    committed updates, writes the checkpoint again and ends with stage mode's weights bit for bit."""
    out = resident_checkpoint_row(baseline)
    assert_row(out)
    assert out.interrupted == "3: ppo_update-policy" and out.partial_files, out
    assert (3, "ppo_update-optimizer") in out.committed_at_kill, sorted(out.committed_at_kill)
    # the rerun wrote the lost checkpoint (rft_core/stages/update.py _write_lost_checkpoint), not a
    # writer that outlived the kill: its manifest is younger than the rerun
    m, _ = read_manifest(f"{out.run_root}/iter=000003/ppo_update-policy")
    assert dt.datetime.fromisoformat(m.created_at).timestamp() > out.rerun_started, (m.created_at, out.rerun_started)
    done, _ = read_manifest(f"{out.run_root}/iter=000003/ppo_update")
    assert m.summary[WEIGHTS_DIGEST_KEY] == done.summary[WEIGHTS_DIGEST_KEY], (m.summary, done.summary)
