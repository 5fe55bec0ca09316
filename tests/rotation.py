"""The SIGKILL rotation (issue 46): every fault row runs in CI at least once in every 8 consecutive
runs, without CI paying for all of them every time.

A SIGKILL row is a test whose function's name starts with ``test_sigkill`` (``ROW_PREFIX``),
one per parameter set. Each belongs to one of ``GROUPS`` groups, unless ``tests.faults.row`` built
it with ``ci=True`` (then every run runs it). Within its test module the rows take the groups one
after another, starting at the module's offset (``OFFSETS``; for a module not listed, crc32 of its
name mod ``GROUPS``): first the rows built by ``tests.faults.row``, in the order they are declared,
then any other ``test_sigkill*`` test, in collection order (``tests/conftest.py`` marks those). So a
module's rows spread evenly over the groups, and a row added in any style joins the rotation by
itself. A run runs the rows of one group (plus the ``ci=True`` ones): group = turn mod ``GROUPS``,
where the turn is, first that applies:

1. ``RFT_ROTATION`` (an integer, e.g. a CI build number);
2. the number of first-parent commits up to HEAD (``git rev-list --count --first-parent HEAD``):
   each commit on main moves the rotation on by one group, so CI runs of 8 consecutive commits of
   main (one per landing: a merge commit, or a squash) run every row. A landing that adds several
   first-parent commits at once skips groups; CI then sets ``RFT_ROTATION`` to its run number;
3. in a shallow clone (which cannot count): the UTC day of HEAD's commit time (days since
   1970-01-01), so commits of 8 consecutive days run every row;
4. without git (an exported tarball): the UTC day now, so runs on 8 consecutive days do.

``RFT_FAULTS_ALL=1`` (``make test-faults-all``) runs every row. ``tests/conftest.py`` skips the
rows of the other groups (reason ``SKIP_REASON ...``) and prints the choice and the rows it runs
at the start and at the end of the run.
"""
from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = 8
ENV = "RFT_ROTATION"
ALL_ENV = "RFT_FAULTS_ALL"
SKIP_REASON = "SIGKILL rotation:"
ROW_PREFIX = "test_sigkill"
# The first group of each module's rows, chosen so that the groups' seconds come out close
# (`python -m tests.rotation FAULTS` computes them, and the offsets that balance them best, from
# a durations file of `make test-faults-all`). These come from the rows' seconds known on
# 2026-11-28 (2 quiet cores: a stage-mode row ~45 s, a resident row ~80 s and its two-run baseline
# ~76 s, an async or S3 row ~60 s, an FSDP2 row ~4 min and its baseline ~3 min): the two FSDP2
# rows go to groups 4 and 5, which get the fewest other rows. A module not listed starts at
# crc32(name) % GROUPS.
OFFSETS = {"tests.test_faults": 0, "tests.test_faults_resident": 1, "tests.test_faults_async": 6,
           "tests.test_object_storage": 6, "tests.test_faults_fsdp": 4}
_next: dict[str, int] = {}


@dataclass(frozen=True)
class Choice:
    """The group this run runs (None: every row) and how it was chosen."""

    group: int | None
    turn: int | None
    source: str

    def runs(self, group: int | None) -> bool:
        return group is None or self.group is None or group == self.group

    def describe(self) -> str:
        if self.group is None:
            return f"every row ({self.source})"
        return f"group {self.group} of {GROUPS} (turn {self.turn} from {self.source}; turn mod {GROUPS})"


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


@lru_cache(maxsize=1)
def choice() -> Choice:
    """This run's ``Choice`` (see the module doc), computed once."""
    if os.environ.get(ALL_ENV) == "1":
        return Choice(None, None, f"{ALL_ENV}=1")
    if os.environ.get(ENV, "").strip():
        turn = int(os.environ[ENV])
        return Choice(turn % GROUPS, turn, f"{ENV}={turn}")
    head = _git("rev-parse", "--short", "HEAD")
    if head is not None and _git("rev-parse", "--is-shallow-repository") != "true":
        count = _git("rev-list", "--count", "--first-parent", "HEAD")
        if count is not None and count.isdigit():
            return Choice(int(count) % GROUPS, int(count), f"git: {count} first-parent commits up to {head}")
    if head is not None:  # a shallow clone counts only its own commits: the day of the commit instead
        day = int(_git("log", "-1", "--format=%ct", "HEAD") or 0) // 86400
        return Choice(day % GROUPS, day, f"shallow clone: UTC day {day} of commit {head}")
    day = (dt.datetime.now(dt.timezone.utc).date() - dt.date(1970, 1, 1)).days
    return Choice(day % GROUPS, day, f"no git here: UTC day {day}")


