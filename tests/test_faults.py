"""SIGKILL fault injection into every stage (see tests/faults.py): each row asserts that the kill
was sent and landed in the stage and iteration it names (from the committed manifests at the
kill), that the rerun redid the interrupted stage, reused every committed stage untouched, that
all shards validate, and that the final weights equal those of an uninterrupted run (exact
resume: data order, RNG, optimizer state, KL and reward state). The rewards vary inside each
group (tests/varying.py), so the weights compared come from real policy-gradient updates.

The rows of docs/reliability.md's local-disk table (``benchmarks/reliability.py`` runs the same
row functions): CI runs them in the rotation of ``tests/rotation.py`` (each row at least once in
8 consecutive landings); ``make test-faults-all`` runs all of them."""
from __future__ import annotations

import datetime as dt
import re

import pytest

from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY
from schemas import read_manifest
from tests.faults import (
    STAGE_ORDER,
    agent_row,
    assert_row,
    row,
    scenario_baseline,
    stage_checkpoint_row,
    stage_every_row,
    stage_row,
    write_agent_config,
    write_config,
)

# Every row is in the rotation (tests/rotation.py): a CI run runs the rows of one group of 8, so
# each row runs at least once in 8 consecutive landings; make test-faults-all runs all of them.
ROWS = ([row(s, 1, "compute") for s in STAGE_ORDER]
        + [row(s, 1, "write") for s in STAGE_ORDER]
        + [row("rollout", 2, "compute"), row("ppo_update", 2, "compute"),
           row("ppo_update", 2, "write"), row("ppo_update-optimizer", 1, "write")])
AGENT_ROWS = [row(1), row(2)]


def _baseline(tmp_path_factory, name: str, write, model: str):
    from prefect.settings import PREFECT_API_URL

    return scenario_baseline(tmp_path_factory.mktemp(name), write, model, PREFECT_API_URL.value())


@pytest.fixture(scope="module")
def baseline(prefect_harness, tiny_model, tmp_path_factory):
    """The uninterrupted 2-iteration run every stage-mode row is compared with (built once)."""
    return _baseline(tmp_path_factory, "faults", write_config, tiny_model)


@pytest.mark.parametrize("target, iteration, phase", ROWS)
def test_sigkill_then_rerun(baseline, target, iteration, phase):
    out = stage_row(baseline, target, iteration, phase)
    assert_row(out)
    if phase == "write":  # killed while writing: it left files (its lock, parts, checkpoint files) no reader accepts
        assert out.partial_files and out.interrupted.startswith(f"{iteration}: "), out
    if target == "ppo_update-optimizer":  # killed during the background write: the resume recomputed the state
        m, _ = read_manifest(f"{out.run_root}/iter=000001/{target}")
        assert m.summary.get("recovered") is True and m.summary.get("weights_match", True), m.summary


@pytest.fixture(scope="module")
def agent_baseline(prefect_harness, tiny_model, tmp_path_factory):
    return _baseline(tmp_path_factory, "faults-agent", write_agent_config, tiny_model)


@pytest.mark.rotation(5)  # one of the groups with the fewest seconds (tests/rotation.py)
def test_sigkill_during_the_stage_mode_background_checkpoint_write_then_rerun(baseline):
    """Stage mode (``checkpoint.async_weights``, the default): the driver is killed while the writer
    thread writes iteration 1's weights (``ppo_update-policy``: writer lock taken, the AdamW stage
    before it committed, no manifest), with iteration 1's update committed with their digest only.
    No worker holds that policy: the rerun runs iteration 1's update again from its committed
    inputs on the initial model, checks the recorded digest, writes the weights (and iteration 2
    trains from them) and ends with the scenario's weights bit for bit."""
    out = stage_checkpoint_row(baseline)
    assert_row(out)
    assert out.interrupted == "1: ppo_update-policy" and out.partial_files, out
    assert (1, "ppo_update") in out.committed_at_kill and (1, "ppo_update-optimizer") in out.committed_at_kill, \
        sorted(out.committed_at_kill)
    done, _ = read_manifest(f"{out.run_root}/iter=000001/ppo_update")
    m, _ = read_manifest(f"{out.run_root}/iter=000001/ppo_update-policy")
    assert WEIGHTS_DIGEST_KEY in done.summary and m.summary[WEIGHTS_DIGEST_KEY] == done.summary[WEIGHTS_DIGEST_KEY]
    # written by the rerun (rft_core/stages/update.py _retrain_lost), not by a writer that outlived the kill
    assert dt.datetime.fromisoformat(m.created_at).timestamp() > out.rerun_started, (m.created_at, out.rerun_started)


@pytest.mark.rotation(0)  # the group with the fewest seconds (tests/rotation.py)
def test_sigkill_in_a_stage_mode_run_with_checkpoint_every_2_then_rerun(baseline):
    """Stage mode keeping its models with ``checkpoint.every: 2``: iteration 1's update committed
    its weights' digest, no weights and no AdamW state (the policy lived in the driver's memory
    only); the driver is killed in iteration 2's rollout. The rerun (a fresh process, nothing
    kept) rebuilds policy 1 from the initial model and update 1's committed inputs, checked against
    the recorded digest, and ends with the weights of the uninterrupted run that wrote every
    checkpoint, bit for bit."""
    out = stage_every_row(baseline)
    assert_row(out)
    assert out.interrupted.startswith("2: rollout"), out
    done, _ = read_manifest(f"{out.run_root}/iter=000001/ppo_update")
    assert WEIGHTS_DIGEST_KEY in done.summary and not any(e.path.startswith("policy/") for e in done.files)
    assert re.search(r"rebuilt the policy of \S+iter=000001/ppo_update from \S+ by re-applying 1 committed update",
                     out.rerun_log), out.rerun_log[-3000:]


@pytest.mark.parametrize("iteration", AGENT_ROWS)
def test_sigkill_during_multi_turn_rollout_then_rerun(agent_baseline, iteration):
    """SIGKILL inside a multi-turn rollout (environment steps in flight): the rerun regenerates
    the same trajectories (per-trajectory seeds, a deterministic environment) and ends with the
    uninterrupted run's weights."""
    assert_row(agent_row(agent_baseline, iteration))
