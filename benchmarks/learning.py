"""Benchmark: does GRPO improve the model on held-out prompts? Before/after, several seeds.

1. The untrained policy is scored on the held-out split (``flows/eval.py``: greedy, question
   texts disjoint from the training dataset) once: greedy decoding does not depend on the seed.
2. For each seed, ``iterations`` GRPO iterations run through the iteration flow
   (``flows/iteration.py:rl_iteration``) into ``{out}/seed-{s}``, with ``rollout.seed`` and
   ``update.seed`` set to the seed (same training prompts in the same order; sampling and
   mini-batch order differ). Only the newest checkpoint is kept whole on disk (each is ~1.6 GB
   with the AdamW state); the weights and optimizer state of the others are pruned as soon as
   the next iteration has committed (``rft_core.stages.retention``, keep_last=1).
3. The final checkpoint of each seed is scored on the same held-out split.

Writes the training reward curve and the held-out accuracy before/after to an image and a
markdown report with the numbers, the spread over seeds and the exact command.

    .venv/bin/python benchmarks/learning.py                               # 3 seeds, the preset's iterations
    .venv/bin/python benchmarks/learning.py --seeds 0 --iterations 2 --eval-prompts 40 \\
        --out /tmp/learning-pilot --doc /tmp/learning-pilot/learning.md --png /tmp/learning-pilot/curve.png   # pilot

A seed whose ``{out}/seed-{s}/result.json`` exists is not rerun, so an interrupted benchmark
continues with the next unfinished seed when started again with the same ``--out``.

``--with-trl`` (issue 19: learning at least TRL's) also trains TRL's ``GRPOTrainer`` for the same
number of optimizer steps on the same prompts with the preset's settings, one fresh process per
seed, and scores its final model with the same held-out evaluation (``benchmarks/learning_trl.py``:
the mapping and what still differs). The report gets a TRL section: per-seed accuracy before/after,
TRL's gain with its spread over seeds, and ours minus TRL against the standard error of that
difference (Welch t at the two-sided 5% level). ``summary.json`` keeps TRL's per-seed results under
``trl``; each seed's are in ``{out}/trl-seed-{s}/result.json`` (a finished seed is not rerun). Needs
TRL (``pip install -c constraints-cpu.txt -e '.[bench]'``). About twice the time of the plain run
(~60 s per iteration per arm on a quiet 2-core CPU: ~2 x 3 x 13 min plus evaluations, ~85 min):

    .venv/bin/python benchmarks/learning.py --with-trl                    # 3 seeds, both arms -> docs/learning.md
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

from _env import ROOT  # noqa: E402  (repository on sys.path, offline environment)


def _eval_numbers(res) -> dict:
    s = res.summary
    return {"accuracy": res.accuracy, "accuracy_stderr": s["accuracy_stderr"], "reward_mean": res.reward_mean,
            "reward_stderr": s["reward_stderr"], "response_length_mean": s["response_length_mean"],
            "truncated_fraction": s["truncated_fraction"], "num_prompts": res.num_prompts, "uri": res.shard.uri}


def train_seed(cfg, *, keep_all: bool) -> tuple[list[dict], object]:
    """``cfg.iterations`` iterations of the iteration flow; returns the metrics rows and the
    final policy ShardRef."""
    from flows.iteration import rl_iteration
    from rft_core.api import release_run, wait_for_optimizer_writes
    from rft_core.metrics import format_metrics_line, write_metrics
    from rft_core.stages.retention import prune_checkpoints

    policy, state, rows, ahead_stages = cfg.policy.path, cfg.initial_state, [], {}
    versions = {0: policy}  # as flows/train.py: version v is the policy the update of iteration v made
    try:
        for i in range(1, cfg.iterations + 1):
            ahead = versions[cfg.rollout_policy_version(i + 1)] if cfg.rollout.max_staleness and i < cfg.iterations else None
            result = rl_iteration(cfg, i, policy, state, None, versions[cfg.rollout_policy_version(i)], ahead, ahead_stages)
            policy, state, ahead_stages = result.policy, result.next_state, result.ahead_stages
            versions[i] = policy
            rows.append(result.metrics)
            write_metrics(cfg.run_root, rows)
            print(format_metrics_line(result.metrics), flush=True)
            if not keep_all:  # checkpoint retention: the run stays resumable and its manifests verify
                # rollout.max_staleness s: the next rollouts sample with versions up to s behind
                prune_checkpoints(cfg.run_root, i, keep_last=1 + cfg.rollout.max_staleness, prune="weights")
        wait_for_optimizer_writes()  # as flows/train.py: the last update's background writes (checkpoint.async_*)
    finally:
        release_run(None)  # the models kept between stages, as the train flow does
    return rows, policy


def _style(ax, ylabel: str, title: str) -> None:
    """Labels, a zero-based y axis, a light grid and a legend for a per-iteration panel."""
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(results: list[dict], before: dict, png: Path, trl: list[dict] | None = None) -> None:
    """Left: training reward per iteration (each seed, and the mean). Right: held-out accuracy
    before and after training, per seed. With ``trl`` (``--with-trl``): TRL's means, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [2, 1.3, 1]})
    curves = []
    for r in results:
        xs = [m["iteration"] for m in r["metrics"]]
        ys = [m["reward_mean"] for m in r["metrics"]]
        curves.append(ys)
        ax1.plot(xs, ys, alpha=0.45, lw=1, label=f"seed {r['seed']}")
    n = min(len(c) for c in curves)
    mean = [statistics.mean(c[i] for c in curves) for i in range(n)]
    ax1.plot(range(1, n + 1), mean, color="black", lw=2.2, label="mean over seeds")
    _style(ax1, "mean reward of the rollout (sampled)", "Training reward (each iteration: new prompts)")
    for r in results:
        ax3.plot([m["iteration"] for m in r["metrics"]], [m["response_length"] for m in r["metrics"]], alpha=0.6, lw=1,
                 label=f"seed {r['seed']}")
    _style(ax3, "mean response tokens (rollout)", "Response length")
    for r in results:
        ax2.plot([0, 1], [before["accuracy"], r["after"]["accuracy"]], marker="o", alpha=0.6, label=f"seed {r['seed']}")
    after_mean = statistics.mean(r["after"]["accuracy"] for r in results)
    ax2.plot([0, 1], [before["accuracy"], after_mean], color="black", lw=2.2, marker="s", label="mean")
    ax2.set_xticks([0, 1], ["before", "after"])
    ax2.set_xlim(-0.3, 1.3)
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel(f"held-out accuracy (greedy, {before['num_prompts']} prompts)")
    ax2.set_title("Held-out accuracy")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    if trl:
        from learning_trl import plot_trl

        plot_trl((ax1, ax3, ax2), before, trl)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def division_labels(data) -> tuple[int, int] | None:
    """For ``basic_arithmetic``: (division questions, of those with a wrong label) among the
    training entries generated with '/' allowed and otherwise ``data``'s settings; None for other
    tasks. reasoning-gym shows the drawn divisor but divides by another one it picks, or falls
    back to a multiplication while still printing '/'."""
    if data.task != "basic_arithmetic":
        return None
    from rft_core.data.prompts import load_task

    ds = load_task(data.task, size=data.size, seed=data.seed, task_config={**data.task_config, "operators": "+-*/"})
    n = wrong = 0
    for i in range(data.size):
        e = ds[i]
        expr = e["metadata"]["expression"]
        if " / " in expr and expr.count(" ") == 2:
            n += 1
            a, b = (int(x) for x in expr.split(" / "))
            wrong += not (b != 0 and a % b == 0 and a // b == int(e["answer"]))
    return n, wrong


def _examples(before: dict, results: list[dict], n: int = 4) -> list[str]:
    """Held-out accuracy by operator (basic_arithmetic questions) and the first ``n`` held-out
    questions answered before and after training (first seed), read from the eval shards."""
    from schemas import read_shard

    try:
        base = read_shard(before["uri"], stage="eval").to_pylist()
        runs = [read_shard(r["after"]["uri"], stage="eval").to_pylist() for r in results]
    except Exception as exc:  # shards moved or deleted: the report still renders
        return [f"(per-sample rows unavailable: {exc})", ""]
    out = []
    ops = [o for o in ("+", "-", "*", "/") if any(f" {o} " in row["question"] for row in base)]
    if ops:
        def acc(rows, op):
            sel = [row["correct"] for row in rows if f" {op} " in row["question"]]
            return f"{sum(sel)}/{len(sel)}"
        out += ["Held-out questions answered correctly, by operator:", "",
                "| operator | before | " + " | ".join(f"after, seed {r['seed']}" for r in results) + " |",
                "|---" * (len(results) + 2) + "|"]
        out += [f"| `{op}` | {acc(base, op)} | " + " | ".join(acc(rows, op) for rows in runs) + " |" for op in ops]
        out.append("")
    after = {row["prompt_id"]: row for row in runs[0]} if runs else {}
    fixed = [row for row in base if not row["correct"] and after.get(row["prompt_id"], {}).get("correct")]
    broken = sum(row["correct"] and not after.get(row["prompt_id"], {}).get("correct") for row in base)
    rest = [row for row in base if row not in fixed]
    shown = fixed[: n // 2] + rest[: n - len(fixed[: n // 2])]
    out += [f"Greedy held-out responses before and after training (seed {results[0]['seed']}): the first {len(fixed[: n // 2])} "
            f"questions the training fixed ({len(fixed)} in all; {broken} went the other way), then the first others:", ""]
    for row in shown:
        a = after.get(row["prompt_id"])
        clip = lambda t: t.replace("\n", " ").replace("|", "\\|")[:140]  # noqa: E731
        out.append(f"- `{row['question']}` (label {row['answer']}): before {'✓' if row['correct'] else '✗'} "
                   f"“{clip(row['response_text'])}” → after {'✓' if a and a['correct'] else '✗'} "
                   f"“{clip(a['response_text']) if a else '-'}”")
    return out + [""]


def report(args, cfg, before: dict, results: list[dict], wall: float, png: Path, doc: Path,
           load_end: float | None = None, trl: list[dict] | None = None) -> str:
    """The markdown report from the measured numbers (with ``trl``: also the TRL section)."""
    load_end = os.getloadavg()[0] if load_end is None else load_end
    accs = [r["after"]["accuracy"] for r in results]
    gains = [a - before["accuracy"] for a in accs]
    rews = [r["after"]["reward_mean"] for r in results]
    sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    d, ro, u = cfg.data, cfg.rollout, cfg.update
    cmd = "" .join([".venv/bin/python benchmarks/learning.py", f" --config {args.config_rel}",
                    f" --seeds {' '.join(map(str, args.seeds))}", f" --iterations {cfg.iterations}",
                    f" --eval-prompts {cfg.eval.num_prompts}", "".join(f" --set {o}" for o in args.overrides),
                    f" --out {args.out}", " --with-trl" if trl else "",
                    f" --doc {args.doc}" if Path(args.doc) != ROOT / "docs/learning.md" else "",
                    f" --png {args.png}" if Path(args.png) != ROOT / "docs/learning_curve.png" else ""])
    rel_png = os.path.relpath(png, doc.parent)
    train_minutes = ", ".join(f"seed {r['seed']} {r['train_seconds'] / 60:.1f} min" for r in results)
    lines = [
        "# Learning: held-out accuracy before and after GRPO", "",
        f"Generated by `benchmarks/learning.py` on {_dt.date.today()}, {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch CPU float32. Wall time {wall / 60:.1f} min for everything (evaluations included; per seed below); "
        f"load average at the end {load_end:.1f}." + (f" {args.note}" if args.note else ""),
        "", f"Command: `{cmd}`", "",
        "## Setup", "",
        f"- Policy: SmolLM2-135M-Instruct (`{cfg.policy.path}`), full fine-tuning, float32.",
        f"- Task: reasoning-gym `{d.task}` with `{json.dumps(d.task_config)}`; training dataset {d.size} entries, seed {d.seed}.",
        f"- Held-out split: {before['num_prompts']} prompts of the same task from another dataset seed, every question text "
        f"that occurs in the training dataset dropped (`rft_core.data.prompts.heldout_entries`); greedy decoding, "
        f"max {cfg.eval.max_new_tokens or ro.max_new_tokens} new tokens; graded by the training reward (`reward.grader="
        f"{cfg.reward.grader}`, format bonus {cfg.reward.format_reward}). Accuracy = fraction graded fully correct.",
        f"- GRPO: {cfg.iterations} iterations x {d.prompts_per_iteration} prompts x {ro.n_samples_per_prompt} samples "
        f"(temperature {ro.temperature}, max {ro.max_new_tokens} new tokens), `{cfg.advantage.estimator}` advantages, "
        f"KL coefficient {cfg.kl.kl_coef}, lr {u.lr}, {u.train_batch_size or 'all'} sequences per optimizer step, "
        f"{u.epochs} epoch(s), clip 0.2, old log-probs {'recomputed' if cfg.recomputes_old_logprobs else 'from the rollout engine'}.",
        f"- Seeds: {', '.join(map(str, args.seeds))} (`rollout.seed` and `update.seed`; the same prompts in the same order).",
        "",
        "## Results", "",
        f"![reward curve, response length and held-out accuracy]({rel_png})", "",
        "Every seed trains on the same prompts in the same order, so the per-iteration training reward rises and falls "
        "with those 8 prompts' difficulty in all seeds at once; the held-out split is the measure of learning.", "",
        "| | held-out accuracy | held-out mean reward | mean response tokens | training reward, iterations 1–3 → last 3 |",
        "|---|---|---|---|---|",
        f"| before (untrained) | {before['accuracy']:.3f} ± {before['accuracy_stderr']:.3f} | {before['reward_mean']:.3f} | "
        f"{before['response_length_mean']:.1f} | |",
    ]
    for r in results:
        a, m = r["after"], r["metrics"]
        first, last = (statistics.mean(x["reward_mean"] for x in part) for part in (m[:3], m[-3:]))
        lines.append(f"| after, seed {r['seed']} | {a['accuracy']:.3f} ± {a['accuracy_stderr']:.3f} | {a['reward_mean']:.3f} | "
                     f"{a['response_length_mean']:.1f} | {first:.3f} → {last:.3f} |")
    lines += [
        "",
        f"**Held-out accuracy gain: {statistics.mean(gains):+.3f} (mean over {len(results)} seeds; per seed "
        f"{', '.join(f'{g:+.3f}' for g in gains)}; standard deviation over seeds {sd(gains):.3f}; "
        f"min {min(gains):+.3f}, max {max(gains):+.3f}).** Mean held-out reward {before['reward_mean']:.3f} → "
        f"{statistics.mean(rews):.3f} (sd {sd(rews):.3f}).",
        "",
        f"± after an accuracy is its binomial standard error over the {before['num_prompts']} held-out prompts "
        f"(sqrt(p(1-p)/n)); the seed spread above is the run-to-run variation.",
        "",
        f"Training time per seed (iterations + final evaluation): {train_minutes}.",
        "",
        f"Per-iteration training metrics of each seed: `{args.out}/seed-<s>/metrics.jsonl`; held-out samples: "
        f"`{args.out}/eval-base/eval` and `{args.out}/seed-<s>/eval/iter=*/eval` (Parquet shards; pandas, DuckDB).",
        "",
    ]
    lines += _examples(before, results)
    if trl:
        from learning_trl import report_section

        lines += report_section(before, results, trl, cfg, args.out)
    div = division_labels(d)
    if div and "/" not in str(d.task_config.get("operators", "+-*/")):
        lines += ["## Why no division", "",
                  f"With '/' allowed, {div[0]} of the {d.size} training questions of this configuration are divisions and "
                  f"{div[1]} of those carry a wrong label: reasoning-gym's `basic_arithmetic` prints the divisor it drew but "
                  "divides by another divisor it picks (or falls back to a multiplication while still printing '/'). "
                  "No policy can learn those, so this benchmark leaves '/' out (`operators: \"+-*\"`).", ""]
    return "\n".join(lines)


def with_kept_sections(new: str, doc: Path) -> str:
    """``new`` plus every ``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->`` section of the file
    ``doc`` (if it exists) that ``new`` lacks, appended in their order: the sections other
    benchmarks write into the same file (``benchmarks/distill.py``) survive a rewrite."""
    import re

    old = doc.read_text() if doc.exists() else ""
    kept = [m.group(0) for m in re.finditer(r"<!-- ([a-z0-9_-]+):begin -->.*?<!-- \1:end -->", old, flags=re.S)
            if f"<!-- {m.group(1)}:begin -->" not in new]
    return "\n\n".join([new.rstrip("\n"), *kept]) + "\n" if kept else new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo_learning.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="dotted override, repeatable")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=None, help="default: the preset's")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: the preset's eval.num_prompts)")
    ap.add_argument("--out", default="runs/learning", help="folder for every run and evaluation")
    ap.add_argument("--doc", default=str(ROOT / "docs/learning.md"))
    ap.add_argument("--png", default=str(ROOT / "docs/learning_curve.png"))
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep every iteration's checkpoint (~1.6 GB each)")
    ap.add_argument("--report-only", action="store_true", help="rewrite --doc and --png from {out}/summary.json; runs nothing")
    ap.add_argument("--note", default="", help="a sentence printed under the heading (e.g. how busy the machine was)")
    ap.add_argument("--with-trl", action="store_true",
                    help="also train TRL's GRPOTrainer per seed on the same prompts and score it the same way")
    args = ap.parse_args()
    cfg_path = Path(args.config)
    args.config = str(cfg_path if cfg_path.is_absolute() else ROOT / cfg_path)
    args.config_rel = os.path.relpath(args.config, ROOT)
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    if args.report_only:
        from rft_core.config import load_config

        summary = json.loads((out / "summary.json").read_text())
        cfg = load_config(args.config, list(args.overrides) + ([f"iterations={args.iterations}"] if args.iterations else []) +
                          ([f"eval.num_prompts={args.eval_prompts}"] if args.eval_prompts else []))
        plot(summary["results"], summary["before"], Path(args.png), trl=summary.get("trl"))
        Path(args.doc).write_text(with_kept_sections(report(
            args, cfg, summary["before"], summary["results"], summary["wall_seconds"], Path(args.png), Path(args.doc),
            load_end=summary.get("load_end"), trl=summary.get("trl")), Path(args.doc)))
        print(Path(args.doc).read_text())
        return

    from prefect import flow

    from flows.eval import evaluate
    from rft_core.config import load_config
    from rft_core.models.loading import ensure_default_model

    ensure_default_model()
    base_over = list(args.overrides) + ([f"iterations={args.iterations}"] if args.iterations else []) + \
        ([f"eval.num_prompts={args.eval_prompts}"] if args.eval_prompts else [])
    if args.with_trl:  # fail before an hour of training, not after it
        import importlib.util

        from learning_trl import steps_per_iteration, unmapped_settings

        cfg0 = load_config(args.config, base_over)
        steps_per_iteration(cfg0)
        bad = unmapped_settings(cfg0) + ([] if importlib.util.find_spec("trl") else ["TRL is not installed (the bench extra)"])
        if bad:
            raise SystemExit("--with-trl: " + "; ".join(bad))

    @flow(name="learning-benchmark")
    def learning() -> tuple[dict, list[dict]]:
        cfg = load_config(args.config, [*base_over, f"run_root={out}/base"])
        before = _eval_numbers(evaluate(cfg, None, f"{out}/eval-base"))
        print(f"before: held-out accuracy {before['accuracy']:.3f}, mean reward {before['reward_mean']:.3f}", flush=True)
        results = []
        for seed in args.seeds:
            done = out / f"seed-{seed}" / "result.json"
            if done.exists():
                results.append(json.loads(done.read_text()))
                continue
            cfg_s = load_config(args.config, [*base_over, f"run_root={out}/seed-{seed}", f"rollout.seed={seed}",
                                              f"update.seed={seed}", f"name=learning-seed{seed}"])
            t0 = time.perf_counter()
            rows, policy = train_seed(cfg_s, keep_all=args.keep_checkpoints)
            after = _eval_numbers(evaluate(cfg_s, policy, f"{out}/seed-{seed}/eval/iter={cfg_s.iterations:06d}"))
            res = {"seed": seed, "metrics": rows, "after": after, "train_seconds": time.perf_counter() - t0}
            done.write_text(json.dumps(res, indent=1))
            print(f"seed {seed}: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}", flush=True)
            results.append(res)
        return before, results

    t0 = time.perf_counter()
    before, results = learning()
    trl = None
    if args.with_trl:
        from learning_trl import run_trl_arm

        trl = run_trl_arm(config=args.config, overrides=base_over, seeds=args.seeds, out=out, eval_numbers=_eval_numbers)
    wall = time.perf_counter() - t0
    cfg = load_config(args.config, base_over)
    png, doc = Path(args.png), Path(args.doc)
    plot(results, before, png, trl=trl)
    load_end = os.getloadavg()[0]
    (out / "summary.json").write_text(json.dumps({"before": before, "results": results, "wall_seconds": wall,
                                                  "load_end": load_end, **({"trl": trl} if trl else {})}, indent=1))
    text = report(args, cfg, before, results, wall, png, doc, load_end=load_end, trl=trl)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(with_kept_sections(text, doc))  # benchmarks/distill.py's section stays
    print(text)


if __name__ == "__main__":
    main()
