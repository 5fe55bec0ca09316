"""``make bench-gpu`` (issue 44): seconds per GRPO step, ours (resident workers and stage mode)
against TRL's ``GRPOTrainer``, the same work per step, on a machine with no network and no model
hub; on a GPU at the Qwen2.5-0.5B shape, on the CPU with a small model (the same script, so the
time outside the stage programs can be measured without a GPU).

Self-contained: the policy is a random-initialised Qwen2 built from a config and a seed
(``SHAPES``; ``qwen0.5b`` is Qwen2.5-0.5B's shape with the default model's tokenizer, 402M
parameters) with the default model's (SmolLM2's) tokenizer; the prompts are written by the
script; the reward is ``benchmarks/bench_reward.py``'s CRC of the completion's text, which gives
every group mixed rewards, so both frameworks train on non-zero advantages and, from the second
step on, on a non-zero KL term. The settings are ``configs/bench_gpu.yaml``'s (16 prompts x 8
samples, 128 new tokens, temperature 1, KL 0.04 as a k3 loss term with a reference pass, lr
1e-6, micro-batch 16, one optimizer step per generation, no old-log-prob pass); TRL gets the same
(``trl_config``): ``per_device_train_batch_size`` 16, ``gradient_accumulation_steps`` 8,
``num_generations`` 8, ``beta`` 0.04, ``loss_type='dapo'`` (= our token-mean), ``epsilon`` 0.2,
``scale_rewards='group'``, constant lr without warmup, AdamW (0.9, 0.999), no weight decay,
gradient clipping at 1, ``gradient_checkpointing`` as ours (off; TRL's own default is on).

Each arm runs in a fresh subprocess, one after the other:

- ``trl``: ``GRPOTrainer`` (HF ``generate``, no vLLM), bf16 mixed precision on a GPU;
- ``resident``: our stage programs with the resident workers as objects in one process
  (``tests.drive`` + ``benchmarks/resident.py``'s in-process pool: no Prefect, no Ray, which the
  GPU machines lack), ``checkpoint.every`` = the number of steps;
- ``stage``: the stage programs through ``run_stage`` with the config's runners (the stage
  mode: every stage commits its shards and every update its checkpoint; with
  ``orchestration.keep_models``, auto = on with the HF engine, the models this process read or
  trained are taken from memory by the next stage, ``rft_core.stages.memo``; ``--set
  orchestration.keep_models=false``: each stage reads its model from storage).

Per step it records seconds, generated tokens (and per second of generation), the reward, the
gradient norm, and for ours each stage program's own seconds (its manifest's ``seconds``) and the
time outside them broken down by ``Breakdown``: shard writes and manifests, shard reads, file
checksums, weight digests, config hashing, stage-input validation, weight sync, checkpoint
writes, model and tokenizer loads, device-memory release, and the rest (Python bookkeeping).
It asserts that both sides did the same work: the same number of completions per step, every
step's generated tokens within 5% of TRL's, non-zero gradient norms from step 2 on (the KL term
moves the weights); otherwise it exits 1 after writing its report (``--allow-other-work``: 0).

    .venv/bin/python benchmarks/gpu_bench.py                    # CPU: small shape, float32
    python3 benchmarks/gpu_bench.py --tokenizer .carry/tok      # GPU: qwen0.5b shape, bfloat16
    ... [--arms trl,resident,stage] [--steps 4] [--json out.json] [--doc docs/benchmarks.md] [--profile DIR]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

PRESET = ROOT / "configs" / "bench_gpu.yaml"
# Qwen2 shapes (transformers' Qwen2Config keywords); vocab_size is the tokenizer's
SHAPES = {
    # Qwen2.5-0.5B's layers (its config.json on the hub), tied embeddings
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
ARMS = ("trl", "resident", "stage")
# the small shape's (CPU) work per step: 8 prompts x 8 samples x 64 new tokens (the GPU shape: the preset's 16 x 8 x 128)
CPU_SIZES = ["data.prompts_per_iteration=8", "rollout.max_new_tokens=64"]


# ------------------------------------------------------------------------------------ the inputs
def build_model(shape: str, seed: int, tokenizer_dir: str, out: Path) -> Path:
    """A random-initialised Qwen2 causal LM of ``SHAPES[shape]`` (``torch.manual_seed(seed)``,
    float32) with the tokenizer of ``tokenizer_dir``, saved as an HF folder ``out``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SHAPES[shape])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_prompts(path: Path, n: int) -> Path:
    """``n`` JSON Lines rows ``{"prompt", "answer"}`` (the answer is unused: the reward reads only
    the completion)."""
    topics = ["the sea", "a city at night", "prime numbers", "a long journey", "an old clock", "the first snow",
              "a library", "a mountain pass"]
    rows = [{"prompt": f"Write a few sentences about {topics[i % len(topics)]} (prompt {i}).", "answer": "0"}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def our_config(args, model_dir: Path, prompts: Path, run_root: str, arm: str):
    """Our ``TrainConfig``: ``configs/bench_gpu.yaml`` with the model, the prompts, the run root
    and, for ``resident``, resident workers with one checkpoint at the last step."""
    from rft_core.config import load_config

    sets = [f"policy.path={model_dir}", f"data.path={prompts}", f"run_root={run_root}", f"iterations={args.steps}",
            f"policy.dtype={args.dtype}", f"reward.sources.crc.function={ROOT / 'benchmarks/bench_reward.py'}:sample_reward"]
    if arm == "resident":
        sets += ["orchestration.workers=resident", f"checkpoint.every={args.steps}"]
    else:
        sets += ["orchestration.workers=stage"]
    return load_config(str(PRESET), [*sets, *(CPU_SIZES if args.shape == "small" else []), *args.overrides])


def trl_config(cfg, out_dir: str, steps: int, cuda: bool) -> dict:
    """``GRPOConfig`` keywords doing our ``cfg``'s work per step (the module docstring)."""
    r, u = cfg.rollout, cfg.update
    n_seq = cfg.data.prompts_per_iteration * r.n_samples_per_prompt
    return dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=u.micro_batch_size,
                gradient_accumulation_steps=n_seq // u.micro_batch_size, num_generations=r.n_samples_per_prompt,
                max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=1.0, top_k=0,
                learning_rate=u.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=u.weight_decay,
                adam_beta1=u.betas[0], adam_beta2=u.betas[1], max_grad_norm=u.max_grad_norm, beta=cfg.kl.kl_coef,
                epsilon=u.policy_loss.clip_low, num_iterations=u.epochs, loss_type="dapo", scale_rewards="group",
                gradient_checkpointing=u.gradient_checkpointing,  # TRL's default is on; ours off: the same here
                shuffle_dataset=False, use_cpu=not cuda, bf16=cuda and cfg.policy.dtype == "bfloat16", fp16=False,
                logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, seed=r.seed,
                disable_tqdm=True)


