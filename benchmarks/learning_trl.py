"""The TRL arm of the learning benchmark (``benchmarks/learning.py --with-trl``, issue 19):
TRL's ``GRPOTrainer`` trained on the same prompts with the preset's settings, one fresh process
per seed, and its final model scored by OUR held-out evaluation (``flows/eval.py``), exactly as
``learning.py`` scores our own final policy.

Per seed ``s`` (everything under ``{out}/trl-seed-{s}``):

1. A worker process (``python benchmarks/learning_trl.py --config ... --seed s ...``) builds the
   training set of our iterations 1..N (``rft_core.data.prompts.iteration_indices``: the same
   prompts in the same order, the preset's system prompt, chat messages), maps the preset to a
   ``GRPOConfig`` (``grpo_config_kwargs``), trains ``N x steps per iteration`` optimizer steps
   with the reward our ``reward.grader`` + ``reward.format_reward`` compute
   (``rft_core.rewards.math.score_response``, as ``benchmarks/vs_trl.py``), and writes the final
   model with our checkpoint writer (``rft_core.training.checkpoint.save_checkpoint``: the
   weights and the base model's tokenizer, as our ``ppo_update`` stage) to ``model/``; TRL's raw
   ``log_history`` and the mapping go to ``trl.json``.
2. The parent evaluates ``model/`` with ``flows.eval.evaluate`` into ``eval/`` (greedy, the
   held-out prompts of ``before``, the training reward as grader) and writes ``result.json``
   (reused when the benchmark is started again with the same ``--out``).

Mapping of ``configs/grpo_learning.yaml`` (12 iterations x 8 prompts x 8 samples, 32 sequences
per optimizer step): ``per_device_train_batch_size`` = ``update.micro_batch_size`` (8),
``gradient_accumulation_steps`` = 32 / 8 = 4, ``steps_per_generation`` = 64 / 8 = 8 (one
generation of 64 completions feeds 2 optimizer steps), ``max_steps`` = 12 x 2 = 24,
``num_generations`` 8, temperature 0.8, top_p 1, top_k 0 (off), ``max_completion_length`` 64,
lr 1e-5 constant without warmup, AdamW betas (0.9, 0.999), weight decay 0, ``max_grad_norm`` 1,
``beta`` 0 (no reference model), ``epsilon`` 0.2 (both sides), ``num_iterations`` 1,
``scale_rewards='group'`` ((r - group mean) / (group std + 1e-4), Bessel std: ours divides by
std + 1e-6), ``shuffle_dataset=False``, ``mask_truncated_completions=False``.

``loss_type='dapo'``: our ``token-mean`` divides an optimizer step's summed token losses by the
response tokens of that step's 32 sequences. TRL's ``dapo`` divides by the tokens of the whole
generation of 64 times gradient_accumulation_steps / steps_per_generation (= half of them): the
same normaliser in expectation, off per step by the ratio of the two halves' token counts.
``bnpo`` would average the token means of the micro-batches of 8, ``grpo`` / ``dr_grpo`` are
other aggregations (per-sequence mean; a constant 64 tokens per sequence).

Settings this arm cannot map (KL to a reference, other estimators, losses or aggregations,
reward sources, shaping, dynamic sampling, LoRA, agents, file datasets) are refused
(``unmapped_settings``). Stdlib only at import time (the pure helpers are unit-tested in
``tests/benchmarks/test_learning_trl.py``); TRL is the ``bench`` extra.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# two-sided 5% critical values of Student's t by degrees of freedom (any statistics table)
_T_CRIT_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
              12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


# ------------------------------------------------------------------------------ pure helpers
def unmapped_settings(cfg) -> list[str]:
    """The settings of ``cfg`` (a TrainConfig) this TRL arm cannot reproduce; empty when it can."""
    u, r, d = cfg.update, cfg.rollout, cfg.data
    checks = [
        (d.source == "reasoning_gym", "data.source must be reasoning_gym"),
        (d.prompt_template is None, "data.prompt_template (TRL applies the chat template)"),
        (cfg.policy.dtype == "float32", "policy.dtype must be float32"),
        (cfg.advantage.estimator in ("grpo", "group_norm"), "advantage.estimator must be grpo"),
        (u.policy_loss.name == "ppo_clip", "update.policy_loss must be ppo_clip"),
        (u.loss_agg == "token-mean", "update.loss_agg must be token-mean (TRL loss_type dapo)"),
        (cfg.kl.kl_coef == 0, "kl.kl_coef must be 0 (TRL's KL is k3 on its own reference pass)"),
        (u.entropy_coef == 0 and u.entropy_top_fraction is None, "no entropy bonus or filter"),
        (u.lora is None and u.deepspeed is None and u.cpgd_drift_coef == 0, "no LoRA, DeepSpeed or CPGD drift"),
        (not cfg.reward.sources and not cfg.reward.recipes, "reward: grader + format_reward only"),
        (cfg.shaping == type(cfg.shaping)() and not cfg.dynamic_sampling.enabled, "no shaping or dynamic sampling"),
        (r.agent is None and r.first_token_temperature is None, "no agent rollout, no FIRE"),
    ]
    return [why for ok, why in checks if not ok]


def steps_per_iteration(cfg) -> int:
    """Optimizer steps per iteration: the iteration's sequences / ``update.train_batch_size``.

    Raises:
        ValueError: the sequences are not a multiple of the step, or the step of the micro-batch.
    """
    n_seq = cfg.data.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    per_step = cfg.update.train_batch_size or n_seq
    if n_seq % per_step or per_step % cfg.update.micro_batch_size:
        raise ValueError(f"prompts x samples ({n_seq}) must be a multiple of update.train_batch_size ({per_step}), "
                         f"and that of update.micro_batch_size ({cfg.update.micro_batch_size})")
    return n_seq // per_step


def grpo_config_kwargs(cfg, *, seed: int, output_dir: str, use_cpu: bool = True) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments reproducing ``cfg`` (module docstring: the mapping)."""
    d, r, u = cfg.data, cfg.rollout, cfg.update
    micro = u.micro_batch_size
    per_step = u.train_batch_size or d.prompts_per_iteration * r.n_samples_per_prompt
    return {
        "output_dir": output_dir, "max_steps": cfg.iterations * steps_per_iteration(cfg),
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": per_step // micro,
        "steps_per_generation": d.prompts_per_iteration * r.n_samples_per_prompt // micro,
        "num_generations": r.n_samples_per_prompt, "max_completion_length": r.max_new_tokens, "temperature": r.temperature,
        "top_p": r.top_p, "top_k": 0, "learning_rate": u.lr, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": u.weight_decay, "adam_beta1": u.betas[0], "adam_beta2": u.betas[1], "adam_epsilon": 1e-8,
        "max_grad_norm": u.max_grad_norm, "beta": cfg.kl.kl_coef, "epsilon": u.policy_loss.clip_low,
        "epsilon_high": u.policy_loss.clip_high, "num_iterations": u.epochs, "loss_type": "dapo",
        "scale_rewards": "group" if getattr(cfg.advantage, "scale_by_std", True) else "none",
        "mask_truncated_completions": False, "shuffle_dataset": False, "disable_dropout": not u.dropout,
        "activation_checkpointing": u.gradient_checkpointing, "use_cpu": use_cpu, "bf16": False, "fp16": False,
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "dataloader_num_workers": 0, "seed": seed,
        "data_seed": seed, "disable_tqdm": True}


