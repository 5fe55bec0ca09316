"""Benchmark: one demo iteration through the Prefect flow on the default model.

Writes seconds per stage, generated tokens per second, peak memory (process max RSS) and the
time outside the stages (Prefect orchestration + shard I/O around them) to docs/benchmarks.md.

    .venv/bin/python benchmarks/iteration.py [--config configs/grpo_demo.yaml] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import resource
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/grpo_demo.yaml"))
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks.md"))
    args = ap.parse_args()

    from rft_core.config import load_config
    from rft_core.models.loading import DEFAULT_MODEL, ensure_default_model

    ensure_default_model()  # conversion is a one-time cost, not part of the iteration
    run_root = scratch_dir("rft-bench-")
    cfg = load_config(args.config, [*args.overrides, "iterations=1", f"run_root={run_root}"])

    from flows.train import train

    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    m = result.metrics[0]
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    stage_s = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("seconds/") and k != "seconds/iteration"}
    inside = m["seconds/iteration"]
    concurrent = ("actor_logprobs", "ref_logprobs", "rewards")
    critical = sum(v for k, v in stage_s.items() if k not in concurrent) + max(stage_s.get(k, 0.0) for k in concurrent)
    lines = [
        "# Benchmarks",
        "",
        "## One demo iteration (`make bench`)",
        "",
        f"Measured {_dt.date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, torch CPU, "
        f"model `{cfg.policy.path}`{' (SmolLM2-135M-Instruct)' if cfg.policy.path == DEFAULT_MODEL else ''}, "
        f"task `{cfg.data.task}`, {cfg.data.prompts_per_iteration} prompts x {cfg.rollout.n_samples_per_prompt} samples, "
        f"max_new_tokens {cfg.rollout.max_new_tokens}.",
        "",
        f"Command: `.venv/bin/python benchmarks/iteration.py --config {Path(args.config).relative_to(ROOT) if Path(args.config).is_absolute() else args.config}"
        + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        "| stage | seconds |",
        "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in stage_s.items()],
        f"| sum of stages | {sum(stage_s.values()):.2f} |",
        f"| critical path (the concurrent actor/ref/rewards counted once, at their longest) | {critical:.2f} |",
        f"| iteration subflow wall time | {inside:.2f} |",
        f"| outside the stage compute (Prefect, model loads, shard I/O) | {inside - critical:.2f} ({100 * (inside - critical) / inside:.1f}%) |",
        f"| whole train flow incl. Prefect server start | {wall:.2f} |",
        "",
        f"- generated tokens/s (rollout stage): {m.get('tokens_per_second', float('nan')):.1f}",
        f"- mean response length: {m.get('response_length', float('nan')):.1f} tokens",
        f"- peak memory (max RSS of the process): {peak_gib:.2f} GiB",
        f"- reward mean {m.get('reward_mean', float('nan')):.3f}, accuracy {m.get('accuracy', float('nan')):.3f}",
        "",
        "Stages submitted together (actor/ref log-probs, rewards) run concurrently in threads on the",
        "same 2 cores, so each of them takes longer than alone. Stage seconds are the compute inside",
        "the stage programs (generation, forward passes, the update and its checkpoint write); model",
        "loads, shard reads/writes and Prefect's own work fall in the 'outside' row.",
        "",
    ]
    out = Path(args.out)  # replace only this section: other benchmarks (vs_trl.py) keep theirs
    old = out.read_text() if out.exists() else ""
    start = old.find("\n## ", old.find("## One demo iteration") + 1) if "## One demo iteration" in old else -1
    rest = old[start + 1:] if start >= 0 else ""
    out.write_text("\n".join(lines) + ("\n" + rest if rest else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