# ------------------------------------------------------------------------- where our time goes
class Breakdown:
    """Seconds of instrumented calls outside the stage programs' own timers, per iteration and
    category, exclusive (a call's seconds less those of the instrumented calls inside it), in the
    driver's thread; calls in other threads (the background checkpoint writes) are counted
    under ``background``, and by category in ``background_of`` (the writer's saves under
    ``checkpoint``, its manifests' file checksums under ``file_checksums``). A stage program's
    timed block is ``rft_core.stages.common.Timer``: the seconds its manifest records; calls
    inside it are part of the stage's own seconds."""

    def __init__(self) -> None:
        self.iteration = 1
        self.seconds: dict[tuple[int, str], float] = defaultdict(float)
        self.calls: dict[tuple[int, str], int] = defaultdict(int)
        self.background: dict[tuple[int, str], float] = defaultdict(float)
        self._local = threading.local()
        self._main = threading.get_ident()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack, self._local.timers = [], 0
        return self._local.stack

    def wrap(self, fn, category: str):
        """``fn`` timed under ``category``."""
        import functools

        @functools.wraps(fn)
        def timed(*a, **kw):
            stack = self._stack()
            if self._local.timers:  # inside a stage program's timer: the stage's own seconds
                return fn(*a, **kw)
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                inner = stack.pop()
                if stack:
                    stack[-1] += dt
                cat = category if threading.get_ident() == self._main else "background"
                self.seconds[(self.iteration, cat)] += dt - inner
                if cat == "background":
                    self.background[(self.iteration, category)] += dt - inner
                self.calls[(self.iteration, cat)] += 1
        timed.__wrapped_by_breakdown__ = True
        return timed

    def install(self) -> None:
        """Wrap the functions of ``TARGETS`` wherever this process's modules refer to them, and
        ``Timer`` (a stage's timed block)."""
        import importlib

        from rft_core.stages import common

        for category, names in TARGETS.items():
            for name in names:
                mod_name, _, attr = name.partition(":")
                owner_name, _, method = attr.partition(".")
                owner = getattr(importlib.import_module(mod_name), owner_name)
                if method:  # a method: patched on its class
                    setattr(owner, method, self.wrap(getattr(owner, method), category))
                    continue
                wrapped = self.wrap(owner, category)
                for mod in list(sys.modules.values()):
                    if getattr(mod, "__name__", "").split(".")[0] in ("rft_core", "schemas", "tests"):
                        for k, v in list(vars(mod).items()):
                            if v is owner:
                                setattr(mod, k, wrapped)
        enter, leave = common.Timer.__enter__, common.Timer.__exit__

        def timer_enter(timer):
            self._stack()
            self._local.timers += 1
            return enter(timer)

        def timer_exit(timer, *exc):
            self._local.timers -= 1
            return leave(timer, *exc)

        common.Timer.__enter__, common.Timer.__exit__ = timer_enter, timer_exit

    def of(self, iteration: int) -> dict[str, float]:
        """``{category: seconds}`` of ``iteration``."""
        return {c: round(s, 4) for (i, c), s in sorted(self.seconds.items()) if i == iteration}

    def background_of(self, iteration: int) -> dict[str, float]:
        """``{category: seconds}`` of the calls in other threads during ``iteration`` (their sum is
        ``of(iteration)["background"]``)."""
        return {c: round(s, 4) for (i, c), s in sorted(self.background.items()) if i == iteration}