def iteration_metrics(log_history: list[dict], per_iteration: int) -> list[dict]:
    """TRL's per-step log rows folded into our per-iteration rows: ``iteration``, ``reward_mean``
    (mean reward of that generation's sampled completions) and ``response_length`` (mean
    completion tokens); TRL logs them at the step that generated (the first of the iteration)."""
    rows: dict[int, dict] = {}
    for h in log_history:
        if "step" in h and h.get("reward") is not None:
            it = (int(h["step"]) - 1) // per_iteration + 1
            rows.setdefault(it, {"iteration": it, "reward_mean": h["reward"],
                                 "response_length": h.get("completions/mean_length")})
    return [rows[k] for k in sorted(rows)]


def spread(xs: list[float]) -> dict[str, float]:
    """n, mean, sample standard deviation (0 for one value), min and max of ``xs``."""
    return {"n": len(xs), "mean": statistics.mean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def t_critical_95(df: float) -> float:
    """Two-sided 5% critical value of Student's t at ``df`` degrees of freedom (the table's value at
    the largest tabulated df <= ``df``, so conservative between entries; 1.96 past 30)."""
    if df > 30:
        return 1.960
    return _T_CRIT_95[max(k for k in _T_CRIT_95 if k <= max(df, 1.0))]


def compare_gains(ours: list[float], trl: list[float]) -> dict[str, Any]:
    """Ours minus TRL on the held-out accuracy gain over seeds: the difference of the means, its
    standard error sqrt(sd_o^2/n_o + sd_t^2/n_t) (Welch), t = difference / SE with the
    Welch-Satterthwaite degrees of freedom, and a verdict at the two-sided 5% level
    (``lower``, ``higher``, ``within the noise``, or ``unknown`` with fewer than 2 seeds in an arm)."""
    o, t = spread(ours), spread(trl)
    diff = o["mean"] - t["mean"]
    out: dict[str, Any] = {"ours": o, "trl": t, "diff": diff, "se": None, "t": None, "df": None, "t_crit": None,
                           "verdict": "unknown"}
    if o["n"] < 2 or t["n"] < 2:
        return out
    a, b = o["sd"] ** 2 / o["n"], t["sd"] ** 2 / t["n"]
    se = math.sqrt(a + b)
    out["se"] = se
    if se == 0:  # no spread in either arm: any difference is beyond it
        out["verdict"] = "lower" if diff < 0 else "higher" if diff > 0 else "within the noise"
        return out
    df = (a + b) ** 2 / ((a * a / (o["n"] - 1)) + (b * b / (t["n"] - 1)))
    crit = t_critical_95(df)
    out.update(t=diff / se, df=df, t_crit=crit,
               verdict="lower" if diff / se < -crit else "higher" if diff / se > crit else "within the noise")
    return out


def _fmt_spread(s: dict) -> str:
    return f"{s['mean']:+.3f} (sd {s['sd']:.3f}, min {s['min']:+.3f}, max {s['max']:+.3f}, {s['n']} seeds)"


def report_section(before: dict, ours: list[dict], trl: list[dict], cfg, out: str) -> list[str]:
    """The markdown lines of the TRL arm: setup, a table per seed, TRL's gain with its spread, and
    the comparison of the mean gains (``compare_gains``)."""
    g = trl[0].get("grpo_config", {})
    version = trl[0].get("trl_version", "?")
    gains_o = [r["after"]["accuracy"] - before["accuracy"] for r in ours]
    gains_t = [r["after"]["accuracy"] - before["accuracy"] for r in trl]
    cmp = compare_gains(gains_o, gains_t)
    rews = [r["after"]["reward_mean"] for r in trl]
    per_step = g.get("per_device_train_batch_size", 0) * g.get("gradient_accumulation_steps", 0)
    n_seq = cfg.data.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    spi = n_seq // max(per_step, 1)
    lines = [
        "## TRL's GRPOTrainer on the same prompts (`--with-trl`)", "",
        (f"TRL {version} `GRPOTrainer`, a fresh process per seed (`benchmarks/learning_trl.py`): {g.get('max_steps')} optimizer "
        f"steps = {cfg.iterations} generations of {cfg.data.prompts_per_iteration} prompts x {g.get('num_generations')} "
        f"completions, the prompts of our iterations 1–{cfg.iterations} in the same order (`shuffle_dataset=False`); "
        f"{g.get('per_device_train_batch_size')} sequences per micro-batch x {g.get('gradient_accumulation_steps')} "
        f"accumulation steps = {per_step} sequences per optimizer step ({spi} per generation), "
        f"`steps_per_generation` {g.get('steps_per_generation')}; temperature {g.get('temperature')}, top_p "
        f"{g.get('top_p')}, max {g.get('max_completion_length')} new tokens; lr {g.get('learning_rate')} constant, AdamW, "
        f"`max_grad_norm` {g.get('max_grad_norm')}; `beta` {g.get('beta')} (no reference model), `epsilon` "
        f"{g.get('epsilon')}, `scale_rewards='{g.get('scale_rewards')}'`, `loss_type='{g.get('loss_type')}'` (the "
        "token-level mean over each optimizer step, our `token-mean`; module docstring); the reward of our "
        "`score_response` with the preset's grader and format bonus; `seed` = the seed. The final model is written "
        "with our checkpoint writer and scored by `flows/eval.py` on the same held-out prompts as ours."), "",
        ("| | held-out accuracy | held-out mean reward | mean response tokens | training reward, iterations 1–3 → last 3 "
        "| seconds (training + evaluation) |"),
        "|---|---|---|---|---|---|",
        (f"| before (untrained) | {before['accuracy']:.3f} ± {before['accuracy_stderr']:.3f} | {before['reward_mean']:.3f} | "
        f"{before['response_length_mean']:.1f} | | |"),
    ]
    for r in trl:
        a, m = r["after"], r["metrics"]
        trend = ""
        if m:
            first, last = (statistics.mean(x["reward_mean"] for x in part) for part in (m[:3], m[-3:]))
            trend = f"{first:.3f} → {last:.3f}"
        lines.append(f"| TRL after, seed {r['seed']} | {a['accuracy']:.3f} ± {a['accuracy_stderr']:.3f} | "
                     f"{a['reward_mean']:.3f} | {a['response_length_mean']:.1f} | {trend} | {r['train_seconds']:.0f} |")
    lines += [
        "",
        (f"**TRL held-out accuracy gain: {cmp['trl']['mean']:+.3f} (mean over {len(trl)} seeds; per seed "
        f"{', '.join(f'{x:+.3f}' for x in gains_t)}; standard deviation over seeds {cmp['trl']['sd']:.3f}; min "
        f"{cmp['trl']['min']:+.3f}, max {cmp['trl']['max']:+.3f}).** Mean held-out reward {before['reward_mean']:.3f} → "
        f"{statistics.mean(rews):.3f} (sd {spread(rews)['sd']:.3f})."), "",
    ]
    head = (f"**Ours vs TRL: held-out accuracy gain {_fmt_spread(cmp['ours'])} against {_fmt_spread(cmp['trl'])}; "
            f"ours minus TRL {cmp['diff']:+.3f}")
    if cmp["se"] is None:
        lines.append(head + ".** Fewer than 2 seeds in an arm: no spread, no verdict.")
    else:
        tail = (f", t = {cmp['t']:+.2f} (Welch, {cmp['df']:.1f} degrees of freedom; two-sided 5% critical value "
                f"{cmp['t_crit']:.2f})" if cmp["t"] is not None else "")
        verdict = {"lower": "ours is lower than TRL beyond the noise",
                   "higher": "ours is higher than TRL beyond the noise",
                   "within the noise": "the difference is within the noise"}[cmp["verdict"]]
        lines.append(head + f" ± {cmp['se']:.3f} (standard error of the difference of the means, "
                     f"sqrt(sd_ours²/n + sd_TRL²/n)){tail}: {verdict}.**")
    lines += [
        "",
        f"What still differs between the two arms: the loss normaliser per optimizer step (ours: the tokens of its "
        f"{per_step} sequences; TRL `dapo`: the tokens of the generation of {n_seq} x {per_step}/{n_seq}, equal in "
        "expectation); the advantage's eps (1e-6 vs 1e-4); the old log-probs (ours: the rollout engine's, recorded "
        "while sampling; TRL: " + ("a forward pass over the generation before its first optimizer step" if spi > 1 else
        "the update's own, detached") + "; the same quantity up to rounding); the samplers and their random streams "
        "(ours: the HF engine's own decode loop; TRL: `model.generate`)" + (f" and the permutation that splits the "
        f"{n_seq} samples into the {spi} optimizer steps" if spi > 1 else "") + "; packed (ours) vs padded (TRL) "
        "micro-batches. TRL's seconds include its process start, model load and save; ours include the stages' "
        "shard and checkpoint I/O.", "",
        (f"Raw results: `{out}/trl-seed-<s>/result.json` (eval numbers, per-iteration training reward, seconds, the "
        f"GRPOConfig) and `trl.json` (TRL's log history); held-out samples: `{out}/trl-seed-<s>/eval/eval`; TRL's "
        f"final models: `{out}/trl-seed-<s>/model`."), "",
    ]
    return lines


def plot_trl(axes, before: dict, trl: list[dict]) -> None:
    """Add TRL to ``learning.plot``'s panels (training reward, response length, held-out
    accuracy): the mean over seeds per iteration, dashed, and the per-seed accuracies after."""
    ax_reward, ax_length, ax_acc = axes
    for ax, key in ((ax_reward, "reward_mean"), (ax_length, "response_length")):
        curves = [[m[key] for m in r["metrics"] if m.get(key) is not None] for r in trl]
        n = min((len(c) for c in curves), default=0)
        if n:
            ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in curves) for i in range(n)], color="tab:red",
                    ls="--", lw=2, label="TRL, mean over seeds")
            ax.legend(fontsize=8)
    accs = [r["after"]["accuracy"] for r in trl]
    ax_acc.scatter([1.08] * len(accs), accs, color="tab:red", marker="x", label="TRL, per seed")
    ax_acc.plot([0, 1.08], [before["accuracy"], statistics.mean(accs)], color="tab:red", ls="--", lw=2, marker="s",
                label="TRL, mean")
    ax_acc.set_ylim(0, max(ax_acc.get_ylim()[1], 1.05 * max(accs)))
    ax_acc.legend(fontsize=8)


