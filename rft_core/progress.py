"""Progress of long stage loops (rollout batches, update steps, log-prob micro-batches).

``progress_reporter`` gives a ``(done, total)`` callback: a rich progress bar when stdout is a
terminal, otherwise throttled log lines through a callback (default: the ``rft_core.progress``
logger; a Prefect task passes nothing and gets the lines in its log through logging, a stage
subprocess prints them and the launcher streams them into the task log). Never imports prefect.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Callable, Iterator

log = logging.getLogger("rft_core.progress")

ProgressFn = Callable[[int, int], None]
# rich allows one live display at a time; stages running concurrently in threads (actor and
# reference log-probs) fall back to log lines while another one shows its bar
_BAR = threading.Lock()


class LogProgress:
    """``(done, total)`` callback writing ``"<description>: done/total unit (pct%), elapsed"``
    through ``log`` at most every ``every_seconds`` seconds, and always at completion."""

    def __init__(self, description: str, *, unit: str = "", log_fn: Callable[[str], None] | None = None,
                 every_seconds: float = 10.0) -> None:
        self.description, self.unit = description, unit
        self.log_fn = log_fn or log.info
        self.every = every_seconds
        self.t0 = time.perf_counter()
        self.last = float("-inf")
        self.lines: list[str] = []

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < self.every:
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        line = f"{self.description}: {done}/{total}{' ' + self.unit if self.unit else ''} ({pct:.0f}%), {now - self.t0:.1f}s"
        self.lines.append(line)
        self.log_fn(line)


@contextlib.contextmanager
def progress_reporter(description: str, *, unit: str = "", log_fn: Callable[[str], None] | None = None,
                      every_seconds: float = 10.0, use_bar: bool | None = None) -> Iterator[ProgressFn]:
    """Context manager yielding a ``(done, total)`` callback.

    Args:
        use_bar: True: a rich progress bar; False: log lines; None: a bar when stdout is a
            terminal. A bar is shown only if no other one is (else log lines).
    """
    if use_bar is None:
        use_bar = sys.stdout.isatty()
    if not use_bar or not _BAR.acquire(blocking=False):
        yield LogProgress(description, unit=unit, log_fn=log_fn, every_seconds=every_seconds)
        return
    try:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                      TimeElapsedColumn(), TimeRemainingColumn()) as bar:
            task = bar.add_task(description, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            yield update
    finally:
        _BAR.release()