# category -> "module:function" or "module:Class.method" (the first module that defines it)
TARGETS = {
    "shard_write": ["schemas.shards:commit_files", "schemas.shards:prepare_stage_dir", "schemas:write_parts",
                    "schemas:write_shard"],
    "shard_read": ["schemas:read_shard", "schemas.shards:read_manifest", "schemas.shards:committed_ref"],
    "file_checksums": ["schemas.shards:_file_entries"],
    "weight_digest": ["rft_core.weightsync.digest:weights_digest", "rft_core.stages.lineage:trained_digest"],
    "config_hash": ["rft_core.stages.contracts:StageInput.config_hash"],
    "input_validation": ["rft_core.stages.contracts:StageInput.__init__"],
    "weight_sync": ["rft_core.weightsync.session:pull"],
    "checkpoint": ["rft_core.training.checkpoint:save_checkpoint", "rft_core.stages.optimizer_state:_write",
                   "rft_core.stages.writer:wait_for_optimizer_writes"],
    "model_load": ["rft_core.models.loading:load_causal_lm", "rft_core.models.pretrained:load_tokenizer",
                   "rft_core.stages.sources:load_from_storage", "rft_core.stages.update:build_trainer"],
    "device_release": ["rft_core.models.logprobs:release_device_memory"],
}


