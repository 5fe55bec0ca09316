"""Benchmark: seconds per GRPO step, ours (the Prefect flow) against TRL's GRPOTrainer.

Same model (SmolLM2-135M-Instruct), same prompts in the same order, group size, max new tokens,
sampling temperature, learning rate, batch (one optimizer step per generation of
prompts x group completions, micro-batches of the same size), KL coefficient with a reference
model, AdamW with the same betas / weight decay / clipping, constant learning rate, float32 on
CPU. Each framework runs ``--steps`` steps in its own fresh subprocess, one after the other
(never concurrently); the parent collects their JSON results and writes a section of
docs/benchmarks.md.

Reported per framework: seconds per step (median, min-max), generated tokens per second
(generation wall time only, real tokens up to EOS), peak memory (max RSS of the process), and for
ours the per-stage breakdown: stage compute, model/tokenizer/optimizer loads, shard reads and
writes, checkpoint save + manifest checksums, and Prefect orchestration (iteration wall time
minus the critical path of the stage tasks).

Distance to the physical limit (issue 19): the parent measures this machine's sustained float32
GEMM rate (``gemm_rate.py``, ~10 s, in a fresh process) before and after the variants; every
worker records, per step, each sample's real prompt and response token counts (ours: the rollout
shard's ``prompt_token_ids`` / ``response_token_ids``; TRL: the prompts' attention mask and the
completions up to EOS at ``generate``) and the passes the step ran (generation, reference and
actor log-prob passes, update epochs), plus the model's shape. The report turns them into FLOPs
per step (``flops.py``), the achieved GFLOP/s and its fraction of the GEMM rate.

Variants of ours: ``ours`` = the preset as is (``logprobs.recompute_old_logprobs: auto`` skips the
actor log-prob pass when the update is on-policy: the rollout's log-probs are the old ones, the
work TRL's GRPOTrainer does with ``num_iterations=1``); ``ours-recompute`` =
``logprobs.recompute_old_logprobs=true``, the actor pass forced (as verl and OpenRLHF do). TRL
variants: ``trl`` (no checkpoints, the default run). With ``--only``: ``ours-sync-optimizer``
(``checkpoint.async_optimizer=false``: the AdamW state written inside the update, an A/B of the
background write) and ``trl-save-every-step`` (TRL saving a full checkpoint after every step, the
resumability our flow has by construction).

    .venv/bin/pip install -c constraints-cpu.txt -e '.[bench]'          # TRL, benchmark-only
    .venv/bin/python benchmarks/vs_trl.py --steps 5                     # the default three, ~20 min quiet
    .venv/bin/python benchmarks/vs_trl.py --steps 2 --label "shared CPU pilot" --gemm-seconds 0
    .venv/bin/python benchmarks/vs_trl.py --only ours --only ours-sync-optimizer --only trl-save-every-step
"""
from __future__ import annotations

import argparse
import contextvars
import functools
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from _env import ROOT  # noqa: E402  (repository on sys.path, offline environment)
from flops import ModelDims
from learning_trl import dataset_rows, reward_function
from vs_trl_report import BACKGROUND_KIND, TRL_VARIANTS, report, with_findings, write_section  # noqa: E402

VARIANTS = {"ours": [],  # the preset as is: recompute_old_logprobs auto skips the actor pass when on-policy
            "ours-recompute": ["logprobs.recompute_old_logprobs=true"],  # the actor (old log-prob) pass forced
            "trl": [],
            # ours writing the AdamW state inside the update instead of in the background (an A/B of
            # checkpoint.async_optimizer; --only ours-sync-optimizer)
            "ours-sync-optimizer": ["checkpoint.async_optimizer=false"],
            # TRL saving a full checkpoint (weights, optimizer, scheduler, RNG) after every step, the resumability our
            # flow has by construction (--only trl-save-every-step)
            "trl-save-every-step": []}
DEFAULT_VARIANTS = ("ours", "ours-recompute", "trl")


def _peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _gemm_rate(seconds: float) -> dict | None:
    """This machine's sustained float32 GEMM rate (``gemm_rate.py``'s JSON: GFLOP/s), measured in
    a fresh process with torch's default threads, as the workers run; None when ``seconds`` <= 0."""
    if seconds <= 0:
        return None
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gemm_rate.py"), "--seconds", str(seconds)]
    try:
        out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
        gemm = json.loads(out.strip().splitlines()[-1])
    except (subprocess.CalledProcessError, ValueError, IndexError) as exc:  # the variants' results still count
        print(f"== GEMM rate: not measured ({exc})", flush=True)
        return None
    print(f"== GEMM rate: {gemm['gflops_median']:.1f} GFLOP/s (median), {gemm['gflops_best']:.1f} (best)", flush=True)
    return gemm


