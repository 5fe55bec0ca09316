"""When this process (a run's driver) only waits: while a resident worker runs a stage for it.

The driver's own work between two stage programs (Prefect's task engine, Ray's calls, the shard
reads of the stages that run here) is Python that needs the GIL; work beside it on a thread of
the same process (the metrics curve drawn with matplotlib, 0.5-0.9 s on a 2-core CPU) takes the
GIL in turns with it and made each such boundary 30-100 ms longer (docs/benchmarks.md, issue 44).
While the driver is blocked in a resident worker's call it holds no GIL, so such work waits for
that (``until_remote_stage``): the metrics record of the training flow, and the stages the
iteration flow runs here beside a worker's (the rewards beside the reference pass, the next
iteration's prompts beside the update). ``rft_core.workers.pool.run_resident`` marks its waits
(``remote_stage``). Nothing here knows Prefect.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_COND = threading.Condition()
_waiting = 0  # calls of this process now blocked on a stage a resident worker runs
_started = 0  # such waits begun in this process so far


@contextmanager
def remote_stage() -> Iterator[None]:
    """Mark the block as a wait for a stage that runs in another process (a resident worker's
    call): ``until_remote_stage`` returns while one is in progress. Nestable and thread-safe
    (the scoring stages wait on threads of their own, side by side)."""
    global _waiting, _started
    with _COND:
        _waiting += 1
        _started += 1
        _COND.notify_all()
    try:
        yield
    finally:
        with _COND:
            _waiting -= 1


def remote_stages_started() -> int:
    """How many waits for a remote stage (``remote_stage``) this process has begun so far: the
    ``since`` of an ``until_remote_stage`` that must see a wait begun after this point."""
    with _COND:
        return _started


def until_remote_stage(timeout_s: float, stop: threading.Event | None = None, *, since: int | None = None) -> bool:
    """Block until this process waits for a remote stage (``remote_stage``), or with ``since``
    (``remote_stages_started`` at some point) until one has begun after that point (also one
    that already ended: a short call is not missed), ``stop`` is set (then call ``wake`` after
    setting it) or ``timeout_s`` seconds passed. Returns whether such a wait was seen."""
    def seen() -> bool:
        return _waiting > 0 if since is None else _started > since

    with _COND:
        _COND.wait_for(lambda: seen() or (stop is not None and stop.is_set()), timeout=timeout_s)
        return seen()


def wake() -> None:
    """Make every ``until_remote_stage`` look at its ``stop`` event again (after setting it)."""
    with _COND:
        _COND.notify_all()