def run_ours(args, arm: str, model_dir: Path, prompts: Path) -> dict:
    """``args.steps`` iterations of ours (``arm``: resident or stage) in this process."""
    import cProfile

    from resident import committed_before, inprocess_runner
    from tests.drive import drive

    run_root = scratch_dir(f"rft-bench-{arm}-", dir=args.tmp)
    cfg = our_config(args, model_dir, prompts, run_root, arm)
    bd = Breakdown()
    run = inprocess_runner(cfg)  # stage: run_stage with the config's runners (orchestration.keep_models)
    bd.install()
    rows: list[dict] = []
    prof = cProfile.Profile() if args.profile else None

    def record(m: dict) -> None:
        if prof is not None:
            prof.disable()
        stages = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("seconds/") and k != "seconds/iteration"}
        # the prompts, run beside the previous update (tests/drive.py), are not this step's
        ahead = committed_before(cfg.run_root, m["iteration"], stages, time.time() - m["seconds/iteration"])
        outside = m["seconds/iteration"] - sum(v for s, v in stages.items() if s not in ahead)
        parts = bd.of(m["iteration"])
        known = sum(v for k, v in parts.items() if k != "background")
        rows.append({"step": m["iteration"], "seconds": m["seconds/iteration"], "stage_seconds": stages,
                     "ahead_seconds": ahead, "outside_seconds": round(outside, 4),
                     "outside": {**parts, "other_python": round(outside - known, 4)},
                     "background": bd.background_of(m["iteration"]),
                     "reward_mean": m.get("reward_mean"), "grad_norm": m.get("grad_norm"), "kl": m.get("kl")})
        print(json.dumps(rows[-1]), flush=True)
        bd.iteration = m["iteration"] + 1
        if prof is not None and bd.iteration >= 2:
            prof.enable()  # steady iterations only

    t0 = time.perf_counter()
    drive(cfg, run, on_iteration=record, freeze_heap=True)  # as rft train (rft_core/heap.py)
    if prof is not None:
        prof.disable()
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(args.profile) / f"{arm}.prof"))
    _add_rollout_tokens(run_root, rows)
    from rft_core.stages.memo import hits

    out = {"arm": arm, "steps": rows, "total_seconds": round(time.perf_counter() - t0, 2), "run_root": run_root,
           "keep_models": cfg.keeps_models and arm == "stage", "memo_hits": hits()}
    if args.rebuild_probe:
        out["rebuild"] = rebuild_probe(cfg)
    return out


def rebuild_probe(cfg) -> dict:
    """What a resume after a crash before the last step would do (``--rebuild-probe``): the policy
    of step N-1, kept in memory only (``checkpoint.every`` > N-1), rebuilt in this process with
    nothing kept: the base checkpoint loaded, the committed updates re-applied, each checked against
    its recorded digest (``rft_core.stages.recovery.rebuild_trainer``). Its report: updates
    replayed, how many differed from their digest (``inexact``: GPU kernels that are not bitwise
    deterministic) and seconds."""
    from rft_core.stages import memo
    from rft_core.stages.lineage import kept_in_memory
    from rft_core.stages.recovery import rebuild_trainer
    from schemas import ShardRef, stage_uri

    ref = ShardRef.from_manifest(stage_uri(cfg.run_root, cfg.iterations - 1, "ppo_update"))
    if not kept_in_memory(ref):
        return {"skipped": f"step {cfg.iterations - 1} wrote its checkpoint (checkpoint.every={cfg.checkpoint.every})"}
    memo.clear()
    _, report = rebuild_trainer(ref, None)
    return {k: report[k] for k in ("replayed", "inexact", "seconds")}


def _add_rollout_tokens(run_root: str, rows: list[dict]) -> None:
    """Each step's completions, generated tokens and generation seconds from its rollout shard."""
    import pyarrow.compute as pc

    from schemas import read_manifest, read_shard, stage_uri

    for row in rows:
        uri = stage_uri(run_root, row["step"], "rollout")
        table = read_shard(uri, stage="rollout", verify=False)
        row["completions"] = table.num_rows
        row["generated_tokens"] = int(pc.sum(pc.list_value_length(table.column("response_token_ids"))).as_py())
        row["generate_seconds"] = read_manifest(uri)[0].summary.get("seconds")


