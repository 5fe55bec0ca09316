"""This process's background writer of checkpoint stages: one thread, at a lower CPU priority,
that writes and commits an update's optimizer stage and, when the weights are written in the
background too (``checkpoint.async_weights``), its ``{update}-policy`` stage after it, while the
next stages run (``rft_core.stages.optimizer_state`` queues them).

It sits below the modules that read checkpoints (``rft_core.stages.checkpoints``), which join a
pending write of the weights they are asked for (``wait_for_optimizer_writes``) or, for a model
kept in memory, skip the check of files still being written (``pending``). Each pending write is
keyed by the URI of the stage it commits; it records whether it reads a copy of the caller's
tensors made when it was queued (``copied``: the caller may change its own) and which reused
host buffers that copy lies in (``buffers``, ``optimizer_state.stage_on_host``).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, NamedTuple


class OptimizerStateError(RuntimeError):
    """The optimizer state a ``ppo_update`` needs is missing, or a background write of an
    update's state (its optimizer stage, its weights) failed."""


class _Write(NamedTuple):
    """A background write queued by ``submit``: its future; whether it reads a copy made when it
    was queued rather than the caller's tensors (``reading_tensors`` leaves it out); the name of
    the reused host buffers holding that copy (None: its own buffers, or no copy)."""
    future: Future
    copied: bool
    buffers: str | None = None


_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_PENDING: dict[str, _Write] = {}


def _lower_priority() -> None:
    """Run the writer thread at nice +10 (Linux: per thread). It has until the next update to
    finish; meanwhile the stages on the critical path (generation) get the CPU first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
        pass


def submit(uri: str, fn: Callable[..., Any], *args: Any, copied: bool = False, buffers: str | None = None) -> None:
    """Queue ``fn(*args)`` on this process's writer thread (one at a time, in submission order,
    at a lower CPU priority) as the pending write of the stage ``uri``; ``copied``: it reads a
    copy of the caller's tensors, lying in the reused host buffers ``buffers`` (if any)."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rft-optimizer-state",
                                           initializer=_lower_priority)
        _PENDING[uri.rstrip("/")] = _Write(_EXECUTOR.submit(fn, *args), copied, buffers)


def pending(uris: Iterable[str]) -> list[str]:
    """Those of ``uris`` with a write queued in this process that no ``wait_for_optimizer_writes``
    has joined yet, finished or not, in the order given."""
    with _LOCK:
        return [u for u in uris if u.rstrip("/") in _PENDING]


def reading_tensors(uris: Iterable[str]) -> list[str]:
    """Those of ``pending(uris)`` that read the caller's own tensors (not a copy)."""
    with _LOCK:
        return [u for u in uris if u.rstrip("/") in _PENDING and not _PENDING[u.rstrip("/")].copied]


def buffers_in_use(buffers: str) -> bool:
    """Whether a write still running reads the reused host buffers named ``buffers``."""
    with _LOCK:
        return any(w.buffers == buffers and not w.future.done() for w in _PENDING.values())


def wait_for_optimizer_writes(uri: str | None = None) -> None:
    """Block until the pending background write of ``uri`` (None: every pending write: optimizer
    stages and background policy checkpoints) has finished. A no-op when none is pending.

    Raises:
        OptimizerStateError: a write failed (names the stage and the cause); it is reported
            once, and resuming the run recomputes that state.
    """
    with _LOCK:
        pending_now = {u: w.future for u, w in _PENDING.items() if uri is None or u == uri.rstrip("/")}
    first: tuple[str, BaseException] | None = None
    for u, fut in pending_now.items():
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the stage named
            first = first or (u, exc)
        finally:
            with _LOCK:
                if u in _PENDING and _PENDING[u].future is fut:
                    del _PENDING[u]
    if first is not None:
        u, exc = first
        raise OptimizerStateError(f"{u}: the background write of this stage failed: {exc!r}. Nothing committed is lost; "
                                  "rerunning the flow recomputes this state") from exc
