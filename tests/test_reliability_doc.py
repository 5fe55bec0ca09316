"""docs/reliability.md's SIGKILL tables (written by benchmarks/reliability.py, issue 46): every
row landed where it says (its landed column names the row's own iteration and stage, and no cell
reads **NO**), and every row is one the tests run (tests/faults.py's row functions, the same
seeds), so the tables cannot drift from the tests."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
SECTIONS = ("sigkill", "resident", "fsdp", "async", "s3")


def _tables(section: str) -> list[list[dict[str, str]]]:
    """The markdown tables of a generated section, each a list of {column: cell}."""
    m = re.search(rf"<!-- begin:{section} -->\n(.*?)<!-- end:{section} -->", DOC.read_text(), re.S)
    assert m, f"docs/reliability.md has no generated section {section!r}: run benchmarks/reliability.py --parts {section}"
    tables, header = [], None
    for line in m.group(1).splitlines() + [""]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells
            tables.append([])
        elif not set("".join(cells)) <= set("-: "):
            tables[-1].append(dict(zip(header, cells)))
    return tables


def _documented(section: str) -> list[dict[str, str]]:
    return [r for t in _tables(section) for r in t if "target stage" in r]


def _test_rows(section: str) -> set[tuple[str, str, str, str]]:
    """(target, iteration, phase, killed) of the rows the tests of ``section`` run."""
    from tests import test_faults, test_faults_async, test_faults_fsdp, test_faults_resident, test_object_storage

    if section == "sigkill":  # and the driver killed during iteration 1's background weights write (async_weights)
        return ({(t, str(i), p, "driver") for t, i, p in (tuple(r.values) for r in test_faults.ROWS)}
                | {("rollout", str(r.values[0]), "compute", "driver") for r in test_faults.AGENT_ROWS}
                | {("ppo_update-policy", "1", "write", "driver")})
    if section == "resident":  # and the driver killed during iteration 3's background checkpoint write
        return ({(t, "2", "compute", k) for t, k in (tuple(r.values) for r in test_faults_resident.ROWS)}
                | {("ppo_update-policy", "3", "write", "driver")})
    if section == "fsdp":
        return {(t, "2", "compute", k) for t, k in (tuple(r.values) for r in test_faults_fsdp.ROWS)}
    if section == "async":  # and the partial rollout's row
        return ({(t, str(i), "compute", "driver") for t, i, _ in (tuple(r.values) for r in test_faults_async.ROWS)}
                | {("rollout", "2", "compute", "driver")})
    return {(t, "1", p, "driver") for t, p in (tuple(r.values) for r in test_object_storage.S3_ROWS)}


@pytest.mark.parametrize("section", SECTIONS)
def test_every_documented_sigkill_row_landed_where_it_says(section):
    rows = _documented(section)
    assert rows, f"no SIGKILL table in section {section}: run benchmarks/reliability.py --parts {section}"
    for r in rows:
        assert "landed (tries)" in r and "redone" in r, f"{section}: a table without the landed/redone columns: {r}"
        where = f"{r['iter']}: {r['target stage']}"
        assert r["landed (tries)"].startswith(where + " ") or r["landed (tries)"].startswith(where + " +"), \
            f"{section}: the kill did not land where the row says ({where}): {r}"
        assert "**NO**" not in " | ".join(r.values()), f"{section}: {r}"


@pytest.mark.parametrize("section", SECTIONS)
def test_every_documented_row_is_a_row_of_the_tests(section):
    pytest.importorskip("ray")
    documented = {(r["target stage"], r["iter"], r["phase"].removesuffix(" (paused)"), r["killed"])
                  for r in _documented(section)}
    tests = _test_rows(section)
    assert documented <= tests, f"{section}: rows in the doc that no test runs: {sorted(documented - tests)}"
    if tests - documented:  # a row added since the tables were written: benchmarks/reliability.py adds it
        print(f"{section}: rows not in docs/reliability.md yet: {sorted(tests - documented)}")
