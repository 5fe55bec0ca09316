"""The SIGKILL rotation (tests/rotation.py), the skip check (tests/skips.py) and the dependencies
the proofs need (issue 46): every SIGKILL row is in the rotation, 8 consecutive turns run each row
once, the choice comes from tests/rotation_turn (or RFT_ROTATION), a skip beyond
the expected ones fails the run, and Ray and the other dependencies that gate a proof are
installed (without them those proofs would skip themselves)."""
from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import rotation
from tests.skips import unexpected_skips

TESTS = Path(__file__).resolve().parent
# the modules whose tests kill a run with SIGKILL (a test function named test_sigkill*)
FAULT_MODULES = sorted(p for p in TESTS.rglob("test_*.py")
                       if any(isinstance(n, ast.FunctionDef) and n.name.startswith("test_sigkill")
                              for n in ast.walk(ast.parse(p.read_text()))))


def _rows() -> dict[str, int | None]:
    """{node id: group} of every SIGKILL row the fault modules collect (None: every run), from
    the rotation's own listing (RFT_FAULTS_ALL=1: it lists every row with its group); asserts that
    every collected test_sigkill* test is listed."""
    env = {**os.environ, "RFT_FAULTS_ALL": "1"}
    env.pop("RFT_ROTATION", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          *map(str, FAULT_MODULES)], cwd=TESTS.parent, capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    listed = {}
    for line in res.stdout.splitlines():
        m = re.fullmatch(r"  runs (\S+)  \((every run|group (\d))\)", line)
        if m and "::test_sigkill" in m.group(1):  # not the long tests of these modules marked rotation(k)
            listed[m.group(1)] = None if m.group(2) == "every run" else int(m.group(3))
    collected = {line for line in res.stdout.splitlines() if re.match(r"tests/\S+::test_sigkill", line)}
    assert collected and collected == set(listed), f"not in the rotation: {sorted(collected - set(listed))}"
    return listed


def test_every_sigkill_row_is_in_the_rotation_and_8_turns_run_each_once():
    rows = _rows()
    assert len(FAULT_MODULES) >= 4 and len(rows) >= 38, (FAULT_MODULES, len(rows))
    every_run = [r for r, g in rows.items() if g is None]
    rotating = {r: g for r, g in rows.items() if g is not None}
    assert set(rotating.values()) == set(range(rotation.GROUPS))  # no group empty
    for start in (0, 5, 230):  # any 8 consecutive turns
        ran = [r for turn in range(start, start + rotation.GROUPS) for r, g in rotating.items()
               if rotation.Choice(turn % rotation.GROUPS, turn, "test").runs(g)]
        assert sorted(ran) == sorted(rotating)  # each row exactly once
    sizes = [sum(g == k for g in rotating.values()) for k in range(rotation.GROUPS)]  # balanced in seconds, not rows
    print(f"{len(rows)} rows: {len(every_run)} in every run, group sizes {sizes}")


def test_a_modules_rows_take_the_groups_in_turn_from_its_offset():
    module = "tests.example_new_fault_module"
    first = rotation.assign(module)
    assert first == rotation.offset(module)
    assert [rotation.assign(module) for _ in range(9)] == [(first + k) % rotation.GROUPS for k in range(1, 10)]


def test_the_choice_comes_from_rft_rotation_then_the_turn_file_which_next_moves_on_by_one(monkeypatch, tmp_path):
    def fresh():
        rotation.choice.cache_clear()
        return rotation.choice()

    try:
        monkeypatch.delenv("RFT_FAULTS_ALL", raising=False)
        monkeypatch.setenv("RFT_ROTATION", "19")
        assert (fresh().group, fresh().turn) == (3, 19)
        monkeypatch.delenv("RFT_ROTATION")
        committed = int(rotation.TURN_FILE.read_text())  # the repository's turn
        c = fresh()
        assert (c.turn, c.group, c.source) == (committed, committed % 8, f"tests/rotation_turn={committed}")
        turn_file = tmp_path / "tests" / "rotation_turn"
        turn_file.parent.mkdir()
        turn_file.write_text("14\n")
        monkeypatch.setattr(rotation, "ROOT", tmp_path)
        monkeypatch.setattr(rotation, "TURN_FILE", turn_file)
        assert (fresh().turn, fresh().group) == (14, 6)
        rotation.main(["--next"])  # a landing: one turn on, one group on
        assert turn_file.read_text() == "15\n" and (fresh().turn, fresh().group) == (15, 7)
        rotation.next_turn()
        assert fresh().group == 0  # 8 landings later the groups start again
        turn_file.write_text("x\n")
        with pytest.raises(ValueError, match=r"tests/rotation_turn must hold a non-negative integer .*'x'"):
            fresh()
        monkeypatch.setenv("RFT_FAULTS_ALL", "1")
        c = fresh()
        assert c.group is None and c.runs(0) and c.runs(7) and "every row" in c.describe()
    finally:
        rotation.choice.cache_clear()


def test_a_skip_beyond_the_expected_ones_fails_the_check():
    skips = [("a::rot", f"{rotation.SKIP_REASON} group 3 of 8; ..."), ("b::u1", "RFT_UPSTREAM not set: run ..."),
             ("b::u2", "RFT_UPSTREAM not set: run ...")]
    assert unexpected_skips(skips, {"RFT_UPSTREAM not set": 2}) == []
    assert unexpected_skips(skips + [("b::u3", "RFT_UPSTREAM not set: run ...")], {"RFT_UPSTREAM not set": 2}) == \
        ["b::u3: RFT_UPSTREAM not set: run ..."]
    assert unexpected_skips([("tests/test_faults_resident.py", "could not import 'ray': No module named 'ray'")]) == \
        ["tests/test_faults_resident.py: could not import 'ray': No module named 'ray'"]


