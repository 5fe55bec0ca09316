"""The rotation (issue 46): every SIGKILL row, and every long test marked for it, runs in CI at
least once in every 8 consecutive landings, without CI paying for all of them every time.

A long test joins it with ``@pytest.mark.rotation(k)`` (its group, chosen by hand from
``tests/durations.txt`` so that the groups' seconds come out close); SIGKILL rows join by
themselves, as follows.

A SIGKILL row is a test whose function's name starts with ``test_sigkill`` (``ROW_PREFIX``),
one per parameter set. Each belongs to one of ``GROUPS`` groups, unless ``tests.faults.row`` built
it with ``ci=True`` (then every run runs it). Within its test module the rows take the groups one
after another, starting at the module's offset (``OFFSETS``; for a module not listed, crc32 of its
name mod ``GROUPS``): first the rows built by ``tests.faults.row``, in the order they are declared,
then any other ``test_sigkill*`` test, in collection order (``tests/conftest.py`` marks those). So a
module's rows spread evenly over the groups, and a row added in any style joins the rotation by
itself. A run runs the rows of one group (plus the ``ci=True`` ones): group = turn mod ``GROUPS``,
where the turn is ``RFT_ROTATION`` (an integer, e.g. a CI build number) if set, else the integer
in ``tests/rotation_turn`` (``TURN_FILE``), which every landing moves on by one
(``make rotation-next``, once per landing, whatever number of commits it adds): so the CI runs of 8
consecutive landings run every row. A landing that forgets runs the previous group again (late,
never skipped). Counting commits instead would skip groups: one landing adds several.

``RFT_FAULTS_ALL=1`` (``make test-faults-all``) runs every row. ``tests/conftest.py`` skips the
rows of the other groups (reason ``SKIP_REASON ...``) and prints the choice and the rows it runs
at the start and at the end of the run.
"""
from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = 8
ENV = "RFT_ROTATION"
ALL_ENV = "RFT_FAULTS_ALL"
TURN_FILE = ROOT / "tests" / "rotation_turn"
SKIP_REASON = "rotation:"
ROW_PREFIX = "test_sigkill"
# The first group of each module's rows that ``tests.faults.row`` places itself (no ``group=``);
# a module not listed starts at crc32(name) % GROUPS. Today only tests/test_faults.py's 20 stage
# rows are placed so (2 or 3 per group, ~55 s each on 2 cores). The rows that share an expensive
# baseline name their groups (``row(..., group=k)``), so fewer groups pay for it: the resident
# rows (baseline ~85-110 s, a row ~85-175 s) groups 5, 6, 7 and 0, the FSDP2 rows (baseline ~3 min,
# a row ~4 min) 1 and 2, the resident critic gang's row (with its baseline ~2 min) 0, the S3 rows 3 and 4, the asynchronous rows 4 and the partial-rollout row 7;
# the long tests marked ``rotation(k)`` fill the groups with the fewest. Each group's seconds on
# 2 cores, measured (tests/durations.txt's history; groups alone with ``RFT_ROTATION=k -m
# rotation``: 4 and 5 on 2026-11-28/29, 5, 6 and 7 again on 2026-11-29 after the resident runs
# began to create their workers together, which took ~20 s off each resident row) and moved since:
# 0 ~840 (769 and 794 in the 2026-11-29 17:41 and 18:37 records, the two tests that joined it included, plus the
# stage-mode checkpoint.every row since 2026-11-30, ~60 s on the shared baseline), 1 ~890, 2 ~905, 3 ~895, 4 ~900 (757 its landing's
# record, with the S3 bucket run's inspect and replay tests since, and the resident flow's
# equality test, 56 s, out of every run since 2026-11-29, and the resident FSDP2 flow test, 54 s,
# out of group 7 since 2026-11-29 15:50), 5 ~880 (706 in the 2026-11-29 07:11 record, plus 3
# deployment tests, 73 s with the Prefect stack's start, out of group 6, and the stage-mode
# background checkpoint row, ~60 s, since), 6 ~885 (849 in the 2026-11-29 11:57 record; 621 at
# 09:25 without its 4 deployment tests and its DeepSpeed critic test, then in 5 and 7, plus the
# deployment retry test since, 174 s with the stack's start), 7 ~930 (984 in the 2026-11-29 15:16
# record, its resident rows 111-231 s each, less the FSDP2 flow test moved to 4). On 2026-11-29
# (17:10 UTC) 11 long tests that ran in every run joined groups 0, 1, 3, 5 and 6 (~128 s in all,
# each group's figure above counts them; a sibling of each runs every time, its mark says which):
# the tests every run runs, 819 s at 15:16, 616-617 s in the 17:41 and 18:37 records (with that day's cheaper
# curve, TensorBoard and tokenizer loads). A resident row costs 85-185 s here (a
# kill that misses a short stage is tried again from a fresh run), a stage row 35-85 s: one
# landing takes ~616 + ~770-930 s, 23-26 min here and ~27-31 min in CI (CI against here: 1.27x for
# group 5's landing of 2026-11-29, 1.13x for group 7's; 1.19x before). On 2026-12-02 the resident
# critic gang's tests joined groups 0 (ZeRO-3, ~77 s), 7 (FSDP2, ~62 s) and 3 (the flow's [gang],
# ~37 s): 0 ~917, 3 ~930, 7 ~992.
OFFSETS = {"tests.test_faults": 0}
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


@lru_cache(maxsize=1)
def choice() -> Choice:
    """This run's ``Choice`` (see the module doc), computed once.

    Raises:
        ValueError: ``RFT_ROTATION`` or ``tests/rotation_turn`` does not hold an integer (naming which).
    """
    if os.environ.get(ALL_ENV) == "1":
        return Choice(None, None, f"{ALL_ENV}=1")
    if os.environ.get(ENV, "").strip():
        text, source = os.environ[ENV].strip(), ENV
    else:
        text, source = TURN_FILE.read_text().strip(), str(TURN_FILE.relative_to(ROOT))
    if not text.isdigit():
        raise ValueError(f"{source} must hold a non-negative integer (the rotation's turn), not {text!r}")
    turn = int(text)
    return Choice(turn % GROUPS, turn, f"{source}={turn}")


def next_turn() -> int:
    """Move the rotation on by one: ``tests/rotation_turn`` + 1 (``make rotation-next``, once per
    landing). Returns the new turn."""
    turn = int(TURN_FILE.read_text().strip()) + 1
    TURN_FILE.write_text(f"{turn}\n")
    return turn


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
    """``python -m tests.rotation --next``: ``next_turn``. ``python -m tests.rotation FAULTS [SUITE]``: each group's seconds from FAULTS (a durations
    file of ``make test-faults-all``, ``RFT_DURATIONS=FAULTS``), the suite's estimate per group
    with SUITE (a durations file of ``make test``: its tests that are not rotation rows), and the
    offsets that would balance the groups best."""
    import argparse

    from tests.durations import parse

    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--next"]:
        print(f"rotation turn {next_turn()}: group {choice.__wrapped__().group} of {GROUPS}")
        return
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