# ------------------------------------------------------------------------------------ parent
def run_trl_arm(*, config: str, overrides: list[str], seeds: list[int], out: Path,
                eval_numbers: Callable[[Any], dict]) -> list[dict]:
    """For each seed: the TRL worker in a fresh process, then our held-out evaluation of its model.

    Args:
        config, overrides: the preset and dotted overrides of the benchmark (iterations, eval prompts).
        out: the benchmark's folder; seed ``s`` writes ``{out}/trl-seed-{s}`` and is skipped when
            its ``result.json`` exists (its worker is not rerun when ``trl.json`` and ``model/`` exist).
        eval_numbers: ``learning._eval_numbers`` (EvalResult -> the numbers the report reads).
    Returns:
        One dict per seed: ``seed``, ``metrics`` (per iteration), ``after`` (eval numbers),
        ``train_seconds`` (worker + evaluation, s), ``trl_seconds``, ``eval_seconds``,
        ``trainer_seconds`` (``trainer.train()`` alone), ``trl_version``, ``grpo_config``.
    """
    from flows.eval import evaluate
    from rft_core.config import load_config

    results = []
    for seed in seeds:
        folder = out / f"trl-seed-{seed}"
        done = folder / "result.json"
        if done.exists():
            results.append(json.loads(done.read_text()))
            continue
        folder.mkdir(parents=True, exist_ok=True)
        model_dir, worker_json = folder / "model", folder / "trl.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--config", config, *[a for o in overrides for a in ("--set", o)],
               "--seed", str(seed), "--model-out", str(model_dir), "--result", str(worker_json)]
        if worker_json.exists() and (model_dir / "config.json").exists():  # trained before its evaluation failed
            worker = json.loads(worker_json.read_text())
        else:
            print(f"== TRL seed {seed}: {' '.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=ROOT)
            worker = {**json.loads(worker_json.read_text()), "trl_seconds": time.perf_counter() - t0}
            worker_json.write_text(json.dumps(worker, indent=1))
        trl_seconds = worker.get("trl_seconds", worker["trainer_seconds"])  # absent: the parent stopped right after
        cfg = load_config(config, [*overrides, f"run_root={folder}", f"name=learning-trl-seed{seed}"])
        t1 = time.perf_counter()
        after = eval_numbers(evaluate(cfg, str(model_dir), f"{folder}/eval"))
        eval_seconds = time.perf_counter() - t1
        res = {"seed": seed, "metrics": iteration_metrics(worker["log_history"], worker["steps_per_iteration"]),
               "after": after, "train_seconds": trl_seconds + eval_seconds, "trl_seconds": trl_seconds,
               "eval_seconds": eval_seconds, "trainer_seconds": worker["trainer_seconds"], "model": str(model_dir),
               **{k: worker[k] for k in ("trl_version", "transformers_version", "grpo_config", "torch_threads")}}
        done.write_text(json.dumps(res, indent=1))
        print(f"TRL seed {seed}: held-out accuracy -> {after['accuracy']:.3f}, mean reward {after['reward_mean']:.3f}",
              flush=True)
        results.append(res)
    return results


# ------------------------------------------------------------------------------------ worker
def reward_function(cfg):
    """TRL reward function: our ``score_response`` with ``cfg.reward``'s grader, correct reward
    and format bonus on the completion text (``benchmarks/vs_trl.py`` uses it too)."""
    from rft_core.rewards.math import score_response

    rw, task = cfg.reward, cfg.data.task

    def dataset_reward(prompts, completions, question, label, metadata_json, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score_response(t, source=task, question=q, label=lb, metadata_json=mj, grader=rw.grader,
                               correct_reward=rw.correct_reward, format_reward=rw.format_reward).reward
                for t, q, lb, mj in zip(texts, question, label, metadata_json)]

    return dataset_reward


def dataset_rows(cfg) -> list[dict]:
    """The training prompts of iterations 1..``cfg.iterations`` in our order, as TRL rows: chat
    ``prompt`` (system prompt + question) and the columns the reward reads."""
    from rft_core.data.prompts import iteration_indices, load_task

    d = cfg.data
    ds = load_task(d.task, size=d.size, seed=d.seed, task_config=d.task_config)
    rows = []
    for it in range(1, cfg.iterations + 1):
        for i in iteration_indices(it, per_iteration=d.prompts_per_iteration, size=d.size, seed=d.seed):
            e = ds[i]
            msgs = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else []) + \
                [{"role": "user", "content": str(e["question"])}]
            rows.append({"prompt": msgs, "question": str(e["question"]), "label": str(e["answer"]),
                         "metadata_json": json.dumps(e.get("metadata", {}), default=str, sort_keys=True)})
    return rows


