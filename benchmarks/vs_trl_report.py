"""The markdown section of ``benchmarks/vs_trl.py``: headline table, the ratio of seconds per step
to TRL's, the distance to the machine's GEMM rate (FLOPs per step, achieved GFLOP/s, issue 19),
our per-stage breakdown, the side-by-side of where a step goes, and the gap to TRL (from the
workers' JSON results). Fields an older JSON lacks (token counts, GEMM rate) leave their lines out."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
from pathlib import Path

try:  # run as a script (vs_trl.py): benchmarks/ is on sys.path
    from flops import DEFAULT_PASSES, PARTS, ModelDims, step_flops
except ModuleNotFoundError:  # imported as benchmarks.vs_trl_report (tests)
    from benchmarks.flops import DEFAULT_PASSES, PARTS, ModelDims, step_flops

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
    measured = getattr(args, "measured", None) or _dt.date.today()  # the run's date (JSON's _measured), else today
    lines = [SECTION, "", *([f"**{args.label}.**", ""] if args.label else []),
             f"Measured {measured} on {platform.machine()}, {os.cpu_count()} CPU cores (load average before: "
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
    lines += _variants_line(results)
    lines += _ratio_line(results, args.skip_first)
    lines += flops_section(results, args.skip_first, getattr(args, "gemm_before", None), getattr(args, "gemm_after", None))
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


def _step_seconds(res: dict, skip_first: bool) -> float:
    """Median seconds per step of a framework's result (the warm-up step left out if asked)."""
    return statistics.median(s["seconds"] for s in _steps_used(res, skip_first))


def _variants_line(results: dict[str, dict]) -> list[str]:
    """A line naming each variant's config overrides (from the workers' ``variant_overrides``;
    nothing for a JSON without them)."""
    named = {n: r["variant_overrides"] for n, r in results.items() if "variant_overrides" in r}
    if not named:
        return []
    trl = {"trl": "TRL's GRPOTrainer with the preset's settings, no checkpoints",
           "trl-save-every-step": "TRL saving a full checkpoint after every step"}
    desc = [f"`{n}` ({trl[n] if n in trl else ', '.join(f'`{o}`' for o in ov) or 'the preset as is'})"
            for n, ov in named.items()]
    return ["", "Variants: " + "; ".join(desc) + "."]


def _ratio_line(results: dict[str, dict], skip_first: bool) -> list[str]:
    """``ours / TRL`` seconds per step (medians) for every variant of ours; nothing without ``trl``."""
    if "trl" not in results:
        return []
    trl = _step_seconds(results["trl"], skip_first)
    ratios = [f"{_step_seconds(r, skip_first) / trl:.2f} (`{n}`)" for n, r in results.items() if n not in TRL_VARIANTS]
    return ["", "Seconds per step, ours / TRL (medians): " + ", ".join(ratios) + "."] if ratios else []


def _passes_text(passes: dict | None) -> str:
    """The log-prob passes of a step, e.g. ``ref + actor``: ``passes`` counts per part
    (missing: ``DEFAULT_PASSES``)."""
    passes = {**DEFAULT_PASSES, **(passes or {})}

    def n(x: float) -> str:
        return "" if x == 1 else f" x{x:g}"
    parts = [f"{label}{n(passes[k])}" for k, label in (("ref_logprobs", "ref"), ("actor_logprobs", "actor"))
             if passes.get(k, 0)]
    return " + ".join(parts) or "none"


def step_flop_counts(res: dict, step: dict) -> dict[str, int] | None:
    """FLOPs per part of one recorded step (``benchmarks.flops.step_flops`` over its
    ``samples`` and ``passes`` with the result's ``model`` shape), or None when the result does
    not record them (JSON of an older run)."""
    if not res.get("model") or step.get("samples") is None:
        return None
    return step_flops(ModelDims.from_config(res["model"]), step["samples"], step.get("passes"))


def _part_seconds(name: str, step: dict) -> tuple[float | None, float | None]:
    """Wall seconds of a step's generation and of its policy update (forward, backward,
    optimizer), as in the side-by-side table; None where not recorded."""
    if name in TRL_VARIANTS:
        gen = step.get("generate_seconds")
        upd = step["seconds"] - step["generate_and_score"] - step.get("checkpoint", 0.0) if "generate_and_score" in step else None
        return gen, upd
    stages = step.get("stages", {})
    return stages.get("rollout", {}).get("compute"), stages.get("ppo_update", {}).get("compute")


def _gemm_text(gemm: dict) -> str:
    """``gemm_rate.py``'s result as text: median and best round, GFLOP/s."""
    return f"{gemm['gflops_median']:.1f} (best round {gemm['gflops_best']:.1f})"


