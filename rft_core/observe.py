"""Observability outside Prefect: TensorBoard event files, a metrics curve image, and a
markdown view of sample responses (the flows publish the latter as Prefect artifacts)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from rft_core.inspect import samples_view
from schemas import local_path

CURVE_KEYS = ("reward_mean", "accuracy", "kl", "response_length", "policy_loss", "entropy")


def write_tensorboard(run_root: str, rows: list[Mapping[str, Any]]) -> str | None:
    """(Re)write ``{run_root}/tensorboard`` with the numeric metrics of every iteration so far
    (step = iteration). Rewriting, like metrics.jsonl, keeps a resumed run free of duplicates.

    Returns the log folder, or None when the run root is not on the local filesystem
    (TensorBoard writes local files).
    """
    local = local_path(run_root)
    if local is None:
        return None
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    logdir = Path(local) / "tensorboard"
    shutil.rmtree(logdir, ignore_errors=True)
    with SummaryWriter(str(logdir)) as w:
        for row in rows:
            for key, value in row.items():
                if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    w.add_scalar(key, float(value), global_step=int(row["iteration"]))
    return str(logdir)


def plot_curves(run_root: str, rows: list[Mapping[str, Any]]) -> str | None:
    """Reward, accuracy, KL, length, loss and entropy across iterations as ``{run_root}/metrics.png``.

    Returns the image path, or None for a non-local run root or no rows.
    """
    local = local_path(run_root)
    if local is None or not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in CURVE_KEYS if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    its = [r["iteration"] for r in rows]
    for ax, key in zip(axes[0], keys):
        ax.plot(its, [r.get(key, float("nan")) for r in rows], marker="o")
        ax.set_title(key)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = str(Path(local) / "metrics.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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
