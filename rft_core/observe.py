"""Observability outside Prefect: TensorBoard event files, a metrics curve image, a markdown
view of sample responses and of the curve (the flows publish those two as Prefect artifacts),
and optional Weights & Biases logging."""
from __future__ import annotations

import base64
import hashlib
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from rft_core.inspect import samples_view
from schemas import local_path

CURVE_KEYS = ("reward_mean", "accuracy", "kl", "response_length", "policy_loss", "entropy")


class TensorBoardLog:
    """``{run_root}/tensorboard``: the numeric metrics of each iteration (step = iteration) for one
    training call. Its first ``write`` rewrites the folder with every row so far (a resumed run
    re-records the iterations before it: rewriting keeps it free of duplicates, like
    metrics.jsonl); each later one appends the rows it has not written, through one
    ``SummaryWriter`` kept open (flushed after each write). Rewriting every row after every
    iteration took 1.5 s of Python at 200 iterations and 6.9 s at 1000 (60 metrics a row, on a
    2-core CPU): longer than a GPU step, on the thread that records metrics. Not thread-safe:
    one recording thread writes it. A run root off the local filesystem gets no TensorBoard
    files (TensorBoard writes local files)."""

    def __init__(self, run_root: str):
        local = local_path(run_root)
        self.logdir = None if local is None else Path(local) / "tensorboard"
        self._writer: Any = None
        self._written = 0

    def write(self, rows: Sequence[Mapping[str, Any]]) -> str | None:
        """Write the rows of ``rows`` (every iteration so far, in order) not written yet; returns
        the log folder, or None off the local filesystem."""
        if self.logdir is None:
            return None
        if self._writer is None:
            import shutil

            from torch.utils.tensorboard import SummaryWriter

            shutil.rmtree(self.logdir, ignore_errors=True)
            self._writer = SummaryWriter(str(self.logdir))
        for row in rows[self._written:]:
            for key, value in row.items():
                if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, float(value), global_step=int(row["iteration"]))
        self._writer.flush()
        self._written = len(rows)
        return str(self.logdir)

    def close(self) -> None:
        """Close the event file (a later ``write`` starts the folder again)."""
        if self._writer is not None:
            self._writer.close()
            self._writer, self._written = None, 0


def curve_png(rows: Sequence[Mapping[str, Any]], *, dpi: int = 110, max_cols: int = 3) -> bytes:
    """PNG bytes of one panel per metric in ``CURVE_KEYS`` that any row has (reward, accuracy,
    KL, response length, loss, entropy) against the iteration, one point per row; panels of
    3.2 x 2.8 inches in rows of at most ``max_cols``.

    Raises:
        ValueError: ``rows`` is empty or has no metric of ``CURVE_KEYS``.
    """
    keys = [k for k in CURVE_KEYS if any(k in r for r in rows)]
    if not keys:
        raise ValueError(f"no curve to draw: the rows hold none of {', '.join(CURVE_KEYS)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(keys), max_cols)
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False)
    its = [r["iteration"] for r in rows]
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        ax.plot(its, [r.get(key, float("nan")) for r in rows], marker="o")
        ax.set_title(key)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    # fixed margins in inches (tight_layout measured every tick label: about half the drawing's time)
    width, height = 3.2 * cols, 2.8 * nrows
    fig.subplots_adjust(left=0.65 / width, right=1 - 0.2 / width, bottom=0.5 / height, top=1 - 0.35 / height,
                        wspace=0.45, hspace=0.55)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


CURVE_DPI = 90  # the training flow's curve: the UI's artifact and metrics.png alike


@dataclass
class CurveSchedule:
    """When the training flow redraws its metrics curve (``curve_outputs``): after an iteration
    when at least ``every_s`` seconds (``observe.curve_every_s``, wall clock, ``time.monotonic``)
    have passed since the last drawing or, before the first, since this schedule was made (the
    run's start); always after the run's last iteration. ``every_s`` 0: after every iteration.
    metrics.jsonl, TensorBoard and W&B get every iteration whatever the schedule."""

    every_s: float
    last: float = field(default_factory=lambda: time.monotonic())

    def due(self, iteration: int, last_iteration: int) -> bool:
        """Whether to draw after ``iteration`` (1-based) of a run ending at ``last_iteration``;
        a True answer counts as the drawing."""
        now = time.monotonic()
        if iteration < last_iteration and now - self.last < self.every_s:
            return False
        self.last = now
        return True


