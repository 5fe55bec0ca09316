"""Benchmark (issue 28): the demo preset for N iterations with ``rollout.max_staleness`` 0, then 1,
one after the other, through the Prefect training flow.

Per iteration: wall seconds, generated tokens per second, the policy version and staleness of
its rollout, and ``overlap_s``: how long the rollout of iteration k+1 ran while the update of
iteration k trained (the intersection of the two stages' windows, from their manifests:
``created_at`` minus their seconds). Writes ``docs/raw/async.json`` and the section "Asynchronous
RL" of docs/benchmarks.md.

    .venv/bin/python benchmarks/async_rl.py [--iterations 4] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)


def window(uri: str) -> tuple[float, float]:
    """(start, end) wall-clock seconds of a committed stage: its manifest's time minus its seconds."""
    from schemas import read_manifest

    m, _ = read_manifest(uri)
    end = _dt.datetime.fromisoformat(m.created_at).timestamp()
    return end - float(m.summary.get("seconds", 0.0)) - float(m.summary.get("checkpoint_seconds", 0.0)), end


def overlap(run_root: str, iteration: int) -> float:
    """Seconds during which the rollout of ``iteration + 1`` and the update of ``iteration`` both ran."""
    from schemas import stage_uri

    try:
        r, u = window(stage_uri(run_root, iteration + 1, "rollout")), window(stage_uri(run_root, iteration, "ppo_update"))
    except Exception:  # noqa: BLE001  the last iteration has no next rollout
        return 0.0
    return max(0.0, min(r[1], u[1]) - max(r[0], u[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/grpo_demo.yaml"))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--json", default=str(ROOT / "docs/raw/async.json"))
    ap.add_argument("--doc", default=str(ROOT / "docs/benchmarks.md"))
    args = ap.parse_args()

    from flows.train import train
    from rft_core.config import load_config
    from rft_core.models.loading import ensure_default_model

    ensure_default_model()
    load0 = os.getloadavg()[0]
    res: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "iterations": args.iterations,
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "overrides": args.overrides}
    for s in (0, 1):
        root = scratch_dir(f"rft-bench-async-s{s}-")
        cfg = load_config(args.config, [*args.overrides, f"rollout.max_staleness={s}", f"iterations={args.iterations}",
                                        f"run_root={root}"])
        t0 = time.perf_counter()
        result = train(cfg)
        rows = [{"iteration": m["iteration"], "seconds": m["seconds/iteration"], "tokens_per_second": m.get("tokens_per_second"),
                 "policy_version": m.get("policy_version"), "staleness": m.get("staleness"),
                 "reward_mean": m.get("reward_mean"), "rollout_is_weight_mean": m.get("rollout_is_weight_mean"),
                 "rollout_kl": m.get("rollout_kl"), "overlap_s": round(overlap(root, m["iteration"]), 2),
                 "stage_seconds": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("seconds/")
                                   and k != "seconds/iteration"}} for m in result.metrics]
        res[f"s{s}"] = {"iterations": rows, "wall_seconds": round(time.perf_counter() - t0, 1), "run_root": root}
    res["load"] = f"load average (1 min) {load0:.2f} before, {os.getloadavg()[0]:.2f} after"
    Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    lines = [f"Measured {res['date']} on {res['machine']}; {res['load']}. Command: `make bench-async`"
             + (f" with {', '.join(args.overrides)}" if args.overrides else "") + f"; {args.iterations} iterations of "
             "the demo preset with `rollout.max_staleness` 0 then 1, one after the other (raw: docs/raw/async.json).",
             "", "| s | iter | seconds | tokens/s | policy version | staleness | rollout of k+1 overlapping update k (s) | reward | IS weight mean |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in (0, 1):
        for r in res[f"s{s}"]["iterations"]:
            isw = f"{r['rollout_is_weight_mean']:.3f}" if r["rollout_is_weight_mean"] is not None else "-"
            lines.append(f"| {s} | {r['iteration']} | {r['seconds']} | {r['tokens_per_second']:.0f} | {r['policy_version']} | "
                         f"{r['staleness']} | {r['overlap_s']} | {r['reward_mean']:.3f} | {isw} |")
    for s in (0, 1):
        w = res[f"s{s}"]["wall_seconds"]
        lines.append(f"\n- s = {s}: {w} s for {args.iterations} iterations (flow wall time, the Prefect server's start included).")
    from gpu_smoke import write_section

    write_section(Path(args.doc), "Asynchronous RL (`make bench-async`)", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