# ------------------------------------------------------------------------------------------ TRL
def run_trl(args, model_dir: Path, prompts: Path) -> dict:
    """``args.steps`` optimizer steps of TRL's ``GRPOTrainer`` with ``trl_config``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench_reward import trl_reward

    cuda = torch.cuda.is_available() and not args.cpu
    cfg = our_config(args, model_dir, prompts, "unused", "stage")
    out_dir = scratch_dir("rft-bench-trl-", dir=args.tmp)
    system = cfg.data.system_prompt
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}]}
                              for r in rows])
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=GRPOConfig(**trl_config(cfg, out_dir, args.steps, cuda)),
                          train_dataset=data, processing_class=tok)
    gen: list[dict] = []
    real_generate = trainer.model.generate

    def timed_generate(*a, **kw):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outp = real_generate(*a, **kw)
        if cuda:
            torch.cuda.synchronize()
        seqs = outp.sequences if hasattr(outp, "sequences") else outp
        new = seqs[:, kw["input_ids"].shape[1]:] if "input_ids" in kw else seqs
        ends = (new == tok.eos_token_id).int()
        # tokens up to and with the first EOS, else all
        first = torch.where(ends.any(1), ends.argmax(1) + 1, torch.full_like(ends[:, 0], new.shape[1]))
        gen.append({"seconds": time.perf_counter() - t0, "tokens": int(first.sum()), "completions": int(new.shape[0])})
        return outp

    trainer.model.generate = timed_generate
    marks: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    trainer.add_callback(StepTimes())
    t0 = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    steps = []
    for i in range(len(marks) - 1):
        g, lg = (gen[i] if i < len(gen) else {}), (logs[i] if i < len(logs) else {})
        steps.append({"step": i + 1, "seconds": round(marks[i + 1] - marks[i], 3), "completions": g.get("completions"),
                      "generated_tokens": g.get("tokens"), "generate_seconds": g.get("seconds"),
                      "reward_mean": lg.get("reward"), "grad_norm": lg.get("grad_norm"), "kl": lg.get("kl")})
        print(json.dumps(steps[-1]), flush=True)
    import trl

    return {"arm": "trl", "trl_version": trl.__version__, "steps": steps, "total_seconds": round(time.perf_counter() - t0, 2)}


# --------------------------------------------------------------------------------------- report
def median_steady(steps: list[dict], key: str = "seconds") -> float | None:
    """Median of ``key`` over steps 2.. (step 1 pays the first kernels, the caches, the reference load)."""
    vals = [s[key] for s in steps[1:] if s.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def same_work(results: dict) -> list[str]:
    """What differs in the work the arms did (empty: the same work): completions per step, generated
    tokens per step within 5% of TRL's, a non-zero gradient norm in every step from step 2 on."""
    problems = []
    trl = results.get("trl")
    for arm, res in results.items():
        for s in res["steps"]:
            if s["step"] >= 2 and not s.get("grad_norm"):
                problems.append(f"{arm} step {s['step']}: gradient norm {s.get('grad_norm')}")
        if trl is None or arm == "trl":
            continue
        for s, t in zip(res["steps"], trl["steps"]):
            if s.get("completions") != t.get("completions"):
                problems.append(f"{arm} step {s['step']}: {s.get('completions')} completions, TRL {t.get('completions')}")
            elif t.get("generated_tokens") and abs(s["generated_tokens"] / t["generated_tokens"] - 1) > 0.05:
                problems.append(f"{arm} step {s['step']}: {s['generated_tokens']} tokens generated, TRL "
                                f"{t['generated_tokens']}")
    return problems