def offset(module: str) -> int:
    return OFFSETS[module] if module in OFFSETS else zlib.crc32(module.encode()) % GROUPS


def assign(module: str) -> int:
    """The group of the next rotating row declared in ``module``."""
    index = _next.get(module, 0)
    _next[module] = index + 1
    return (offset(module) + index) % GROUPS


def caller_module(depth: int = 2) -> str:
    """``__name__`` of the module whose code called the caller (a list comprehension's frame has
    its module's globals too)."""
    return sys._getframe(depth).f_globals.get("__name__", "?")


def group_costs(entries, shifts: dict[str, int] | None = None) -> list[float]:
    """Seconds of each group's SIGKILL rows, from ``tests.durations.Entry``s of a run of every row
    (``RFT_DURATIONS=... make test-faults-all``), with each module's groups shifted by
    ``shifts[module]`` (its offset changed by that much). A row costs its seconds less its setup;
    each baseline (a test function's module-scoped fixture: the largest setup among its rows) is
    paid once by every group that has a row of that function."""
    shifts = shifts or {}
    costs, baselines = [0.0] * GROUPS, {}
    for e in entries:
        baselines[e.nodeid.split("[")[0]] = max(baselines.get(e.nodeid.split("[")[0], 0.0), e.setup)
    paid: list[set] = [set() for _ in range(GROUPS)]
    for e in entries:
        g = (e.group + shifts.get(_module(e.nodeid), 0)) % GROUPS
        costs[g] += e.seconds - e.setup
        paid[g].add(e.nodeid.split("[")[0])
    return [c + sum(baselines[f] for f in p) for c, p in zip(costs, paid)]


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0].removesuffix(".py").replace("/", ".")


def best_shifts(entries) -> dict[str, int]:
    """The offset changes per module that make the costliest group cheapest (then the next, ...)."""
    import itertools

    modules = sorted({_module(e.nodeid) for e in entries})
    best = min(itertools.product(range(GROUPS), repeat=len(modules)),
               key=lambda d: sorted(group_costs(entries, dict(zip(modules, d))), reverse=True))
    return dict(zip(modules, best))


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.rotation FAULTS [SUITE]``: each group's seconds from FAULTS (a durations
    file of ``make test-faults-all``, ``RFT_DURATIONS=FAULTS``), the suite's estimate per group
    with SUITE (a durations file of ``make test``: its tests that are not rotation rows), and the
    offsets that would balance the groups best."""
    import argparse

    from tests.durations import parse

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("faults")
    ap.add_argument("suite", nargs="?")
    args = ap.parse_args(argv)
    entries = [e for e in parse(Path(args.faults).read_text()).tests if e.group is not None and e.group >= 0]
    rest = 0.0
    if args.suite:
        rest = sum(e.seconds for e in parse(Path(args.suite).read_text()).tests if e.group is None or e.group == -1)
        print(f"the suite without its rotating rows: {rest:.0f} s ({rest / 60:.1f} min)")
    for k, c in enumerate(group_costs(entries)):
        rows = sorted(e.nodeid for e in entries if e.group == k)
        print(f"group {k}: {c:.0f} s of SIGKILL rows" + (f", suite ~{(rest + c) / 60:.1f} min" if args.suite else "")
              + "".join(f"\n    {r}" for r in rows))
    shifts = best_shifts(entries)
    print("balanced: OFFSETS = {" + ", ".join(f"{m!r}: {(offset(m) + d) % GROUPS}" for m, d in shifts.items()) + "}; "
          f"groups {[round(c) for c in group_costs(entries, shifts)]} s")


if __name__ == "__main__":
    main()
