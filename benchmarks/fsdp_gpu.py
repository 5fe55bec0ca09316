"""FSDP2 against DeepSpeed ZeRO-3 (issue 47): one policy update of each on the same device and
model, in bfloat16 (float32 masters), timed, with its peak memory.

Each backend runs in a child process of its own (a clean CUDA context and process group, so
the peak memory is that backend's alone): ``--nproc 1`` (the default) starts one plain child (a
world of one rank, as ``init_process_group`` / ``init_distributed`` set it up outside
torchrun), ``--nproc N`` starts ``torch.distributed.run`` with N ranks. Every rank builds the
same synthetic update (``--samples`` random prompts and responses, +-1 advantages), runs it once
to warm up (kernels, lazy allocations, FSDP2's lazy init, DeepSpeed's partitioning) and once
measured, and prints one JSON line; the parent prints one JSON line per backend and a summary.

FSDP2's ranks load as the update stage does: rank 0 reads the weights and sends each rank its
shards (``rft_core.training.fsdp.weights_on_rank0``, since 2026-12-02).

Per backend: ``setup_s`` (load, wrap, optimizer), ``update_s`` (the measured update: forward,
backward, clipping and AdamW over ``--samples`` samples in ``--steps`` optimizer steps),
``peak_gib`` (``torch.cuda.max_memory_allocated`` of rank 0; on the CPU the ranks' summed peak
RSS, ``ru_maxrss``), ``grad_norm`` and ``policy_loss`` of the last step (the two backends run
the same update: they should agree to bfloat16 rounding).

Needs torch, transformers and this repository's ``rft_core`` only: no network (the default
model is the embedded SmolLM2-135M), no Prefect, no Ray; without deepspeed it reports FSDP2
alone.

    python benchmarks/fsdp_gpu.py                           # the default model on one GPU, < 2 min on an H100
    python benchmarks/fsdp_gpu.py --model /tmp/q05 --json out.json   # the 0.4B shape of make bench-gpu (gpu_bench.build_model)
    python benchmarks/fsdp_gpu.py --cpu --tiny              # dry run on the CPU with a tiny random Llama
    python benchmarks/fsdp_gpu.py --cpu --nproc 2           # CPU, 2 ranks over gloo (docs/scale.md)

Exit status 2 when no CUDA device is visible and ``--cpu`` is not given.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

BACKENDS = ("fsdp", "zero3")


def _data(args, vocab: int):
    """The synthetic update: ``args.samples`` prompts of ``args.prompt_len`` and responses of
    ``args.response_len`` random tokens (seeded), old log-probs log(1 / vocab) (about a random
    model's, so the PPO ratio stays near 1 and no token is clipped away), advantages +-1."""
    import math

    import torch

    from rft_core.training.update import UpdateData

    g = torch.Generator().manual_seed(0)
    n = args.samples
    prompts = torch.randint(3, vocab, (n, args.prompt_len), generator=g).tolist()
    responses = torch.randint(3, vocab, (n, args.response_len), generator=g).tolist()
    return UpdateData(prompts=prompts, responses=responses, old_logprobs=[[-math.log(vocab)] * args.response_len] * n,
                      advantages=[[1.0 if i % 2 else -1.0] * args.response_len for i in range(n)])


def _strategy(args, backend: str, model_path: str):
    """The model loaded in ``args.dtype`` and the strategy of ``backend`` over it."""
    from rft_core.config import DeepSpeedConfig, FSDPConfig
    from rft_core.models.loading import load_causal_lm
    from rft_core.training.strategy import OptimizerSettings, build_strategy, weights_on_rank0

    with weights_on_rank0(backend == "fsdp"):  # as the update stage loads it: FSDP2's rank 0 alone reads the weights
        model = load_causal_lm(model_path, dtype=args.dtype, trainable=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optim = OptimizerSettings(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
    if backend == "fsdp":
        return build_strategy(model, optim=optim, fsdp=FSDPConfig(reshard_after_forward=True))
    return build_strategy(model, optim=optim, deepspeed=DeepSpeedConfig(zero_stage=3), keeps_deepspeed_state=True)


def one(args) -> int:
    """A child: one backend's warm-up and measured update on this rank; prints one JSON line."""
    import torch

    from rft_core.models.loading import load_tokenizer
    from rft_core.config import UpdateConfig
    from rft_core.training.update import UpdateSettings, ppo_update

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        os.environ["RFT_DEVICE"] = "cpu"
        if args.backend == "zero3":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.perf_counter()
    strategy = _strategy(args, args.backend, args.model)
    tok = load_tokenizer(args.model)
    setup_s = time.perf_counter() - t0
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB: this rank's peak while loading
    setup_gpu = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    data = _data(args, min(len(tok), 32000))
    settings = UpdateSettings(UpdateConfig(micro_batch_size=args.micro_batch,
                                           train_batch_size=max(1, args.samples // args.steps), packing=True))

    def update():
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        steps = ppo_update(strategy, data, settings, pad_token_id=tok.pad_token_id)
        if cuda:
            torch.cuda.synchronize()
        return steps, time.perf_counter() - t

    _, warm_s = update()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps, update_s = update()
    row = {"backend": args.backend, "rank": strategy.rank, "world_size": strategy.world_size,
           "setup_s": round(setup_s, 2), "setup_peak_rss_gib": round(setup_rss, 3),
           "setup_peak_gib": None if setup_gpu is None else round(setup_gpu, 3), "warmup_s": round(warm_s, 2), "update_s": round(update_s, 2),
           "optimizer_steps": len(steps), "grad_norm": steps[-1].grad_norm, "policy_loss": steps[-1].policy_loss,
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    print("RESULT " + json.dumps(row), flush=True)
    return 0


def _child(args, backend: str) -> dict | None:
    """Run ``one`` for ``backend`` in ``args.nproc`` child process(es); the summed row, or None
    when the backend cannot run here (deepspeed absent)."""
    if backend == "zero3":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("deepspeed is not installed: FSDP2 alone", file=sys.stderr)
            return None
    own = [sys.executable, os.path.abspath(__file__), "--one", backend, *args.passthrough]
    if args.nproc > 1:
        own = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               *own[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.cpu else "4")}
    t0 = time.perf_counter()
    proc = subprocess.run(own, capture_output=True, text=True, env=env, timeout=args.timeout)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    if proc.returncode != 0 or not rows:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{backend}: the child failed with exit code {proc.returncode}")
    first = min(rows, key=lambda r: r["rank"])
    return {**first, "update_s": max(r["update_s"] for r in rows), "ranks": len(rows),
            "peak_rss_gib": round(sum(r["peak_rss_gib"] for r in rows), 3), "wall_s": round(time.perf_counter() - t0, 1),
            "setup_peak_rss_gib_by_rank": [r["setup_peak_rss_gib"] for r in sorted(rows, key=lambda r: r["rank"])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (2 layers, width 32): a dry run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps of the update")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torch.distributed.run) per backend")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (gloo)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per backend")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--one", dest="backend", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend is not None:
        return one(args)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu", file=sys.stderr)
        return 2
    if args.tiny:
        from tests.tiny import build_tiny_model

        args.model = build_tiny_model(os.path.join(scratch_dir("rft-fsdp-bench-"), "tiny"))
    if args.model is None:
        from rft_core.models.hub import ensure_default_model

        args.model = str(ensure_default_model())
    args.passthrough = [f"--model={args.model}", f"--dtype={args.dtype}", f"--samples={args.samples}",
                        f"--prompt-len={args.prompt_len}", f"--response-len={args.response_len}",
                        f"--micro-batch={args.micro_batch}", f"--steps={args.steps}",
                        *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
                        *(["--cpu"] if args.cpu else [])]
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    rows = []
    for backend in args.backends.split(","):
        row = _child(args, backend)
        if row is not None:
            row.update(device=device, model=args.model, torch=torch.__version__)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after each backend: a time limit that ends the second leaves the first
                with open(args.json, "w") as fh:
                    json.dump(rows, fh, indent=1)
    if len(rows) == 2:
        f, z = rows
        key = "peak_gib" if f["peak_gib"] is not None else "peak_rss_gib"
        print(f"FSDP2 {f['update_s']} s, {f[key]} GiB; ZeRO-3 {z['update_s']} s, {z[key]} GiB ({key}, {device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