def markdown(res: dict) -> str:
    """docs/benchmarks.md's section of a result (``main``'s JSON)."""
    arms = res["results"]
    trl = median_steady(arms["trl"]["steps"]) if "trl" in arms else None
    lines = [f"Measured {res['date']} on {res['machine']}; {res['load']}. Command: `{res['command']}`. Model: random "
             f"Qwen2, shape `{res['shape']}` ({res['parameters'] / 1e6:.0f}M parameters), `{res['dtype']}`; "
             f"{res['prompts']} prompts x {res['group']} samples x {res['new_tokens']} new tokens per step; "
             f"{res['steps']} steps, median of steps 2-{res['steps']}. torch {res['torch']}"
             f"{', TRL ' + arms['trl']['trl_version'] if 'trl' in arms else ''}.", "",
             "| run | seconds per step (steps 1-N) | median | ours / TRL | tokens/s (generation) | grad norm (last) |",
             "|---|---|---|---|---|---|"]
    for arm, r in arms.items():
        med = median_steady(r["steps"])
        tps = [s["generated_tokens"] / s["generate_seconds"] for s in r["steps"][1:] if s.get("generate_seconds")]
        ratio = f"{med / trl:.2f}" if trl and med and arm != "trl" else ("1" if arm == "trl" else "-")
        lines.append(f"| {arm} | {', '.join(str(round(s['seconds'], 1)) for s in r['steps'])} | {med} | {ratio} | "
                     f"{statistics.median(tps):.0f} | {r['steps'][-1].get('grad_norm')} |" if tps else f"| {arm} | - |")
    for arm in ("resident", "stage"):
        if arm not in arms:
            continue
        steady = arms[arm]["steps"][1:]
        lines += ["", f"**{arm}**, steps 2-{res['steps']}, mean seconds: stage programs and outside them"]
        stages = sorted({k for s in steady for k in s["stage_seconds"]})
        cats = sorted({k for s in steady for k in s["outside"]}, key=lambda k: (k == "other_python", k))
        mean = lambda f: sum(f(s) for s in steady) / len(steady)  # noqa: E731
        lines.append("| " + " | ".join(["step"] + stages + ["**outside**"] + cats) + " |")
        lines.append("|" + "---|" * (2 + len(stages) + len(cats)))
        lines.append("| " + " | ".join([f"{mean(lambda s: s['seconds']):.2f}"]
                                       + [f"{mean(lambda s, k=k: s['stage_seconds'].get(k, 0)):.2f}" for k in stages]
                                       + [f"**{mean(lambda s: s['outside_seconds']):.2f}**"]
                                       + [f"{mean(lambda s, k=k: s['outside'].get(k, 0)):.3f}" for k in cats]) + " |")
        writer = sorted({k for s in steady for k in s.get("background", {})})
        if writer:
            lines += ["", "(background: the writer thread's " + ", ".join(
                f"{k} {mean(lambda s, k=k: s.get('background', {}).get(k, 0)):.3f}" for k in writer) + " s per step)"]
        ahead = sorted({k for s in steady for k in s.get("ahead_seconds", {})})
        if ahead:
            lines += ["", f"({', '.join(ahead)}: run beside the previous step's update, so not subtracted from "
                          "this step's seconds: tests/drive.py, as flows/iteration.py's `_prompts_ahead`)"]
        rebuild = arms[arm].get("rebuild")
        if rebuild and "skipped" not in rebuild:
            lines += ["", f"**{arm}**, rebuilt as a resume would (`--rebuild-probe`): the policy of step "
                          f"{res['steps'] - 1}, {rebuild['replayed']} committed update(s) re-applied in "
                          f"{rebuild['seconds']:.1f} s, {rebuild['inexact']} of them with other weights than their "
                          "recorded digest"]
    lines.append("")
    lines.append("Same work on both sides: " + ("yes (completions per step equal, generated tokens within 5%, non-zero "
                                                 "gradient norms from step 2 on)" if not res["work_differs"] else
                                                 "**no**: " + "; ".join(res["work_differs"])))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: qwen0.5b on a GPU, small on the CPU")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--seed", type=int, default=0, help="the random policy's seed")
    ap.add_argument("--tokenizer", default=None, help="a folder with the tokenizer (default: the default model's)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is visible")
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="our config, dotted key=value")
    ap.add_argument("--tmp", default=None, help="folder for the model, prompts, run roots (default: system temp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--doc", default=None, help="write the section 'GPU step cost' of this markdown file")
    ap.add_argument("--profile", default=None, help="a folder: cProfile of our arms' steps 2.. (<arm>.prof)")
    ap.add_argument("--rebuild-probe", action="store_true",
                    help="after our arm, rebuild the policy of the step before the last as a resume would (with "
                         "checkpoint.every > steps - 1: its weights lived in memory only) and report whether the "
                         "re-applied updates gave the recorded digests")
    ap.add_argument("--allow-other-work", action="store_true",
                    help="exit 0 even when the arms did not do the same work (default: exit 1, after the report)")
    ap.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    if args.cpu:
        os.environ["RFT_DEVICE"] = "cpu"
    cuda = torch.cuda.is_available() and not args.cpu
    args.shape = args.shape or ("qwen0.5b" if cuda else "small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.worker:
        model_dir, prompts = Path(args.model_dir), Path(args.prompts_file)
        res = run_trl(args, model_dir, prompts) if args.worker == "trl" else run_ours(args, args.worker, model_dir, prompts)
        Path(args.result).write_text(json.dumps(res, indent=1, default=str))
        return 0

    work = Path(scratch_dir("rft-bench-gpu-", dir=args.tmp))
    if args.tokenizer is None:
        from rft_core.models.hub import ensure_default_model

        args.tokenizer = str(ensure_default_model())
    model_dir = build_model(args.shape, args.seed, args.tokenizer, work / "model")
    prompts = write_prompts(work / "prompts.jsonl", 16 * args.steps * 2)
    cfg = our_config(args, model_dir, prompts, str(work / "unused"), "stage")
    load0 = os.getloadavg()[0]
    results = {}
    for arm in args.arms.split(","):
        result_path = work / f"{arm}.json"
        cmd = [sys.executable, __file__, "--worker", arm, "--model-dir", str(model_dir), "--prompts-file", str(prompts),
               "--result", str(result_path), "--steps", str(args.steps), "--shape", args.shape, "--dtype", args.dtype,
               *(["--cpu"] if args.cpu else []), *(["--tmp", args.tmp] if args.tmp else []),
               *(["--profile", args.profile] if args.profile else []), *(["--rebuild-probe"] if args.rebuild_probe else []),
               *sum((["--set", o] for o in args.overrides), [])]
        print(f"== {arm}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        results[arm] = json.loads(result_path.read_text())
    from transformers import AutoConfig

    n_params = _parameters(AutoConfig.from_pretrained(model_dir))
    res = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "shape": args.shape, "dtype": args.dtype,
           "parameters": n_params, "steps": args.steps, "prompts": cfg.data.prompts_per_iteration,
           "group": cfg.rollout.n_samples_per_prompt, "new_tokens": cfg.rollout.max_new_tokens, "torch": torch.__version__,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"
                      + (f", {torch.cuda.get_device_name(0)}" if cuda else ""),
           "load": f"load average (1 min) {load0:.2f} before, {os.getloadavg()[0]:.2f} after",
           "command": " ".join(["benchmarks/gpu_bench.py", *sys.argv[1:]]),  # make bench-gpu adds --json, --doc
           "results": results}
    res["work_differs"] = same_work(results)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    if args.doc:
        from gpu_smoke import write_section

        where = "on a GPU" if cuda else "on the CPU"
        write_section(Path(args.doc), f"GPU step cost (`make bench-gpu`), {where}", md)
    print(md)
    if res["work_differs"] and not args.allow_other_work:
        print("the arms did not do the same work: " + "; ".join(res["work_differs"]), file=sys.stderr)
        return 1
    return 0


def _parameters(config) -> int:
    """Parameters of a tied-embedding Qwen2 of ``config`` (embedding once, the layers, the final norm)."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    layer = h * h + 2 * h * kv + (h + 2 * kv) + h * h + 3 * h * i + 2 * h  # q,k,v (+bias), o, MLP, 2 norms
    return config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + n * layer + h


if __name__ == "__main__":
    sys.exit(main())
