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

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("rft_core.workers")
BESIDE_NICE = 10  # how much a thread that runs beside the stages raises its nice value (``lower_thread_priority``)
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


def lower_thread_priority(nice: int = BESIDE_NICE) -> bool:
    """Raise the calling thread's nice value by ``nice`` (at most to 19; Linux, where nice is a per-thread attribute:
    ``setpriority(2)``'s notes), for a thread that only runs work beside the stages (the metrics
    record, the rewards and the next prompts while a worker computes): on a machine with few
    cores it then takes no core from the worker or from the flow's work between two stages, and
    with idle cores it runs as fast as before. For good: an unprivileged thread cannot raise its
    priority again, so only a thread of its own should call this (a ``ThreadPoolExecutor``'s
    ``initializer``). Returns whether it was set (False off Linux, or refused: logged)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.debug("could not lower the priority of thread %s: %s", threading.current_thread().name, exc)
        return False
    return True
