"""Benchmark: on-policy distillation against GRPO from the same start, on held-out prompts, several seeds.

1. The teacher: GRPO on the learning preset (configs/grpo_learning.yaml) for ``--teacher-iterations``
   iterations with seed ``--teacher-seed`` (not one of the arms' seeds), trained as the learning
   benchmark trains its checkpoints (``benchmarks/learning.py:train_seed``, into ``{out}/teacher``);
   or ``--teacher PATH``, any checkpoint with the student's tokenizer (e.g. a finished
   ``make bench-learning`` seed: ``runs/learning/seed-0/iter=000012/ppo_update-policy/policy``).
2. The untrained student (the preset's policy) and the teacher are scored on the held-out split
   (``flows/eval.py``: greedy, question texts disjoint from the training data).
3. For each seed, from the same untrained student and on the same prompts: ``iterations``
   iterations of distillation alone (``teacher.path`` = the teacher, ``teacher.use_task_rewards``
   false: every token's advantage is log nu - log pi_old; the rewards are still scored) into
   ``{out}/distill-seed-{s}``, and the same number of GRPO iterations (the preset as it is) into
   ``{out}/grpo-seed-{s}``. Each final checkpoint is scored on the held-out split.
4. The report: a section of ``--doc`` (docs/learning.md) between the markers ``<!-- distill:begin -->``
   and ``<!-- distill:end -->`` (replaced, or appended; ``benchmarks/learning.py`` keeps it when
   it rewrites the file) and the raw numbers in ``--json`` (docs/raw/distill.json).

A finished arm and seed (``{out}/<arm>-seed-{s}/result.json``) and a finished teacher
(``{out}/teacher/result.json``) are not rerun, so an interrupted benchmark continues with
``--out`` unchanged.

    .venv/bin/python benchmarks/distill.py                       # 3 seeds x 2 arms + the teacher -> docs/learning.md
    make bench-distill

Time on a quiet 2-core CPU, estimated from docs/learning.md's measured GRPO seeds (12 iterations and
the final evaluation: 8.7-9.1 min each): the teacher ~9 min, each GRPO seed ~9 min, each
distillation seed ~10 min (one more forward pass of the 135M teacher over the iteration's 64
sequences, like the reference pass: ~11 s next to the ~55 s of a learning-preset iteration), two extra
evaluations ~2 min: ~9 + 3 x (9 + 10.5) + 2 = ~70 min.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own modules, imported as scripts

from _env import ROOT  # noqa: E402  (repository on sys.path, offline environment)
from learning import _eval_numbers, train_seed  # noqa: E402
from learning_trl import compare_gains, spread  # noqa: E402

BEGIN, END = "<!-- distill:begin -->", "<!-- distill:end -->"
ARMS = ("distill", "grpo")


def arm_overrides(arm: str, teacher: str) -> list[str]:
    """The overrides of ``arm`` on top of the preset: distillation alone with ``teacher``, or none (GRPO)."""
    return [f"teacher.path={teacher}", "teacher.use_task_rewards=false"] if arm == "distill" else []


def replace_section(text: str, section: str) -> str:
    """``text`` with the part between ``BEGIN`` and ``END`` (markers included) replaced by
    ``section`` (which carries the markers), or ``section`` appended when there is none."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + section + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + section + "\n"


def summarise(before: dict, teacher: dict, results: dict[str, list[dict]]) -> dict:
    """Held-out accuracy gains over the untrained student per arm (``learning_trl.spread``) and
    distillation minus GRPO (``learning_trl.compare_gains``: Welch, two-sided 5%)."""
    gains = {arm: [r["after"]["accuracy"] - before["accuracy"] for r in results[arm]] for arm in ARMS}
    cmp = compare_gains(gains["distill"], gains["grpo"])
    return {"gains": {arm: spread(g) for arm, g in gains.items()}, "per_seed": gains,
            "teacher_gain": teacher["accuracy"] - before["accuracy"],
            "distill_minus_grpo": {k: cmp[k] for k in ("diff", "se", "t", "df", "t_crit", "verdict")}}


def _shown(path: str) -> str:
    """``path`` as the docs show it: relative to its ``runs/`` folder when it has one (the
    checkout it ran in differs between machines), else unchanged."""
    head, sep, tail = path.rpartition("/runs/")
    return f"runs/{tail}" if sep else path


