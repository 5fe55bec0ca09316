"""The markdown section of ``benchmarks/vs_trl.py``: headline table, our per-stage breakdown,
the side-by-side of where a step goes, and the gap to TRL (from the workers' JSON results)."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
from pathlib import Path

SECTION = "## Speed versus TRL's GRPOTrainer (`benchmarks/vs_trl.py`)"
TRL_VARIANTS = ("trl", "trl-save-every-step")
# seconds of the background optimizer-state write: not part of any task's wall time
BACKGROUND_KIND = "optimizer_write_background"


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})" if xs else "-"


def _steps_used(res: dict, skip_first: bool) -> list[dict]:
    s = res["steps"]
    return s[1:] if skip_first and len(s) > 1 else s


def report(results: dict[str, dict], args, overrides: list[str]) -> str:
    """The markdown section: headline table, our per-stage breakdown, the exact command."""
    from rft_core.config import load_config

    cfg = load_config(args.config, overrides)
    d, r, u = cfg.data, cfg.rollout, cfg.update
    cmd = f".venv/bin/python benchmarks/vs_trl.py --steps {args.steps} --config {args.config_rel}" + \
        "".join(f" --set {o}" for o in args.overrides) + (f' --label "{args.label}"' if args.label else "")
    load_after = getattr(args, "load_after", None)
    load = f"{args.load_before:.1f}, after: {load_after:.1f}" if load_after is not None and args.load_before == args.load_before \
        else "not recorded"
    lines = [SECTION, "", *([f"**{args.label}.**", ""] if args.label else []),
             f"Measured {_dt.date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores (load average before: "
             f"{load}), torch CPU float32, TRL {results.get('trl', {}).get('trl_version', '-')}. "
             f"Model SmolLM2-135M-Instruct, task `{d.task}`, {d.prompts_per_iteration} prompts x {r.n_samples_per_prompt} samples "
             f"per step, max_new_tokens {r.max_new_tokens}, temperature {r.temperature}, lr {u.lr}, micro-batch {u.micro_batch_size}, "
             f"one optimizer step per step, KL coefficient {cfg.kl.kl_coef} (a reference forward pass in both). "
             f"{args.steps} steps each, in separate fresh processes run one after the other; "
             f"{'the first step (warm-up) is left out of the median' if args.skip_first else 'every step counts'}.",
             "", f"Command: `{cmd}` (on a quiet machine: `make bench-trl`, 5 steps each, the warm-up step left out; "
             "`--json FILE` keeps the raw numbers).", "",
             "| framework | s/step median (min–max) | generated tok/s | mean response tokens | peak RSS GiB |",
             "|---|---|---|---|---|"]
    for name, res in results.items():
        steps = _steps_used(res, args.skip_first)
        toks = [s["generated_tokens"] / s["generate_seconds"] for s in steps if s.get("generate_seconds")]
        lens = [s["response_length"] for s in steps if s.get("response_length") is not None]
        lines.append(f"| {name} | {_med([s['seconds'] for s in steps])} | {_med(toks)} | "
                     f"{statistics.mean(lens):.1f} | {res['peak_rss_gib']:.2f} |" if lens else
                     f"| {name} | {_med([s['seconds'] for s in steps])} | {_med(toks)} | - | {res['peak_rss_gib']:.2f} |")
    for name in [n for n in results if n not in TRL_VARIANTS]:
        steps = _steps_used(results[name], args.skip_first)
        kinds = ["task", "compute", "model_load", "tokenizer_load", "optimizer_load", "shard_read", "shard_write",
                 "checkpoint_save", "checkpoint_commit", "optimizer_save", "optimizer_wait"]
        lines += ["", f"Per-stage breakdown of `{name}` (median seconds over the steps; task = the whole Prefect task body; "
                      "compute = the stage's own timer: generation, forward/backward passes):", "",
                  "| stage | " + " | ".join(kinds) + " | other |", "|---" * (len(kinds) + 2) + "|"]
        stage_names = [s for s in ("prompts", "rollout", "rewards", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update")
                       if all(s in st["stages"] for st in steps)]
        for stage in stage_names:
            vals = {k: statistics.median(st["stages"][stage].get(k, 0.0) for st in steps) for k in kinds}
            other = vals["task"] - sum(v for k, v in vals.items() if k != "task")
            lines.append(f"| {stage} | " + " | ".join(f"{vals[k]:.2f}" for k in kinds) + f" | {other:.2f} |")
        step_s = statistics.median(s["seconds"] for s in steps)
        crit = statistics.median(s["critical_path"] for s in steps)
        prefect = statistics.median(s["seconds"] - s["critical_path"] for s in steps)
        tot = lambda kind: statistics.median(sum(v.get(kind, 0.0) for v in s["stages"].values()) for s in steps)  # noqa: E731
        shard_io = tot("shard_read") + tot("shard_write")
        ckpt = tot("checkpoint_save") + tot("checkpoint_commit") + tot("optimizer_save") + tot("optimizer_wait")
        background = tot(BACKGROUND_KIND)
        loads = tot("model_load") + tot("tokenizer_load") + tot("optimizer_load")
        lines += ["", f"- step (iteration subflow, incl. its orchestration): {step_s:.2f} s; critical path of the stage tasks "
                      f"(actor/ref/rewards run concurrently: counted at their longest): {crit:.2f} s",
                  f"- Prefect orchestration (step minus critical path): {prefect:.2f} s ({100 * prefect / step_s:.1f}%)",
                  f"- shard reads + writes, all stages: {shard_io:.2f} s ({100 * shard_io / step_s:.1f}%)",
                  (f"- checkpoint save + checksums on the critical path (the weights; waiting for the AdamW state's background "
                   f"write): {ckpt:.2f} s ({100 * ckpt / step_s:.1f}%); the background write itself: {background:.2f} s, "
                   "overlapping the next iteration's stages" if background else
                   f"- checkpoint save + checksums (weights and AdamW state, every step): {ckpt:.2f} s ({100 * ckpt / step_s:.1f}%)"),
                  f"- model, tokenizer and optimizer-state loads, all stages: {loads:.2f} s ({100 * loads / step_s:.1f}%)",
                  f"- orchestration + persistence (Prefect + shards + checkpoint): "
                  f"{100 * (prefect + shard_io + ckpt) / step_s:.1f}% of the step"]
    if "trl" in results and "ours" in results:
        lines += ["", *_side_by_side(results, args.skip_first), "", _gap(results, args.skip_first)]
    lines += ["", "Raw per-step numbers: the JSON written by `--json` (`--from-json` rewrites this section from it).", ""]
    return "\n".join(x for x in lines if x is not None)


def _side_by_side(results: dict[str, dict], skip_first: bool) -> list[str]:
    """Median seconds per step of comparable parts, every framework in one table."""
    def med(xs):
        xs = list(xs)
        return statistics.median(xs) if xs else float("nan")

    rows: dict[str, dict[str, float]] = {}
    for name, res in results.items():
        steps = _steps_used(res, skip_first)
        if name in TRL_VARIANTS:
            if not all("generate_and_score" in s for s in steps):
                continue
            rows[name] = {
                "generation": med(s["generate_seconds"] for s in steps),
                "rewards + log-prob passes (reference; actor if any)": med(s["generate_and_score"] - s["generate_seconds"] for s in steps),
                "policy update (forward, backward, optimizer)": med(
                    s["seconds"] - s["generate_and_score"] - s.get("checkpoint", 0.0) for s in steps),
                "checkpoint save + checksums": med(s.get("checkpoint", 0.0) for s in steps), "model/tokenizer/optimizer loads": 0.0, "shard reads + writes": 0.0,
                "orchestration": 0.0, "step": med(s["seconds"] for s in steps)}
            continue
        st = lambda s, stage, kind="task": s["stages"].get(stage, {}).get(kind, 0.0)  # noqa: E731
        tot = lambda s, kinds: sum(v.get(k, 0.0) for v in s["stages"].values() for k in kinds)  # noqa: E731
        rows[name] = {
            "generation": med(st(s, "rollout", "compute") for s in steps),
            "rewards + log-prob passes (reference; actor if any)": med(
                max(st(s, x) for x in ("rewards", "actor_logprobs", "ref_logprobs")) for s in steps),
            "policy update (forward, backward, optimizer)": med(st(s, "ppo_update", "compute") for s in steps),
            "checkpoint save + checksums": med(tot(s, ("checkpoint_save", "checkpoint_commit", "optimizer_save", "optimizer_wait"))
                                               for s in steps),
            "model/tokenizer/optimizer loads": med(tot(s, ("model_load", "tokenizer_load", "optimizer_load")) for s in steps),
            "shard reads + writes": med(tot(s, ("shard_read", "shard_write")) for s in steps),
            "orchestration": med(s["seconds"] - s["critical_path"] for s in steps),
            "step": med(s["seconds"] for s in steps)}
    if "trl" not in rows:
        return []
    names = list(rows)
    out = ["Where a step goes (median seconds; the log-prob passes of ours run concurrently with the rewards and are "
           "counted at the longest; TRL's update row is its step minus generation and scoring):", "",
           "| part | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for part in rows[names[0]]:
        out.append(f"| {part} | " + " | ".join(f"{rows[n][part]:.1f}" for n in names) + " |")
    return out


def _gap(results: dict[str, dict], skip_first: bool) -> str:
    """Where our step's extra seconds over TRL's go (medians over the steps)."""
    med = lambda name: statistics.median(s["seconds"] for s in _steps_used(results[name], skip_first))  # noqa: E731
    steps = _steps_used(results["ours"], skip_first)
    tot = lambda kind: statistics.median(sum(v.get(kind, 0.0) for v in s["stages"].values()) for s in steps)  # noqa: E731
    actor = statistics.median(s["stages"].get("actor_logprobs", {}).get("task", 0.0) for s in steps)
    parts = {"checkpoint save + checksums": tot("checkpoint_save") + tot("checkpoint_commit") + tot("optimizer_save")
             + tot("optimizer_wait"),
             "model/tokenizer/optimizer loads": tot("model_load") + tot("tokenizer_load") + tot("optimizer_load"),
             "Prefect orchestration": statistics.median(s["seconds"] - s["critical_path"] for s in steps),
             "shard reads + writes": tot("shard_read") + tot("shard_write"),
             "the actor (old log-prob) pass, concurrent with the reference pass": actor}
    gap = med("ours") - med("trl")
    text = (f"Ours minus TRL: {gap:+.1f} s per step (median {med('ours'):.1f} s vs {med('trl'):.1f} s). Costs TRL does "
            "not have, per step: " + "; ".join(f"{k} {v:.1f} s" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])) + ".")
    if "ours-matched" in results:
        text += f" Without the actor pass (`ours-matched`): {med('ours-matched'):.1f} s per step ({med('ours-matched') - med('trl'):+.1f} s vs TRL)."
    return text


def with_findings(section: str, findings: str | None) -> str:
    """``section`` followed by the markdown of the ``findings`` file (None: unchanged)."""
    if not findings:
        return section
    return section.rstrip("\n") + "\n\n" + Path(findings).read_text().strip() + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of ``path`` (from its heading to the next ``## `` or
    the end), or append it; the rest of the file is left as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    path.write_text(text.rstrip("\n") + "\n")
