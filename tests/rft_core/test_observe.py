"""The metrics curve (PNG bytes, the markdown that embeds it) and the optional W&B logger,
tested with a fake ``wandb`` module (wandb is not a dependency)."""
from __future__ import annotations

import base64
import hashlib
import re
import struct
import sys
import types

import pytest

from rft_core.config import WandbConfig
from rft_core.observe import CURVE_DPI, CurveSchedule, TensorBoardLog, WandbLogger, curve_markdown, curve_outputs, curve_png

ROWS = [
    {"iteration": 1, "reward_mean": 0.125, "kl": 0.0, "response_length": 47.25, "skipped": True, "name": "x"},
    {"iteration": 2, "reward_mean": 0.25, "kl": 0.0212, "response_length": 48.5, "skipped": False, "name": "y"},
]


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def test_curve_png_has_one_panel_per_present_metric():
    # 3 of CURVE_KEYS are present -> figure 3 * 3.2 in x 2.8 in, at 50 dpi: 480 x 140 px
    assert _png_size(curve_png(ROWS, dpi=50)) == (480, 140)
    # a fourth metric starts a second row of 2.8 in (at most 3 panels a row)
    assert _png_size(curve_png([{**r, "accuracy": 0.5} for r in ROWS], dpi=50)) == (480, 280)
    assert _png_size(curve_png(ROWS, dpi=50, max_cols=2)) == (320, 280)


def test_curve_png_refuses_rows_without_metrics():
    with pytest.raises(ValueError, match="none of reward_mean"):
        curve_png([{"iteration": 1, "foo": 1.0}])
    with pytest.raises(ValueError, match="no curve"):
        curve_png([])


def test_curve_markdown_embeds_the_png_and_the_last_values():
    md = curve_markdown(ROWS, curve_png(ROWS, dpi=40))
    m = re.search(r"!\[metrics curve\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert m, md[:200]
    assert _png_size(base64.b64decode(m.group(1))) == (384, 112)  # 3 panels at 40 dpi
    assert md.startswith("### Metrics over 2 iteration(s)")
    assert "Iteration 2: reward_mean 0.25, kl 0.0212, response_length 48.5" in md


def test_the_flows_curve_is_drawn_once_for_the_file_and_the_artifact(tmp_path):
    path, md = curve_outputs(str(tmp_path), ROWS)
    embedded = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)\)", md).group(1))
    assert path == str(tmp_path / "metrics.png") and (tmp_path / "metrics.png").read_bytes() == embedded
    assert _png_size(embedded) == (round(3 * 3.2 * CURVE_DPI), round(2.8 * CURVE_DPI))  # 3 panels, one row
    path, md = curve_outputs("s3://bucket/run", ROWS)
    assert path is None and md.startswith("### Metrics over 2")  # no local file to write; the markdown all the same


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: calls.append(("init", kw)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_wandb_disabled_never_imports(fake_wandb, tmp_path):
    assert WandbLogger.start(WandbConfig(), run_root=str(tmp_path), name="n", config={}) is None
    assert fake_wandb == []


def test_wandb_logs_numeric_metrics_per_iteration(fake_wandb, tmp_path):
    root = str(tmp_path / "run")
    cfg = WandbConfig(enabled=True, project="p", entity="e", mode="offline", tags=["a"])
    wb = WandbLogger.start(cfg, run_root=root, name="demo", config={"iterations": 2})
    for row in ROWS:
        wb.log(row)
    wb.finish()
    (_, init), *rest = fake_wandb
    assert init["id"] == hashlib.sha256(root.encode()).hexdigest()[:16] == WandbLogger.run_id(root)
    assert (init["project"], init["entity"], init["mode"], init["name"], init["tags"], init["resume"]) == \
        ("p", "e", "offline", "demo", ["a"], "allow")
    assert init["config"] == {"iterations": 2} and init["dir"] == root and (tmp_path / "run").is_dir()
    assert rest == [
        ("log", {"reward_mean": 0.125, "kl": 0.0, "response_length": 47.25}, 1),  # bools and strings left out
        ("log", {"reward_mean": 0.25, "kl": 0.0212, "response_length": 48.5}, 2),
        ("finish",),
    ]


def test_wandb_enabled_but_missing_is_a_clear_import_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"observe.wandb.enabled=true but the wandb package is not installed"):
        WandbLogger.start(WandbConfig(enabled=True), run_root=str(tmp_path), name="n", config={})


def test_the_curve_is_redrawn_once_every_curve_every_s_and_after_the_last_iteration(monkeypatch):
    clock = iter([100.0, 130.0, 159.9, 160.0, 170.0, 175.0, 300.0, 301.0])
    monkeypatch.setattr("rft_core.observe.time.monotonic", lambda: next(clock))
    schedule = CurveSchedule(60.0)  # made at t=100 (the run's start)
    # t=130: 30 s since the start; 159.9: 59.9 s; 160: 60 s -> drawn; 170: 10 s since; 175: the last iteration
    assert [schedule.due(i, 5) for i in range(1, 6)] == [False, False, True, False, True]
    assert schedule.last == 175.0
    every = CurveSchedule(0.0)  # t=300; 0 s: every iteration, also at no time passed
    assert every.due(1, 9) and every.last == 301.0


def _steps(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_log_appends_each_new_row_and_a_new_log_rewrites_the_folder(tmp_path):
    rows = [{"iteration": i, "reward_mean": 0.5 * i, "skipped": True, "name": "x"} for i in (1, 2, 3)]
    log = TensorBoardLog(str(tmp_path))
    assert log.write(rows[:2]) == str(tmp_path / "tensorboard")
    first = sorted((tmp_path / "tensorboard").iterdir())
    assert _steps(tmp_path / "tensorboard") == {"reward_mean": [(1, 0.5), (2, 1.0)]}  # flushed: readable at once
    log.write(rows)  # the third row appended to the same event file, the first two not again
    assert sorted((tmp_path / "tensorboard").iterdir()) == first and len(first) == 1
    assert _steps(tmp_path / "tensorboard") == {"reward_mean": [(1, 0.5), (2, 1.0), (3, 1.5)]}
    log.close()
    resumed = TensorBoardLog(str(tmp_path))  # a resumed run's recorder: every row again, into a fresh folder
    resumed.write(rows)
    resumed.close()
    assert _steps(tmp_path / "tensorboard") == {"reward_mean": [(1, 0.5), (2, 1.0), (3, 1.5)]}
    assert not (tmp_path / "tensorboard" / first[0].name).exists()
    assert TensorBoardLog("s3://bucket/run").write(rows) is None  # TensorBoard writes local files only