def report_section(args, cfg, teacher_label: str, before: dict, teacher: dict, results: dict[str, list[dict]],
                   summary: dict, wall: float) -> str:
    """The markdown section for docs/learning.md, from the measured numbers."""
    d, ro, u = cfg.data, cfg.rollout, cfg.update
    g, c = summary["gains"], summary["distill_minus_grpo"]
    cmd = " ".join([".venv/bin/python benchmarks/distill.py", f"--config {args.config_rel}",
                    f"--seeds {' '.join(map(str, args.seeds))}", f"--iterations {cfg.iterations}",
                    f"--eval-prompts {cfg.eval.num_prompts}", *(f"--set {o}" for o in args.overrides),
                    f"--teacher {args.teacher}" if args.teacher else f"--teacher-iterations {args.teacher_iterations} "
                    f"--teacher-seed {args.teacher_seed}", f"--out {args.out}"])
    lines = [BEGIN, "## On-policy distillation against GRPO (`benchmarks/distill.py`, issue 38)", "",
             f"Generated on {_dt.date.today()}, {platform.machine()}, {os.cpu_count()} CPU cores, torch CPU float32; "
             f"training time of the {sum(map(len, results.values()))} arms "
             f"{sum(r['train_seconds'] for rs in results.values() for r in rs) / 60:.1f} min (each arm's own, also when an "
             f"earlier invocation ran it), wall time of this invocation {wall / 60:.1f} min. Raw numbers: "
             f"`{os.path.relpath(args.json, ROOT)}`." + (f" {args.note}" if args.note else ""),
             "", f"Command: `{cmd}`", "",
             f"- Teacher: {teacher_label}; held-out accuracy {teacher['accuracy']:.3f} ± {teacher['accuracy_stderr']:.3f}.",
             f"- Student: the untrained `{cfg.policy.path}` (held-out accuracy {before['accuracy']:.3f} ± "
             f"{before['accuracy_stderr']:.3f}), {cfg.iterations} iterations x {d.prompts_per_iteration} prompts x "
             f"{ro.n_samples_per_prompt} samples (temperature {ro.temperature}, max {ro.max_new_tokens} new tokens), lr "
             f"{u.lr}, {u.train_batch_size or 'all'} sequences per optimizer step, the same prompts in the same order in "
             "both arms.",
             "- `distill`: distillation alone (`teacher.use_task_rewards: false`): each action token's advantage is "
             "log ν(y_t) − log π_old(y_t) (the teacher at the rollout temperature), the task reward is scored but not "
             f"trained on. `grpo`: the preset's `{cfg.advantage.estimator}` on the task reward.",
             f"- Held-out split: {before['num_prompts']} prompts (greedy), as the section above. Seeds: "
             f"{', '.join(map(str, args.seeds))} (`rollout.seed`, `update.seed`).", "",
             "| arm | seed | held-out accuracy | gain | held-out mean reward | mean response tokens | "
             "training reward, first 3 → last 3 iterations |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        for r, gain in zip(results[arm], summary["per_seed"][arm]):
            a, m = r["after"], r["metrics"]
            first, last = (statistics.mean(x["reward_mean"] for x in part) for part in (m[:3], m[-3:]))
            lines.append(f"| {arm} | {r['seed']} | {a['accuracy']:.3f} ± {a['accuracy_stderr']:.3f} | {gain:+.3f} | "
                         f"{a['reward_mean']:.3f} | {a['response_length_mean']:.1f} | {first:.3f} → {last:.3f} |")
    se = f"{c['se']:.3f}" if c["se"] is not None else "n/a (one seed)"
    lines += ["", f"**Held-out accuracy gain over the untrained student after {cfg.iterations} iterations: distillation "
              f"{g['distill']['mean']:+.3f} (sd {g['distill']['sd']:.3f} over {g['distill']['n']} seeds), GRPO "
              f"{g['grpo']['mean']:+.3f} (sd {g['grpo']['sd']:.3f}); distillation − GRPO {c['diff']:+.3f}, standard error "
              f"{se} (Welch): {c['verdict']} at the two-sided 5% level.** The teacher itself: "
              f"{summary['teacher_gain']:+.3f}.", "",
              "± after an accuracy is its binomial standard error over the held-out prompts; the seed spread is the "
              f"run-to-run variation. Per-iteration metrics (`distill_reverse_kl`: the mean of log π_old − log ν over "
              f"the action tokens, the k1 estimate of the reverse KL the student minimises): "
              f"`{args.out}/<arm>-seed-<s>/metrics.jsonl`.", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo_learning.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="dotted override of both arms, repeatable")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=None, help="iterations of each arm (default: the preset's)")
    ap.add_argument("--teacher", default=None, help="a checkpoint to distil from (default: train one with GRPO here)")
    ap.add_argument("--teacher-iterations", type=int, default=None, help="GRPO iterations of the teacher (default: the "
                    "preset's)")
    ap.add_argument("--teacher-seed", type=int, default=100, help="rollout/update seed of the teacher's GRPO run")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: the preset's)")
    ap.add_argument("--out", default="runs/distill", help="folder for every run and evaluation")
    ap.add_argument("--doc", default=str(ROOT / "docs/learning.md"), help="markdown file whose distill section is written")
    ap.add_argument("--json", default=str(ROOT / "docs/raw/distill.json"), help="raw numbers")
    ap.add_argument("--note", default="", help="a sentence printed under the heading (e.g. how busy the machine was)")
    args = ap.parse_args(argv)
    cfg_path = Path(args.config)
    args.config = str(cfg_path if cfg_path.is_absolute() else ROOT / cfg_path)
    args.config_rel = os.path.relpath(args.config, ROOT)
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    from prefect import flow

    from flows.eval import evaluate
    from rft_core.config import load_config
    from rft_core.api import policy_checkpoint_folder
    from rft_core.models.loading import ensure_default_model
    from rft_core.stages.teacher import check_teacher_tokenizer

    ensure_default_model()
    base = list(args.overrides) + ([f"eval.num_prompts={args.eval_prompts}"] if args.eval_prompts else [])
    arms_over = base + ([f"iterations={args.iterations}"] if args.iterations else [])
    args.teacher_iterations = args.teacher_iterations or load_config(args.config, base).iterations

    def seed_over(seed: int, root: Path, name: str) -> list[str]:
        return [f"run_root={root}", f"rollout.seed={seed}", f"update.seed={seed}", f"name={name}"]

    @flow(name="distill-benchmark")
    def bench() -> tuple[str, str, dict, dict, dict[str, list[dict]]]:
        cfg = load_config(args.config, [*arms_over, f"run_root={out}/base"])
        before = _eval_numbers(evaluate(cfg, None, f"{out}/eval-base"))
        done = out / "teacher" / "result.json"
        if args.teacher:
            teacher_path, label = args.teacher, f"`{args.teacher}`"
            teacher = _eval_numbers(evaluate(cfg, teacher_path, f"{out}/eval-teacher"))
        elif done.exists():
            record = json.loads(done.read_text())
            teacher_path, label, teacher = record["path"], record["label"], record["after"]
            label = label.replace(f"`{teacher_path}`", f"`{_shown(teacher_path)}`")
        else:  # GRPO on the preset, as the learning benchmark trains its checkpoints
            cfg_t = load_config(args.config, [*base, f"iterations={args.teacher_iterations}",
                                              *seed_over(args.teacher_seed, out / "teacher", "distill-teacher")])
            _, policy = train_seed(cfg_t, keep_all=False)
            teacher_path = policy_checkpoint_folder(policy)
            label = (f"`{cfg_t.policy.path}` after {cfg_t.iterations} GRPO iterations of the preset (seed "
                     f"{args.teacher_seed}; `{_shown(teacher_path)}`)")
            teacher = _eval_numbers(evaluate(cfg_t, policy, f"{out}/eval-teacher"))
            done.write_text(json.dumps({"path": teacher_path, "label": label, "after": teacher}, indent=1))
        print(f"teacher {teacher_path}: {check_teacher_tokenizer(cfg.policy.path, teacher_path)}; held-out accuracy "
              f"{before['accuracy']:.3f} (student) vs {teacher['accuracy']:.3f} (teacher)", flush=True)
        results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for seed in args.seeds:
            for arm in ARMS:
                root = out / f"{arm}-seed-{seed}"
                finished = root / "result.json"
                if finished.exists():
                    results[arm].append(json.loads(finished.read_text()))
                    continue
                cfg_s = load_config(args.config, [*arms_over, *arm_overrides(arm, teacher_path),
                                                  *seed_over(seed, root, f"distill-bench-{arm}-seed{seed}")])
                t0 = time.perf_counter()
                rows, policy = train_seed(cfg_s, keep_all=False)
                after = _eval_numbers(evaluate(cfg_s, policy, f"{root}/eval/iter={cfg_s.iterations:06d}"))
                res = {"arm": arm, "seed": seed, "metrics": rows, "after": after, "train_seconds": time.perf_counter() - t0}
                finished.write_text(json.dumps(res, indent=1))
                print(f"{arm} seed {seed}: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}", flush=True)
                results[arm].append(res)
        return teacher_path, label, before, teacher, results

    t0 = time.perf_counter()
    teacher_path, label, before, teacher, results = bench()
    wall = time.perf_counter() - t0
    cfg = load_config(args.config, arms_over)
    summary = summarise(before, teacher, results)
    record = {"before": before, "teacher": {"path": teacher_path, **teacher}, "results": results, "summary": summary,
              "wall_seconds": wall, "load_end": os.getloadavg()[0]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    doc = Path(args.doc)
    section = report_section(args, cfg, label, before, teacher, results, summary, wall)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(replace_section(doc.read_text() if doc.exists() else "", section))
    print(section)
    return record


if __name__ == "__main__":
    main()
