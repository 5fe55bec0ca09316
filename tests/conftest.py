"""Test setup: a private Prefect home and one session-scoped Prefect test harness."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_home = tempfile.mkdtemp(prefix="rft-prefect-home-")
atexit.register(shutil.rmtree, _home, ignore_errors=True)  # the session's own Prefect home, gone with it
os.environ.setdefault("PREFECT_HOME", _home)
os.environ["PREFECT_HOME"] = _home
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402

from tests import durations  # noqa: E402
from tests.rotation import GROUPS, ROW_PREFIX, SKIP_REASON, assign, choice  # noqa: E402
from tests.skips import unexpected_skips  # noqa: E402
from tests.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (startup is slow)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the thread count the session started with: a worker made in the
    test's process with ``threads`` (``ResidentWorker``) sets it for the whole process, and CPU
    kernels round differently with another count, so a later test comparing two runs bit for bit
    would compare one computed with it against one computed without (a subprocess)."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Folder of a tiny random Llama (2 layers, width 32) with the SmolLM2 tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# ---- the rotation (tests/rotation.py) and the skip check (tests/skips.py) -------------------

_rotation: dict = {"run": [], "skipped": []}
_skips: list[tuple[str, str]] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "rotation(group): a SIGKILL row or a long test of the rotation "
                                       "(tests/rotation.py); group None: every run")


def pytest_itemcollected(item):
    """A SIGKILL test (its function's name starts with ``test_sigkill``) built without
    ``tests.faults.row`` joins the rotation too: the next group of its module, in collection order."""
    name = getattr(item, "originalname", item.name)
    if name.startswith(ROW_PREFIX) and item.get_closest_marker("rotation") is None:
        item.add_marker(pytest.mark.rotation(assign(item.module.__name__)))


def pytest_collection_modifyitems(config, items):
    chosen = choice()
    for item in items:
        mark = item.get_closest_marker("rotation")
        if mark is None:
            continue
        group = mark.args[0]
        if _recorder is not None:
            _recorder.groups[item.nodeid] = -1 if group is None else group
        if not chosen.runs(group):
            item.add_marker(pytest.mark.skip(reason=f"{SKIP_REASON} group {group} of {GROUPS}; this run runs "
                                                    f"{chosen.describe()}; make test-faults-all runs them all"))


def _rotation_lines() -> list[str]:
    if not (_rotation["run"] or _rotation["skipped"]):
        return []
    lines = [f"rotation: {choice().describe()}: runs {len(_rotation['run'])} test(s), skips "
             f"{len(_rotation['skipped'])} of the other groups"]
    lines += [f"  runs {nodeid}" + ("  (every run)" if group is None else f"  (group {group})")
              for nodeid, group in _rotation["run"]]
    return lines


def pytest_collection_finish(session):
    for item in session.items:  # what this run will run, after -k and -m deselected theirs
        mark = item.get_closest_marker("rotation")
        if mark is not None:
            _rotation["run" if choice().runs(mark.args[0]) else "skipped"].append((item.nodeid, mark.args[0]))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in _rotation_lines():
            reporter.write_line(line)


def pytest_runtest_logreport(report):
    _on_report(report)


def pytest_collectreport(report):  # a module that skips itself (pytest.importorskip at its top)
    _on_report(report)


def _on_report(report) -> None:
    if _recorder is not None and report.when in ("setup", "call", "teardown"):
        _recorder.report(report)
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append((report.nodeid, reason.removeprefix("Skipped: ")))


def _whole_suite(config) -> bool:
    """Whether the skip check applies: a run of the whole of tests/ (CI's ``make test``), or
    RFT_SKIP_CHECK=1; RFT_SKIP_CHECK=0 turns it off."""
    flag = os.environ.get("RFT_SKIP_CHECK", "")
    if flag in ("0", "1"):
        return flag == "1"
    here = os.path.dirname(os.path.abspath(__file__))
    args = [a for a in config.args if not a.startswith("-")] or [here]
    return any(os.path.abspath(a.split("::")[0]) == here for a in args) and not config.option.keyword \
        and not config.option.markexpr and not getattr(config.option, "lf", False)


def pytest_sessionfinish(session, exitstatus):
    _record_durations(session)
    if not _whole_suite(session.config):
        return
    bad = unexpected_skips(_skips)
    session.config._rft_skip_check = bad
    rotating = sum(reason.startswith(SKIP_REASON) for _, reason in _skips)
    session.config._rft_skip_line = (f"skip check (tests/skips.py): {len(_skips)} skipped: {rotating} tests "
                                     f"of the rotation's other groups, {len(_skips) - rotating - len(bad)} expected, "
                                     f"{len(bad)} not allowed")
    if bad and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in _rotation_lines():
        terminalreporter.write_line(line)
    if getattr(config, "_rft_skip_line", None):
        terminalreporter.write_line(config._rft_skip_line)
    bad = getattr(config, "_rft_skip_check", None)
    if bad:
        terminalreporter.write_line(f"SKIP CHECK FAILED: {len(bad)} test(s) skipped that the suite may not skip "
                                    "(tests/skips.py EXPECTED_SKIPS; a proof that skips itself proves nothing):",
                                    red=True, bold=True)
        for line in bad:
            terminalreporter.write_line(f"  {line}", red=True)


# ---- the durations record (tests/durations.py; make test-durations) ---------------------------------

_recorder, _record_to = None, None


def pytest_sessionstart(session):
    """Start the durations record when ``RFT_DURATIONS`` names its file, and take the variable out
    of the environment: a test that runs pytest in a subprocess (tests/test_rotation.py collects
    with ``RFT_FAULTS_ALL=1``) must not write its own small record over the suite's."""
    global _recorder, _record_to
    _record_to = os.environ.pop(durations.ENV, None)
    if _record_to:
        _recorder = durations.Recorder()
        durations.RECORDING_TO = _record_to


def _record_durations(session) -> None:
    if _recorder is None or _record_to is None:
        return
    head = subprocess.run(["git", "-C", os.path.dirname(__file__), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    _recorder.collected = len(session.items)
    _recorder.write(Path(_record_to),
                    {"commit": head.stdout.strip() if head.returncode == 0 else "(no git)",
                     "command": "python -m pytest " + " ".join(session.config.invocation_params.args),
                     "rotation": choice().describe()})


@pytest.fixture
def own_process_group():
    """A world of one rank in this process for the test (an in-process FSDP2 strategy forms one: the
    tests of tests/rft_core/training/test_fsdp_update.py, a flow with an in-process FSDP2 critic), removed
    after it with the environment it set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)."""
    import os

    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