def test_the_skip_check_fails_a_run_and_names_the_test(tmp_path):
    """A pytest run of a folder with one test that skips on a missing import and one SIGKILL test
    written without ``row`` (it joins the rotation; the run's turn is not its group): with the
    check on (RFT_SKIP_CHECK=1) the run fails and names the test that skipped and why, while the
    rotation's skip is allowed; with RFT_DURATIONS the run's durations file (tests/durations.py)
    lists the three tests."""
    from tests.durations import parse

    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text("import time\n\nimport pytest\n\ndef test_ok():\n    time.sleep(0.2)\n\n"
                                        "def test_gated():\n    pytest.importorskip('no_such_module_rft')\n\n"
                                        "def test_sigkill_plain():\n    pass\n")
    other_turn = (rotation.offset("test_x") + 1) % rotation.GROUPS
    env = {"RFT_SKIP_CHECK": "1", "PYTHONPATH": str(TESTS.parent), "RFT_DURATIONS": str(tmp_path / "d.txt"),
           "RFT_ROTATION": str(other_turn)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, env={**os.environ, **env}, cwd=tmp_path, timeout=300)
    assert res.returncode == 1, res.stdout[-3000:]
    assert "1 passed, 2 skipped" in res.stdout and "SKIP CHECK FAILED: 1 test(s)" in res.stdout, res.stdout[-3000:]
    assert "test_x.py::test_gated: could not import 'no_such_module_rft'" in res.stdout, res.stdout[-3000:]
    assert ("skip check (tests/skips.py): 2 skipped: 1 tests of the rotation's other groups, 0 expected, "
            "1 not allowed") in res.stdout, res.stdout[-3000:]
    assert f"rotation: group {other_turn} of 8 (turn {other_turn} from RFT_ROTATION={other_turn}" in res.stdout
    rec = parse((tmp_path / "d.txt").read_text())
    assert rec.collected == 3 and rec.outcomes == {"passed": 1, "skipped": 2}, rec
    assert sorted(e.nodeid for e in rec.tests) == ["test_x.py::test_gated", "test_x.py::test_ok",
                                                   "test_x.py::test_sigkill_plain"] and rec.wall_s > 0
    assert {e.nodeid: e.group for e in rec.tests}["test_x.py::test_sigkill_plain"] == rotation.offset("test_x")


# what gates a proof: without it the proof skips itself (importorskip), so it must be installed
GATES = {"ray": "the resident workers' proofs (tests/test_faults_resident.py, tests/flows/test_resident_flow.py, ...)",
         "prefect_ray": "tests/flows/test_ray_fanout.py",
         "deepspeed": "tests/rft_core/training/test_deepspeed_update.py",
         "s3fs": "the object-storage proofs (tests/test_object_storage.py, tests/schemas/test_object_store.py)",
         "moto": "the S3 server of the object-storage and two-node proofs",
         "mypy": "tests/test_types.py"}


@pytest.mark.parametrize("module", sorted(GATES))
def test_a_dependency_that_gates_a_proof_is_installed(module):
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is missing, so {GATES[module]} would skip: install the dev extras ({exc})")


def test_prlimit_for_the_python_environment_proofs():
    assert shutil.which("prlimit"), "util-linux prlimit is missing: tests/rft_core/agents/test_python_env.py would skip"


def test_group_costs_pay_each_baseline_once_per_group_and_the_planner_balances_them(capsys, tmp_path):
    """``python -m tests.rotation``: from a run of every row, each group's seconds (a row's seconds
    less its setup; the largest setup of a test function's rows is its baseline, paid once by each
    group that runs one of its rows) and the module offsets that balance them."""
    from tests.durations import Entry, Record, render

    E = Entry  # noqa: N806
    rows = [E(130.0, 100.0, "passed", 0, "tests/test_a.py::test_sigkill_a[0]"),  # built the baseline: 100 s
            E(30.0, 0.0, "passed", 1, "tests/test_a.py::test_sigkill_a[1]"),
            E(50.0, 0.01, "passed", 0, "tests/test_b.py::test_sigkill_b[0]")]
    assert rotation.group_costs(rows) == [100 + 30 + 50 + 0.01 - 0.01, 100 + 30, 0, 0, 0, 0, 0, 0]
    shifted = rotation.group_costs(rows, {"tests.test_b": 2})
    assert shifted[:3] == [130.0, 130.0, 50.0] and sum(shifted) == 310.0
    assert max(rotation.group_costs(rows, rotation.best_shifts(rows))) == 130.0
    path = tmp_path / "faults.txt"
    path.write_text(render(Record(300.0, 3, {"passed": 3}, {}, rows)))
    rotation.main([str(path)])
    out = capsys.readouterr().out
    assert "group 0: 180 s of SIGKILL rows\n    tests/test_a.py::test_sigkill_a[0]\n    tests/test_b.py::test_sigkill_b[0]" \
        in out and "group 1: 130 s" in out and "balanced: OFFSETS = {" in out, out