def run_worker(config: str, overrides: list[str], seed: int, model_out: Path, result: Path) -> None:
    """Train TRL's GRPOTrainer on the preset (``grpo_config_kwargs``), save its final model with
    our checkpoint writer to ``model_out`` and write the log history and mapping to ``result``."""
    import resource

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rft_core.config import load_config
    from rft_core.models.loading import (
        load_causal_lm,
        load_tokenizer,
        resolve_model_path,
    )
    from rft_core.training.checkpoint import save_checkpoint

    cfg = load_config(config, overrides)
    bad = unmapped_settings(cfg)
    if bad:
        raise SystemExit("the TRL arm cannot reproduce: " + "; ".join(bad))
    model_dir = resolve_model_path(cfg.policy.path)
    kwargs = grpo_config_kwargs(cfg, seed=seed, output_dir=str(model_out.parent / "trainer"),
                                use_cpu=not torch.cuda.is_available())
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32", trainable=True)  # our loader and attention kernel
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_function(cfg)], args=GRPOConfig(**kwargs),
                          train_dataset=Dataset.from_list(dataset_rows(cfg)), processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    save_checkpoint(trainer.model, load_tokenizer(model_dir), None, model_out)  # as our ppo_update, less the optimizer
    result.write_text(json.dumps({
        "log_history": trainer.state.log_history, "steps_per_iteration": steps_per_iteration(cfg),
        "trainer_seconds": seconds, "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "grpo_config": kwargs}, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description="TRL worker of benchmarks/learning.py --with-trl (one seed)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--model-out", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    import _env  # noqa: F401  (repository on sys.path, offline environment)

    run_worker(args.config, args.overrides, args.seed, Path(args.model_out), Path(args.result))


if __name__ == "__main__":
    main()
