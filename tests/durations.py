"""The suite's time on record (issue 46): ``make test-durations`` runs ``make test``'s suite with
``RFT_DURATIONS=tests/durations.txt``, and ``tests/conftest.py`` writes there, at the end, the
run's wall time, its counts, its commit and rotation group, and every test's seconds
(setup + call + teardown; a module-scoped fixture counts in the first test that uses it), slowest
first. README's figure for the suite ("N tests ... M minutes") is taken from that file, and
``tests/test_suite_time.py`` checks that it still is, and that the recorded run stayed within
``BUDGET_MINUTES``.
"""
from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ENV = "RFT_DURATIONS"
FILE = Path(__file__).resolve().parent / "durations.txt"
BUDGET_MINUTES = 35  # issue 46: make test under 35 minutes on 2 cores, with room for the tests to come
# the file this pytest session records to (tests/conftest.py sets it from ENV); None: not recording
RECORDING_TO: str | None = None
# why tests/test_suite_time.py's checks of the record skip in a recording run (tests/skips.py allows it)
RECORDING_SKIP = ("this run rewrites tests/durations.txt (make test-durations): the record it would check is the "
                  "previous one; `python -m tests.durations` checks the new record")


@dataclass(frozen=True)
class Entry:
    """One test of the run: its seconds (setup + call + teardown), of which ``setup`` went to its
    fixtures (a module-scoped baseline counts in the first test that uses it), its outcome, and
    its rotation group (None: not a rotation row; -1: a row of every run)."""

    seconds: float
    setup: float
    outcome: str
    group: int | None
    nodeid: str


@dataclass
class Record:
    """What ``tests/durations.txt`` holds."""

    wall_s: float
    collected: int
    outcomes: dict[str, int]
    header: dict[str, str] = field(default_factory=dict)
    tests: list[Entry] = field(default_factory=list)

    @property
    def minutes(self) -> int:
        return round(self.wall_s / 60)


def _group(g: int | None) -> str:
    return "-" if g is None else ("all" if g == -1 else str(g))


def render(rec: Record) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(rec.outcomes.items()))
    lines = ["# The suite's time: written by `make test-durations` (tests/durations.py); README's figure comes from here.",
             *[f"# {k}: {v}" for k, v in rec.header.items()],
             f"# wall: {rec.wall_s:.1f} s ({rec.minutes} min)",
             f"# tests: {rec.collected} collected; {counts}",
             "# seconds (setup + call + teardown), of them setup, outcome, rotation group "
             "(-: not a row, all: every run), test; slowest first"]
    lines += [f"{e.seconds:9.2f} {e.setup:8.2f}  {e.outcome:7}  {_group(e.group):>3}  {e.nodeid}"
              for e in sorted(rec.tests, key=lambda e: (-e.seconds, e.nodeid))]
    return "\n".join(lines) + "\n"


def parse(text: str) -> Record:
    header, tests, wall, collected, outcomes = {}, [], None, None, {}
    for line in text.splitlines():
        if line.startswith("# wall: "):
            wall = float(line.split()[2])
        elif line.startswith("# tests: "):
            m = re.match(r"# tests: (\d+) collected; (.*)", line)
            collected = int(m.group(1))
            outcomes = {k: int(n) for n, k in (p.split(" ", 1) for p in m.group(2).split(", ") if p)}
        elif line.startswith("# ") and ": " in line and not line.startswith(("# seconds", "# The suite")):
            k, v = line[2:].split(": ", 1)
            header[k] = v
        elif line.strip() and not line.startswith("#"):
            sec, setup, outcome, group, nodeid = line.split(None, 4)
            tests.append(Entry(float(sec), float(setup), outcome,
                               None if group == "-" else (-1 if group == "all" else int(group)), nodeid))
    if wall is None or collected is None:
        raise ValueError("not a durations file: no '# wall:' or '# tests:' line")
    return Record(wall, collected, outcomes, header, tests)


class Recorder:
    """Collects each test's seconds and outcome during a run (the hooks in tests/conftest.py)."""

    def __init__(self) -> None:
        self.start = dt.datetime.now(dt.timezone.utc)
        self.load = os.getloadavg()[0]
        self.seconds: dict[str, float] = {}
        self.setup: dict[str, float] = {}
        self.outcome: dict[str, str] = {}
        self.groups: dict[str, int | None] = {}
        self.collected = 0

    def report(self, report) -> None:
        """One phase (setup, call, teardown) of a test: its seconds add up; its outcome is the
        first that was not "passed" (a failed setup or teardown: "error")."""
        seconds = float(getattr(report, "duration", 0.0))
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + seconds
        if report.when == "setup":
            self.setup[report.nodeid] = seconds
        if self.outcome.get(report.nodeid, "passed") == "passed":
            self.outcome[report.nodeid] = "error" if report.failed and report.when != "call" else report.outcome

    def write(self, path: Path, header: dict[str, str]) -> Record:
        wall = (dt.datetime.now(dt.timezone.utc) - self.start).total_seconds()
        counts: dict[str, int] = {}
        for o in self.outcome.values():
            counts[o] = counts.get(o, 0) + 1
        rec = Record(wall, self.collected, counts,
                     {"date": self.start.strftime("%Y-%m-%d %H:%M UTC"), **header,
                      "machine": f"{os.cpu_count()} cores, load average {self.load:.1f} at the start"},
                     [Entry(s, self.setup.get(n, 0.0), self.outcome.get(n, "?"), self.groups.get(n), n)
                      for n, s in self.seconds.items()])
        path.write_text(render(rec))
        return rec


README = Path(__file__).resolve().parents[1] / "README.md"
# README's figure: "`make test` runs everything (N tests in M minutes on a 2-core machine"
README_FIGURE = re.compile(r"`make test` runs everything \((\d+) tests in (\d+) minutes on a (\d+)-core machine")


def readme_figure(rec: Record) -> str:
    cores = re.search(r"(\d+) cores", rec.header.get("machine", ""))
    return (f"`make test` runs everything ({rec.collected} tests in {rec.minutes} minutes on a "
            f"{cores.group(1) if cores else '?'}-core machine")


def main() -> None:
    """``python -m tests.durations``: write README's figure from tests/durations.txt.

    Raises SystemExit naming the failed tests when the recorded run had any (its figure would not
    land: tests/test_suite_time.py refuses such a record)."""
    rec = parse(FILE.read_text())
    bad = [e.nodeid for e in rec.tests if e.outcome in ("failed", "error")]
    if bad:
        raise SystemExit(f"{FILE} records a run with {len(bad)} failed test(s), which CI refuses "
                         f"(tests/test_suite_time.py): fix them and run `make test-durations` again:\n  "
                         + "\n  ".join(bad))
    text = README.read_text()
    if not README_FIGURE.search(text):
        raise SystemExit("README.md has no figure to update (README_FIGURE)")
    README.write_text(README_FIGURE.sub(readme_figure(rec), text, count=1))
    print(readme_figure(rec))


if __name__ == "__main__":
    main()