# --------------------------------------------------------------------------------------- ours
_STAGE = contextvars.ContextVar("stage", default="flow")


class _Recorder:
    """Wall seconds of instrumented calls, keyed by (iteration, stage, kind); thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.iteration = 0
        self.seconds: dict[tuple[int, str, str], float] = defaultdict(float)

    def wrap(self, kind: str, fn, stage: str | None = None):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            token = _STAGE.set(stage) if stage else None
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.seconds[(self.iteration, _STAGE.get(), kind)] += dt
                if token is not None:
                    _STAGE.reset(token)
        return timed


def _instrument(rec: _Recorder) -> None:
    """Time the stage tasks' bodies and, inside them, loads, shard I/O and checkpoint writes."""
    import importlib

    import tasks.stages as ts
    from rft_core.stages import common

    for name in ("prompts", "rollout", "rewards", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update"):
        task = getattr(ts, name)
        task.fn = rec.wrap("task", task.fn, stage=name)
    kinds = {"read_shard": "shard_read", "write_shard": "shard_write", "load_causal_lm": "model_load",
             "load_trainable_policy": "model_load", "load_tokenizer": "tokenizer_load",
             "load_optimizer_state": "optimizer_load"}
    # the stage programs, plus where the shared pieces they call live (commits write shards
    # through rft_core.stages.common, strategies load the optimizer state)
    for mod_name in ("stages.prompts", "stages.rollout", "stages.rewards", "stages.logprobs", "stages.advantages",
                     "stages.update", "stages.common", "training.strategy"):
        mod = importlib.import_module(f"rft_core.{mod_name}")
        for fn_name, kind in kinds.items():
            if fn_name == "load_causal_lm" and mod_name == "stages.update":
                continue  # inside load_trainable_policy, counted there
            if hasattr(mod, fn_name):
                setattr(mod, fn_name, rec.wrap(kind, getattr(mod, fn_name)))
    common.save_checkpoint = rec.wrap("checkpoint_save", common.save_checkpoint)
    common.write_parts = rec.wrap("shard_write", common.write_parts)
    common.commit_files = rec.wrap("checkpoint_commit", common.commit_files)  # the checksum of every checkpoint file
    # the AdamW state (checkpoint.async_optimizer): the writer thread's seconds, off the critical path, and the
    # seconds a ppo_update waited for the previous iteration's write (on it)
    from rft_core.stages import optimizer_state as opt_state

    real_write = opt_state._write

    def timed_write(update, *a, **kw):
        t0 = time.perf_counter()
        try:
            return real_write(update, *a, **kw)
        finally:
            it = int(re.search(r"iter=(\d+)", update.uri).group(1))
            background = threading.current_thread().name.startswith("rft-optimizer-state")
            with rec.lock:  # checkpoint.async_optimizer=false: written inside the ppo_update task
                rec.seconds[(it, "ppo_update", BACKGROUND_KIND if background else "optimizer_save")] += time.perf_counter() - t0

    opt_state._write = timed_write
    opt_state.wait_for_optimizer_writes = rec.wrap("optimizer_wait", opt_state.wait_for_optimizer_writes)


def run_ours(args, overrides: list[str]) -> dict:
    """``args.steps`` iterations of the train flow, instrumented; returns per-step numbers."""
    from rft_core.config import load_config
    from rft_core.models.loading import ensure_default_model

    ensure_default_model()
    run_root = tempfile.mkdtemp(prefix="rft-vs-trl-", dir=args.tmp)
    cfg = load_config(args.config, [*overrides, f"iterations={args.steps}", f"run_root={run_root}"])
    rec = _Recorder()
    _instrument(rec)
    import flows.train as train_mod
    from schemas import read_manifest, stage_uri

    real_iteration = train_mod.rl_iteration
    step_wall: list[float] = []

    def timed_iteration(*a, **kw):
        rec.iteration = len(step_wall) + 1
        t0 = time.perf_counter()
        out = real_iteration(*a, **kw)
        step_wall.append(time.perf_counter() - t0)
        return out

    train_mod.rl_iteration = timed_iteration
    t0 = time.perf_counter()
    result = train_mod.train(cfg)
    total = time.perf_counter() - t0
    steps = []
    for i, m in enumerate(result.metrics, start=1):
        stages = {}
        for stage in ("prompts", "rollout", "rewards", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update"):
            if (i, stage, "task") not in rec.seconds:
                continue
            compute = read_manifest(stage_uri(cfg.run_root, i, stage))[0].summary.get("seconds", 0.0)
            kinds = {k: v for (it, st, k), v in rec.seconds.items() if it == i and st == stage}
            if stage == "prompts":  # the prompts stage's timer also covers its tokenizer load
                compute -= kinds.get("tokenizer_load", 0.0)
            stages[stage] = {"task": kinds.pop("task"), "compute": compute, **kinds}
        roll = read_manifest(stage_uri(cfg.run_root, i, "rollout"))[0].summary
        conc = [stages[s]["task"] for s in ("rewards", "actor_logprobs", "ref_logprobs") if s in stages]
        critical = sum(stages[s]["task"] for s in ("prompts", "rollout", "advantages", "ppo_update")) + max(conc, default=0.0)
        steps.append({"seconds": step_wall[i - 1], "critical_path": critical, "stages": stages,
                      "generated_tokens": roll["generated_tokens"], "generate_seconds": roll["seconds"],
                      "reward_mean": m.get("reward_mean"), "response_length": m.get("response_length")})
    _record_tokens(cfg, steps)
    from transformers import AutoConfig

    from rft_core.models.loading import resolve_model_path

    model = ModelDims.from_config(AutoConfig.from_pretrained(resolve_model_path(cfg.policy.path))).to_dict()
    if not args.keep:
        shutil.rmtree(run_root, ignore_errors=True)
    return {"framework": "ours", "steps": steps, "total_seconds": total, "peak_rss_gib": _peak_rss_gib(),
            "variant_overrides": VARIANTS[args.worker], "model": model,
            "config": cfg.model_dump(mode="json", include={"data", "rollout", "kl", "update", "logprobs"})}


def _record_tokens(cfg, steps: list[dict]) -> None:
    """Add to each step of ours (in place) ``samples``, [prompt tokens, response tokens] per
    sample (real tokens, from the rollout shard), and ``passes``, the passes it ran over them
    (generation; the reference and actor log-prob passes whose stages ran; update epochs)."""
    import pyarrow.compute as pc

    # the uninstrumented reader: its seconds land in no stage
    from schemas import read_shard, stage_uri

    for i, step in enumerate(steps, start=1):
        roll = read_shard(stage_uri(cfg.run_root, i, "rollout"), stage="rollout", verify=False)
        prompt = pc.list_value_length(roll.column("prompt_token_ids")).to_pylist()
        response = pc.list_value_length(roll.column("response_token_ids")).to_pylist()
        step["samples"] = [[int(p), int(r)] for p, r in zip(prompt, response)]
        step["passes"] = {"generation": 1, "actor_logprobs": int("actor_logprobs" in step["stages"]),
                          "ref_logprobs": int("ref_logprobs" in step["stages"]), "update": cfg.update.epochs}


# ---------------------------------------------------------------------------------------- TRL
def run_trl(args, overrides: list[str]) -> dict:
    """``args.steps`` optimizer steps of TRL's GRPOTrainer with the preset's settings and prompts."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rft_core.config import load_config
    from rft_core.models.loading import ensure_default_model, load_causal_lm, load_tokenizer

    model_dir = str(ensure_default_model())
    cfg = load_config(args.config, overrides)
    d, r, u = cfg.data, cfg.rollout, cfg.update
    if cfg.advantage.estimator != "grpo" or r.first_token_temperature is not None:
        raise SystemExit("vs_trl compares plain GRPO: advantage.estimator=grpo, no first_token_temperature")
    # the prompts our flow uses, in the same order, and our reward on the completion text
    rows = dataset_rows(cfg.model_copy(update={"iterations": args.steps}))
    reward = reward_function(cfg)

    n_seq = d.prompts_per_iteration * r.n_samples_per_prompt
    if n_seq % u.micro_batch_size:
        raise SystemExit(f"prompts x group ({n_seq}) must be a multiple of update.micro_batch_size ({u.micro_batch_size})")
    out_dir = tempfile.mkdtemp(prefix="trl-vs-", dir=args.tmp)
    gcfg = GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=u.micro_batch_size,
        gradient_accumulation_steps=n_seq // u.micro_batch_size, num_generations=r.n_samples_per_prompt,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=0,
        learning_rate=u.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=u.weight_decay,
        adam_beta1=u.betas[0], adam_beta2=u.betas[1], max_grad_norm=u.max_grad_norm, beta=cfg.kl.kl_coef,
        epsilon=u.policy_loss.clip_low if hasattr(u.policy_loss, "clip_low") else 0.2, num_iterations=u.epochs,
        loss_type="dapo",  # token-level mean over the batch = our token-mean
        scale_rewards="group", shuffle_dataset=False, activation_checkpointing=u.gradient_checkpointing,
        use_cpu=True, bf16=False, fp16=False, logging_steps=1, report_to="none",
        **({"save_strategy": "steps", "save_steps": 1, "save_only_model": False} if args.worker == "trl-save-every-step"
           else {"save_strategy": "no"}),
        dataloader_num_workers=0, seed=r.seed, disable_tqdm=True)
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32", trainable=True)  # same loader (and attention kernel) as ours
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=gcfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)

    gen: dict[str, list] = {"seconds": [], "tokens": []}
    gen_eos = model.generation_config.eos_token_id
    eos = {tok.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    real_generate = model.generate
    marks: list[float] = []
    samples: dict[int, list[list[int]]] = defaultdict(list)  # step index -> [prompt tokens, response tokens] per sample

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        outp = real_generate(*a, **kw)
        gen["seconds"].append(time.perf_counter() - t0)
        seqs = outp.sequences if hasattr(outp, "sequences") else outp
        new = seqs[:, kw["input_ids"].shape[1]:] if "input_ids" in kw else seqs
        mask = kw.get("attention_mask")  # left-padded prompts: their real tokens
        prompt = mask.sum(dim=1).tolist() if mask is not None else [seqs.shape[1] - new.shape[1]] * seqs.shape[0]
        n = 0
        for p, row in zip(prompt, new.tolist()):
            r = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            samples[len(marks) - 1].append([int(p), r])
            n += r
        gen["tokens"].append(n)
        return outp

    model.generate = timed_generate
    phase: dict[tuple[int, str], float] = defaultdict(float)  # (step index, kind) -> seconds

    def timed_method(kind, fn):
        @functools.wraps(fn)
        def w(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phase[(len(marks) - 1, kind)] += time.perf_counter() - t0
        return w

    # generation + rewards + reference log-probs of a generation batch; the policy forward of a micro-batch
    trainer._generate_and_score_completions = timed_method("generate_and_score", trainer._generate_and_score_completions)
    trainer.compute_loss = timed_method("loss_forward", trainer.compute_loss)
    trainer._save_checkpoint = timed_method("checkpoint", trainer._save_checkpoint)  # lands in the next step's interval
    lp_rows = _count_logprob_passes(trainer, marks)

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer.add_callback(StepTimes())
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h or "reward" in h]
    steps = []
    batch: list[list[int]] = []  # the samples the step trains on: its own generation, else the last one
    for i in range(len(marks) - 1):
        lg = logs[i] if i < len(logs) else {}
        batch = samples.get(i) or batch
        steps.append({"seconds": marks[i + 1] - marks[i], "generated_tokens": gen["tokens"][i] if i < len(gen["tokens"]) else None,
                      "generate_seconds": gen["seconds"][i] if i < len(gen["seconds"]) else None,
                      "reward_mean": lg.get("reward"), "response_length": lg.get("completions/mean_length"),
                      "generate_and_score": phase.get((i, "generate_and_score"), 0.0),
                      "loss_forward": phase.get((i, "loss_forward"), 0.0), "checkpoint": phase.get((i, "checkpoint"), 0.0),
                      "samples": batch, "passes": _trl_passes(gcfg, i, bool(samples.get(i)), len(batch), lp_rows)})
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"framework": args.worker, "trl_version": __import__("trl").__version__, "steps": steps, "total_seconds": total,
            "peak_rss_gib": _peak_rss_gib(), "generate_calls": len(gen["seconds"]), "torch_threads": torch.get_num_threads(),
            "variant_overrides": VARIANTS[args.worker], "model": ModelDims.from_config(model.config).to_dict()}


def _count_logprob_passes(trainer, marks: list[float]) -> dict[tuple[int, str], int] | None:
    """Count the sequences TRL's no-grad log-prob passes process per step: (step index,
    ``ref_logprobs`` or ``actor_logprobs``) -> sequences, by wrapping
    ``_get_per_token_logps_and_entropies`` (None when this TRL has no such method). The update's
    forward runs with gradients and is not counted here."""
    import torch

    real = getattr(trainer, "_get_per_token_logps_and_entropies", None)
    if real is None:
        return None
    rows: dict[tuple[int, str], int] = defaultdict(int)

    @functools.wraps(real)
    def counted(*a, **kw):
        model = a[0] if a else kw.get("model")
        ids = a[1] if len(a) > 1 else kw.get("input_ids")
        if ids is not None and not torch.is_grad_enabled():
            part = "ref_logprobs" if model is not None and model is trainer.ref_model else "actor_logprobs"
            rows[(len(marks) - 1, part)] += int(ids.shape[0])
        return real(*a, **kw)

    trainer._get_per_token_logps_and_entropies = counted
    return rows


def _trl_passes(gcfg, step: int, generated: bool, n_samples: int, lp_rows: dict | None) -> dict[str, float]:
    """The passes TRL's step ``step`` ran over its ``n_samples`` samples: generation (1 when it
    generated), the reference and old-log-prob passes (counted sequences / samples; without a
    count, from TRL's rules: a reference pass when beta != 0, an old-log-prob pass only when
    gradient_accumulation_steps is not a multiple of steps_per_generation x num_iterations) and
    one update (forward + backward of every sample)."""
    if lp_rows is not None and n_samples:
        ref, actor = (lp_rows.get((step, k), 0) / n_samples for k in ("ref_logprobs", "actor_logprobs"))
    else:
        ref = float(gcfg.beta != 0.0) if generated else 0.0
        aligned = gcfg.gradient_accumulation_steps % (gcfg.steps_per_generation * gcfg.num_iterations) == 0
        actor = float(not aligned) if generated else 0.0
    return {"generation": int(generated), "actor_logprobs": actor, "ref_logprobs": ref, "update": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo_demo.yaml", help="preset shared by both frameworks")
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="dotted override, repeatable")
    ap.add_argument("--steps", type=int, default=5, help="steps (optimizer steps = iterations) per framework")
    ap.add_argument("--only", action="append", choices=sorted(VARIANTS), help="run only these (repeatable)")
    ap.add_argument("--skip-first", action="store_true", help="leave the first (warm-up) step out of the medians")
    ap.add_argument("--label", default="", help="a note printed above the table, e.g. 'shared CPU pilot'")
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks.md"), help="markdown file whose section is replaced")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--tmp", default=None, help="folder for run roots and TRL output (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep our run folder (checkpoints: ~1.6 GB per step)")
    ap.add_argument("--from-json", default=None, help="rewrite the section from a --json file of an earlier run; runs nothing")
    ap.add_argument("--findings", default=None, help="markdown file appended to the section (what was found and fixed)")
    ap.add_argument("--gemm-seconds", type=float, default=8.0,
                    help="seconds of the GEMM-rate measurement before and after the variants (0: skip it)")
    ap.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg_path = Path(args.config)
    args.config = str(cfg_path if cfg_path.is_absolute() else ROOT / cfg_path)
    args.config_rel = str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT) else args.config

    if args.worker:
        overrides = [*args.overrides, *VARIANTS[args.worker]]
        res = run_trl(args, overrides) if args.worker in TRL_VARIANTS else run_ours(args, overrides)
        Path(args.result).write_text(json.dumps(res, indent=1))
        return

    args.load_before = os.getloadavg()[0]
    if args.from_json:
        raw = json.loads(Path(args.from_json).read_text())
        args.load_before = raw.get("_load_before", float("nan"))
        args.load_after = raw.get("_load_after")
        args.gemm_before, args.gemm_after = raw.get("_gemm_before"), raw.get("_gemm_after")
        args.measured = raw.get("_measured")  # the date of the run (older JSON: none, today is printed)
        results = {k: v for k, v in raw.items() if not k.startswith("_")}
        section = with_findings(report(results, args, args.overrides), args.findings)
        write_section(Path(args.out), section)
        print(section)
        return
    args.gemm_before = _gemm_rate(args.gemm_seconds)  # on the quiet machine, before any variant
    results = {}
    for name in args.only or list(DEFAULT_VARIANTS):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result_path = f.name
        cmd = [sys.executable, __file__, "--worker", name, "--result", result_path, "--config", args.config,
               "--steps", str(args.steps), *sum((["--set", o] for o in args.overrides), [])]
        cmd += ["--tmp", args.tmp] if args.tmp else []
        cmd += ["--keep"] if args.keep else []
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        results[name] = json.loads(Path(result_path).read_text())
        os.unlink(result_path)
        brief = {k: v for k, v in results[name].items() if k != "config"}
        brief["steps"] = [{k: v for k, v in st.items() if k != "samples"} for st in brief["steps"]]
        print(json.dumps(brief, indent=1)[:3000], flush=True)
    args.load_after = os.getloadavg()[0]
    args.gemm_after = _gemm_rate(args.gemm_seconds)
    args.measured = time.strftime("%Y-%m-%d")
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "_load_before": args.load_before, "_load_after": args.load_after,
                                               "_gemm_before": args.gemm_before, "_gemm_after": args.gemm_after,
                                               "_measured": args.measured}, indent=1))
    section = with_findings(report(results, args, args.overrides), args.findings)
    write_section(Path(args.out), section)
    print(section)


if __name__ == "__main__":
    main()
