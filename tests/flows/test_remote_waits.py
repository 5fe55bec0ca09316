"""What the flows run beside a resident worker's stage starts once the flow only waits for it
(``rft_core.workers.waiting``): the training flow's record of each iteration's metrics (its writes
and its curve), the rewards beside the reference pass and the next iteration's prompts beside
the update (``flows.iteration._after_remote_start``), so they never take the GIL and the cores in
turns with the flow's own work between two stages (issue 44)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from rft_core.workers.waiting import remote_stage, remote_stages_started, until_remote_stage, wake
from tests.flows.conftest import flow_cfg


def _recorder(tiny_model, run_root: Path, workers: str):
    from flows.train import _Recorder

    # the curve is not due after iteration 1 of 10: the record writes metrics.jsonl and TensorBoard only
    return _Recorder(flow_cfg(tiny_model, run_root, iterations=10, **{"orchestration.workers": workers,
                                                                      "observe.curve_every_s": 1e6}))


ROWS = [{"iteration": 1, "reward_mean": 0.25, "kl": 0.5}]


def test_until_remote_stage_returns_once_a_wait_starts_and_counts_overlapping_waits():
    stop, seen = threading.Event(), []
    t0 = time.monotonic()
    assert until_remote_stage(0.2, stop) is False and time.monotonic() - t0 >= 0.19  # no wait: the timeout
    waiter = threading.Thread(target=lambda: seen.append(until_remote_stage(10.0, stop)))
    waiter.start()
    time.sleep(0.1)
    assert seen == []  # still waiting: nothing waits for a remote stage
    with remote_stage():
        waiter.join(5.0)
        assert seen == [True]
        with remote_stage():  # the scoring stages' waits overlap on their own threads
            pass
        assert until_remote_stage(0.0, stop) is True  # the outer wait is still in progress
    assert until_remote_stage(0.0, stop) is False
    stop.set()
    waiter = threading.Thread(target=lambda: seen.append(until_remote_stage(10.0, stop)))
    t0 = time.monotonic()
    waiter.start()
    wake()
    waiter.join(5.0)
    assert seen == [True, False] and time.monotonic() - t0 < 5.0  # stop set: returns at once, no remote stage


def test_a_resident_runs_record_starts_once_the_flow_waits_for_a_worker(tiny_model, tmp_path):
    rec = _recorder(tiny_model, tmp_path / "run", "resident")
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        rec.submit(ROWS)
        time.sleep(0.3)
        assert not metrics.exists() and not rec.recorded.done()  # the flow's own work: nothing written beside it
        with remote_stage():  # the next iteration's flow now waits for its rollout's worker
            uri, curve = rec.recorded.result(timeout=30)
        assert uri.endswith("metrics.jsonl") and curve is None and metrics.read_text().count("\n") == 1
    finally:
        rec.close()


def test_without_resident_workers_a_record_starts_at_once(tiny_model, tmp_path):
    rec = _recorder(tiny_model, tmp_path / "run", "stage")
    try:
        rec.submit(ROWS)
        assert rec.recorded.result(timeout=10)[0].endswith("metrics.jsonl")  # no remote stage to wait for
    finally:
        rec.close()


@pytest.mark.parametrize("workers", ["resident", "stage"])
def test_a_record_needed_now_waits_for_nothing(tiny_model, tmp_path, workers):
    """The next ``submit`` and ``close`` need the pending record (a resumed run's reused
    iterations run no stage)."""
    rec = _recorder(tiny_model, tmp_path / "run", workers)
    t0 = time.monotonic()
    rec.submit(ROWS)
    rec.submit(ROWS + [{"iteration": 2, "reward_mean": 0.5, "kl": 0.25}])  # waits for the first record
    rec.close()  # waits for the second
    assert time.monotonic() - t0 < rec.REMOTE_WAIT_S / 3
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


def test_until_remote_stage_since_sees_a_wait_that_already_ended():
    since = remote_stages_started()
    with remote_stage():  # a short call (a reused stage) that ends before anyone looks
        pass
    assert until_remote_stage(0.0, since=since) is True
    assert until_remote_stage(0.0, since=remote_stages_started()) is False


class _Future:
    """What ``_after_remote_start`` uses of a PrefectFuture (``add_done_callback``, prefect/futures.py)."""

    def __init__(self) -> None:
        self.inner: Future = Future()

    def add_done_callback(self, fn) -> None:
        self.inner.add_done_callback(lambda _: fn(self))


def _returned_after(call, trigger, delay_s: float = 0.3) -> float:
    """Seconds ``call()`` took while ``trigger()`` runs ``delay_s`` after it started, on a thread."""
    timer = threading.Timer(delay_s, trigger)
    t0 = time.monotonic()
    timer.start()
    try:
        call()
        return time.monotonic() - t0
    finally:
        timer.cancel()


def test_after_remote_start_waits_for_a_worker_stage_begun_since_or_a_future_that_ended():
    from flows.iteration import REMOTE_START_S, _after_remote_start

    assert _returned_after(lambda: _after_remote_start([], remote_stages_started()), lambda: None) < 0.2  # nothing to wait for
    entered, leave = threading.Event(), threading.Event()

    def worker_stage():  # the update's task thread, now waiting for its worker
        with remote_stage():
            entered.set()
            leave.wait(10)

    since = remote_stages_started()
    took = _returned_after(lambda: _after_remote_start([_Future()], since), threading.Thread(target=worker_stage).start)
    try:
        assert entered.is_set() and 0.25 < took < REMOTE_START_S / 10
    finally:
        leave.set()
    failed = _Future()  # its task failed before its worker ran it: no remote stage will begin
    took = _returned_after(lambda: _after_remote_start([failed], remote_stages_started()),
                           lambda: failed.inner.set_exception(RuntimeError("no worker")))
    assert 0.25 < took < REMOTE_START_S / 10
