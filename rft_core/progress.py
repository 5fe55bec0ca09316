"""Progress of long stage loops (rollout batches, update steps, log-prob micro-batches).

``progress_reporter`` gives a ``(done, total, tokens=None)`` callback: log lines at most and at
least every 10 s (a heartbeat while a slow unit runs) through a callback (default: the
``rft_core.progress`` logger; a Prefect task passes nothing and gets the lines in its log through
logging, a stage subprocess prints them and the launcher streams them into the task log), and a
rich progress bar as well when stdout is a terminal. Never imports prefect.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from typing import Callable, Iterator

log = logging.getLogger("rft_core.progress")

ProgressFn = Callable[..., None]  # (done, total, tokens=None)
# rich allows one live display at a time; stages running concurrently in threads (actor and
# reference log-probs) fall back to log lines while another one shows its bar
_BAR = threading.Lock()


class LogProgress:
    """``(done, total, tokens=None)`` callback writing
    ``"<description>: done/total unit (pct%), elapsed s, ETA s[, tokens/s]"`` through ``log`` at
    most every ``every_seconds`` seconds, and always at completion.

    ``tokens``: tokens generated so far (rollout), shown as a rate over the elapsed time. The
    ETA assumes the remaining units take as long as the done ones did (none before the first).
    ``heartbeat()`` writes the current state again when nothing was written for
    ``every_seconds`` (``progress_reporter`` calls it from a timer thread), so a stage whose
    units are slower than that is never silent.
    """

    def __init__(self, description: str, *, unit: str = "", log_fn: Callable[[str], None] | None = None,
                 every_seconds: float = 10.0) -> None:
        self.description, self.unit = description, unit
        self.log_fn = log_fn or log.info
        self.every = every_seconds
        self.t0 = time.perf_counter()
        self.last = float("-inf")
        self.lines: list[str] = []
        self.state: tuple[int, int, int | None] | None = None
        self._lock = threading.Lock()

    def line(self, now: float) -> str:
        """The current state as one line (``state`` must be set)."""
        done, total, tokens = self.state
        elapsed = now - self.t0
        pct = 100.0 * done / total if total else 100.0
        text = f"{self.description}: {done}/{total}{' ' + self.unit if self.unit else ''} ({pct:.0f}%), {elapsed:.1f}s"
        if 0 < done < total:
            text += f", ETA {elapsed * (total - done) / done:.0f}s"
        if tokens is not None and elapsed > 0:
            text += f", {tokens / elapsed:.1f} tokens/s"
        return text

    def _emit(self, now: float) -> None:
        self.last = now
        text = self.line(now)
        self.lines.append(text)
        self.log_fn(text)

    def __call__(self, done: int, total: int, tokens: int | None = None) -> None:
        with self._lock:
            finished_before = self.state is not None and self.state[0] >= self.state[1] == total
            self.state = (done, total, tokens)
            now = time.perf_counter()
            if (done < total and now - self.last < self.every) or (done >= total and finished_before):
                return  # throttled, or the completion line was written already
            self._emit(now)

    def heartbeat(self) -> None:
        """Write the current state (or "started" before any) when the last line is older than
        ``every_seconds``."""
        with self._lock:
            now = time.perf_counter()
            if now - max(self.last, self.t0) < self.every:
                return
            if self.state is None:
                self.last = now
                text = f"{self.description}: started, {now - self.t0:.1f}s, nothing done yet"
                self.lines.append(text)
                self.log_fn(text)
                return
            if self.state[0] < self.state[1]:
                self._emit(now)


@contextlib.contextmanager
def _heartbeat(progress: LogProgress) -> Iterator[None]:
    """Call ``progress.heartbeat()`` every ``progress.every`` seconds from a daemon thread until
    the block ends. The thread runs in a copy of the caller's context, so its lines reach the
    same Prefect task run log (Prefect finds the run through context variables)."""
    if progress.every <= 0:  # every call writes a line already
        yield
        return
    stop = threading.Event()
    context = contextvars.copy_context()

    def beat() -> None:
        while not stop.wait(progress.every):
            progress.heartbeat()

    thread = threading.Thread(target=context.run, args=(beat,), name=f"progress-{progress.description}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def progress_reporter(description: str, *, unit: str = "", log_fn: Callable[[str], None] | None = None,
                      every_seconds: float = 10.0, use_bar: bool | None = None) -> Iterator[ProgressFn]:
    """Context manager yielding a ``(done, total, tokens=None)`` callback.

    Log lines (``LogProgress``) are always written, at most and at least every
    ``every_seconds`` while the block runs (a heartbeat repeats the last state, or says
    "started" before the first callback), so a Prefect task log is never silent longer than
    that; the ``rft_core`` logger goes to the run's log, not to the terminal.

    Args:
        use_bar: True: also a rich progress bar; False: log lines only; None: a bar when stdout
            is a terminal. A bar is shown only if no other one is (rich allows one live display).
    """
    progress = LogProgress(description, unit=unit, log_fn=log_fn, every_seconds=every_seconds)
    if use_bar is None:
        use_bar = sys.stdout.isatty()
    if not use_bar or not _BAR.acquire(blocking=False):
        with _heartbeat(progress):
            yield progress
        return
    try:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                      TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[rate]}")) as bar, \
                _heartbeat(progress):
            task = bar.add_task(description, total=None, rate="")

            def update(done: int, total: int, tokens: int | None = None) -> None:
                elapsed = time.perf_counter() - progress.t0
                rate = f"{tokens / elapsed:.1f} tokens/s" if tokens is not None and elapsed > 0 else ""
                bar.update(task, completed=done, total=total, rate=rate)
                progress(done, total, tokens)

            yield update
    finally:
        _BAR.release()