def curve_outputs(run_root: str, rows: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """Reward, accuracy, KL, length, loss and entropy across iterations, drawn once
    (``curve_png`` at ``CURVE_DPI``: 0.3-0.6 s on a 2-core CPU) for both places the training flow
    shows it after each iteration: (the path of ``{run_root}/metrics.png``, or None for a
    non-local run root; ``curve_markdown``'s markdown for the UI's artifact).

    Raises:
        ValueError: as ``curve_png``.
    """
    png = curve_png(rows, dpi=CURVE_DPI)
    local = local_path(run_root)
    if local is None:
        return None, curve_markdown(rows, png)
    (Path(local) / "metrics.png").write_bytes(png)
    return str(Path(local) / "metrics.png"), curve_markdown(rows, png)


def curve_markdown(rows: Sequence[Mapping[str, Any]], png: bytes) -> str:
    """Markdown that shows ``png`` (``curve_png`` of ``rows``) inline, with the last row's values:
    the PNG is embedded as a ``data:image/png;base64`` URI, which both Prefect UIs render in a
    markdown artifact (an image artifact only takes a URL and prints it in full under the image).
    About 60-110 kB for six panels at ``CURVE_DPI``."""
    data = base64.b64encode(png).decode("ascii")
    last = rows[-1]
    summary = ", ".join(f"{k} {last[k]:.4g}" for k in CURVE_KEYS if isinstance(last.get(k), (int, float)))
    return (f"### Metrics over {len(rows)} iteration(s)\n\n![metrics curve](data:image/png;base64,{data})\n\n"
            f"Iteration {last['iteration']}: {summary}\n")


def samples_markdown(run_root: str, iteration: int, n: int = 8, width: int = 160) -> str:
    """A markdown table of the first ``n`` samples: question, response, reward, advantage."""
    view = samples_view(run_root, iteration).slice(0, n).to_pylist()

    def cell(v: Any) -> str:
        text = "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= width else text[: width - 1] + "…"

    cols = [c for c in ("question", "answer", "response_text", "rewards", "correct", "advantage_mean") if view and c in view[0]]
    lines = [f"### Iteration {iteration}: {len(view)} samples", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in view]
    return "\n".join(lines)


class WandbLogger:
    """Weights & Biases logging of each iteration's metrics (optional: wandb is not a
    dependency; enable with ``observe.wandb.enabled=true`` and ``pip install wandb``).

    One W&B run per run root: its id is derived from the run root, and ``resume="allow"`` makes
    a resumed training append to the same W&B run. Each row is logged with ``step=iteration``;
    W&B drops steps it has already seen, so reused iterations of a resumed run are not
    duplicated.
    """

    def __init__(self, run: Any):
        self.run = run

    @staticmethod
    def run_id(run_root: str) -> str:
        """A stable W&B run id for ``run_root``: 16 hex chars of sha256(run_root)."""
        return hashlib.sha256(run_root.encode()).hexdigest()[:16]

    @classmethod
    def start(cls, cfg: Any, *, run_root: str, name: str, config: Mapping[str, Any]) -> "WandbLogger | None":
        """Open (or resume) the W&B run of ``run_root``; None when ``cfg.enabled`` is False.

        Args:
            cfg: a ``WandbConfig`` (enabled, project, entity, mode, tags).
            config: the training config as plain JSON, stored as the W&B run config.
        Raises:
            ImportError: W&B is enabled but the ``wandb`` package is not installed.
        """
        if not cfg.enabled:
            return None
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("observe.wandb.enabled=true but the wandb package is not installed "
                              "(pip install wandb), so metrics are not sent to W&B") from exc
        local = local_path(run_root)
        if local:
            Path(local).mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, name=name, tags=list(cfg.tags),
                         id=cls.run_id(run_root), resume="allow", config=dict(config),
                         dir=str(local) if local else None)
        return cls(run)

    def log(self, row: Mapping[str, Any]) -> None:
        """Log the numeric metrics of one iteration row (bools and strings are left out)."""
        values = {k: float(v) for k, v in row.items()
                  if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(values, step=int(row["iteration"]))

    def finish(self) -> None:
        """Close the W&B run (flushes pending data)."""
        self.run.finish()