def flops_section(results: dict[str, dict], skip_first: bool, gemm_before: dict | None, gemm_after: dict | None) -> list[str]:
    """The distance to the physical limit (issue 19): the machine's sustained float32 GEMM rate
    before and after the runs, and per framework the FLOPs of a step (TFLOP, median over the
    steps, by part), the achieved rate (GFLOP/s: the step's FLOPs over its wall seconds, median
    over the steps), its fraction of the GEMM rate, and the rates of generation and of the update
    alone. Lines whose inputs the results lack are left out (empty list: nothing recorded)."""
    gemms = [g for g in (gemm_before, gemm_after) if g]
    peak = max((g["gflops_median"] for g in gemms), default=None)  # GFLOP/s
    out: list[str] = []
    if gemms:
        g = gemms[0]
        when = [f"{_gemm_text(gemm_before)} before the runs" if gemm_before else None,
                f"{_gemm_text(gemm_after)} after" if gemm_after else None]
        out += ["", f"Sustained float32 GEMM rate of this machine (`benchmarks/gemm_rate.py`: {g['n']} x {g['n']} "
                    f"`torch.matmul`, {g['threads']} threads, median of {len(g['gflops_rounds'])} rounds, GFLOP/s): "
                    + ", ".join(w for w in when if w) + ". The fractions below are of the higher median, "
                    f"{peak:.1f} GFLOP/s."]
    med = statistics.median
    rows = []
    for name, res in results.items():
        steps = _steps_used(res, skip_first)
        counts = [c for c in (step_flop_counts(res, s) for s in steps) if c is not None]
        if not steps or len(counts) < len(steps):  # not recorded (an older JSON)
            continue
        rate = med(c["total"] / s["seconds"] / 1e9 for c, s in zip(counts, steps))  # GFLOP/s
        secs = [_part_seconds(name, s) for s in steps]
        gen = [c["generation"] / g / 1e9 for c, (g, _) in zip(counts, secs) if g]
        upd = [c["update"] / u / 1e9 for c, (_, u) in zip(counts, secs) if u]
        tf = {k: med(c[k] for c in counts) / 1e12 for k in (*PARTS, "total")}
        rows.append(f"| {name} | {_passes_text(steps[-1].get('passes'))} | {tf['generation']:.2f} | "
                    f"{tf['actor_logprobs'] + tf['ref_logprobs']:.2f} | {tf['update']:.2f} | {tf['total']:.2f} | {rate:.1f} | "
                    + (f"{100 * rate / peak:.1f}% | " if peak else "- | ")
                    + (f"{med(gen):.1f} | " if gen else "- | ") + (f"{med(upd):.1f} |" if upd else "- |"))
    if rows:
        header = ("| framework | log-prob passes | TFLOP generation | TFLOP log-prob passes | TFLOP update "
                  "| TFLOP per step | achieved GFLOP/s | of the GEMM rate | generation GFLOP/s | update GFLOP/s |")
        intro = ("Distance to the physical limit (TFLOP per step: median over the steps; achieved = the step's FLOPs "
                 "over its wall seconds, median over the steps; generation and update rates: their FLOPs over "
                 "their own seconds, as in the side-by-side table below):")
        how = ("How FLOPs are counted (`benchmarks/flops.py`): as Kaplan et al. 2020 (arXiv:2001.08361, Table 1) "
               "and Chinchilla (arXiv:2203.15556, Appendix F), adapted to grouped-query attention and the SwiGLU MLP: "
               "per token per layer 2 FLOPs per weight of the q/k/v/o projections and the MLP, plus 4 x context x "
               "width for attention scores and values (causal), plus 2 x width x vocabulary for each position whose "
               "logits are computed. Only real "
               "tokens count (no padding), the same formula for both frameworks on each one's own prompt and response "
               "lengths: generation = prefill + one decode step per response token, logits where a token is sampled; "
               "each log-prob pass (reference; actor when the old log-probs are recomputed) = prompt + response "
               "through the model, logits at the response positions; the update = 3x that forward (forward + "
               "backward). Norms, softmax, sampling and the AdamW step are left out (well under 1%).")
        out += ["", intro, "", header, "|---" * 10 + "|", *rows, "", how]
    return out


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
             "shard reads + writes": tot("shard_read") + tot("shard_write")}
    if actor:  # the variant recomputes the old log-probs (TRL with num_iterations=1 does not)
        parts["the actor (old log-prob) pass, concurrent with the reference pass"] = actor
    gap = med("ours") - med("trl")
    text = (f"Ours minus TRL: {gap:+.1f} s per step (median {med('ours'):.1f} s vs {med('trl'):.1f} s). Costs TRL does "
            "not have, per step: " + "; ".join(f"{k} {v:.1f} s" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])) + ".")
    for name in [n for n in results if n not in TRL_VARIANTS and n != "ours"]:
        has_actor = any("actor_logprobs" in s["stages"] for s in _steps_used(results[name], skip_first))
        text += (f" `{name}` ({'with' if has_actor else 'without'} the actor pass): {med(name):.1f} s per step "
                 f"({med(name) - med('trl'):+.1f} s vs TRL).")
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
