"""GPU proof (issue 31): the demo preset for N iterations on one GPU, without Prefect.

The device machines have no Prefect (and cannot fetch it), so this runs the stage programs of
``flows/iteration.py`` in the same order, in one process (``tests.drive.drive``), each through
``rft_core.stages.runner.run_stage`` exactly as a Prefect task calls it. Dynamic sampling and
critics are not covered (the demo uses neither). Per iteration it records the flow's metrics
(``iteration_metrics``), wall seconds and peak GPU memory (``torch.cuda.max_memory_allocated``).

    python benchmarks/gpu_demo.py [--config configs/grpo_demo.yaml] [--iterations 4] [--set key=value ...] [--json out.json]

Exit status 2 when no CUDA device is visible (``--cpu`` runs it on the CPU instead).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)


def run(cfg, cuda: bool) -> list[dict]:
    """Run ``cfg.iterations`` iterations under ``cfg.run_root``; the metrics of each, with the
    peak GPU memory of the iteration (``peak_gpu_gib``)."""
    import torch

    from tests.drive import drive

    rows: list[dict] = []

    def record(m: dict) -> None:
        if cuda:
            m["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            torch.cuda.reset_peak_memory_stats()
        rows.append(m)
        print(json.dumps(m, default=str), flush=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    drive(cfg, on_iteration=record, freeze_heap=True)  # as rft train (rft_core/heap.py)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/grpo_demo.yaml"))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--run-root", default=None, help="default: a new temporary folder")
    ap.add_argument("--json", default=None, help="write the per-iteration metrics here")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a dry run of the script)")
    args = ap.parse_args()
    import torch

    if args.cpu:
        os.environ["RFT_DEVICE"] = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu", file=sys.stderr)
        return 2
    from rft_core.config import load_config

    run_root = args.run_root or scratch_dir("rft-gpu-demo-")
    cfg = load_config(args.config, [*args.overrides, f"iterations={args.iterations}", f"run_root={run_root}"])
    t0 = time.perf_counter()
    rows = run(cfg, cuda=not args.cpu)
    result = {"config": args.config, "overrides": args.overrides, "run_root": run_root, "device":
              "cpu" if args.cpu else torch.cuda.get_device_name(0), "torch": torch.__version__,
              "wall_seconds": round(time.perf_counter() - t0, 3), "iterations": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
