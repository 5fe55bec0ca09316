"""The run's resident workers start together (issue 44: the time around the stages): which
workers a config's first iteration needs (``TrainConfig.first_resident_stages``), and
``rft_core.workers.pool.start_run_workers`` creating every actor without waiting for any, each
placed once by the first stage that needs it (two at once included), and a worker that cannot be
placed failing the stage that needs it, on a local Ray."""
from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from rft_core.config import TrainConfig
from rft_core.config.scale import RESIDENT_STAGES


def _cfg(tmp_path, **over) -> TrainConfig:
    from tests.flows.conftest import flow_cfg

    return flow_cfg(str(tmp_path / "model"), tmp_path / "run", **{"orchestration.workers": "resident", **over})


@pytest.mark.parametrize("over, want", [
    ({}, ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update")),  # the actor pass runs in the rollout worker
    ({"logprobs.recompute_old_logprobs": False}, ("rollout", "ref_logprobs", "ppo_update")),
    ({"kl.kl_coef": 0.0}, ("rollout", "actor_logprobs", "ppo_update")),  # no reference pass at all
    ({"advantage.estimator": "gae"}, ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update", "critic_values",
                                       "critic_update")),
    ({"orchestration.workers": "stage"}, ()),
])
def test_the_first_iteration_names_the_stages_whose_workers_start_together(tmp_path, over, want):
    cfg = _cfg(tmp_path, **over)
    assert cfg.first_resident_stages == want
    assert set(want) <= set(RESIDENT_STAGES)


@pytest.fixture(scope="module")
def local_ray():
    """The local Ray both tests share (each uses its own run root, so its own pool)."""
    ray = pytest.importorskip("ray")
    ray.shutdown()  # a local Ray another test started
    try:
        yield ray
    finally:
        ray.shutdown()


def test_the_run_creates_every_worker_at_once_and_each_stage_places_its_own_once(local_ray, tmp_path, caplog):
    from rft_core.workers import pool

    cfg = _cfg(tmp_path, **{"orchestration.worker_threads": 1})
    workers = cfg.runner("rollout").workers
    names = {role: pool.actor_name(cfg.run_root, role) for role in ("rollout", "reference", "policy")}
    try:
        with caplog.at_level(logging.INFO, logger="rft_core.workers"):
            t0 = time.perf_counter()
            assert pool.start_run_workers(cfg) == ["rollout", "reference", "policy"]
            created_s = time.perf_counter() - t0
            # every actor exists (Ray starts their processes), none was waited for: nothing placed yet
            assert all(_exists(local_ray, n) for n in names.values()), names
            assert not _placed(caplog), _placed(caplog)
            assert all(pool._held_gang(workers, role) is None for role in names)
            # two stages ask for the rollout worker at once (the actor and a second caller): one placement
            got: list = []
            threads = [threading.Thread(target=lambda: got.append(pool.start_gang(workers, "rollout"))) for _ in range(2)]
            t1 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            first_s = time.perf_counter() - t1
            assert len(got) == 2 and got[0][0] is got[1][0], got
            assert pool.start_gang(workers, "reference") and pool.start_gang(workers, "policy")
        placed = _placed(caplog)
        assert sorted(m.split()[2] for m in placed) == ["policy", "reference", "rollout"], placed  # once each
        assert all(re.search(r", pid \d+, ", m) for m in placed), placed
        print(f"created in {created_s:.2f} s; the first worker answered {first_s:.2f} s later")
        # asked again: the same actors, nothing new
        caplog.clear()
        assert pool.start_run_workers(cfg) == ["rollout", "reference", "policy"]
        assert pool.start_gang(workers, "rollout")[0] is got[0][0] and not _placed(caplog)
    finally:
        assert sorted(pool.stop_workers(cfg.run_root)) == ["policy", "reference", "rollout"]
    assert not any(_exists(local_ray, n) for n in names.values())


def _placed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("resident worker ")]


def _exists(ray, name: str) -> bool:
    from rft_core.workers.pool import NAMESPACE

    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py); the creation test above runs every time
def test_a_created_worker_that_cannot_be_placed_fails_the_stage_that_needs_it(local_ray, tmp_path, monkeypatch):
    from rft_core.workers import pool

    cfg = _cfg(tmp_path, **{"orchestration.worker_threads": 1})
    workers = cfg.runner("rollout").workers
    real_place = pool._place

    def place(ray, w, role, gang, options):
        if role == "reference":
            pool._kill_gang(w.pool, role, gang)  # as _place does when its limit passes
            raise pool.WorkerError(f"the {role} worker of {w.pool} could not be placed within 0 s")
        return real_place(ray, w, role, gang, options)

    monkeypatch.setattr(pool, "_place", place)
    try:
        assert pool.start_run_workers(cfg) == ["rollout", "reference", "policy"]
        assert pool.start_gang(workers, "rollout")
        with pytest.raises(pool.WorkerError, match="the reference worker of .* could not be placed"):
            pool.start_gang(workers, "reference")
        assert ("reference" not in pool.placements(cfg.run_root)) and not _exists(
            local_ray, pool.actor_name(cfg.run_root, "reference"))
        monkeypatch.setattr(pool, "_place", real_place)  # the next stage starts a new one
        assert pool.start_gang(workers, "reference")
    finally:
        pool.stop_workers(cfg.run_root)
