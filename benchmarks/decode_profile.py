"""Why does the HF engine decode slower in bfloat16 than in float32 on a GPU, and why does the
same rollout take 2.8 s one iteration and 8.6 s the next (issue 44, item 5)? This measures it.

For each dtype (float32, bfloat16) on the random Qwen2 of ``gpu_bench.SHAPES`` (the default
tokenizer's vocabulary), ``--batch`` sequences (prompts x samples) of ``--new-tokens`` tokens
(EOS is never drawn: random weights rarely pick it, and a drawn EOS only shortens the run):

- ``engine``: our ``HFEngine.generate`` (the rollout's decode loop), ``--repeats`` times: seconds
  and milliseconds per decode step, each repeat (so a swing between repeats shows), once with the
  CUDA cache emptied before every repeat (what every stage did until issue 44) and once keeping it;
- ``hf_generate``: transformers' ``generate`` (what TRL's GRPOTrainer calls) on the same batch;
- ``profile``: torch.profiler over 8 decode steps of the engine: the ops with the most self CPU
  and self device time, kernel launches and host-device synchronisations per step.

    python3 benchmarks/decode_profile.py [--shape qwen0.5b] [--batch 128] [--new-tokens 128] [--json out.json]
    .venv/bin/python benchmarks/decode_profile.py --shape small --batch 32 --new-tokens 32   # CPU dry run
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402,F401  (repository on sys.path, offline environment)
from gpu_bench import SHAPES, build_model


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def engine_runs(engine, prompts, args, device, *, empty_cache: bool) -> list[dict]:
    """``args.repeats`` timed runs of ``engine.generate``; ``empty_cache``: ``torch.cuda.empty_cache()`` before each."""
    import torch

    runs = []
    for r in range(args.repeats):
        if empty_cache and device.type == "cuda":
            torch.cuda.empty_cache()
        _sync(device)
        t0 = time.perf_counter()
        gens = engine.generate(prompts, n_samples_per_prompt=args.group, max_new_tokens=args.new_tokens,
                               temperature=1.0, batch_size=args.batch, seed=r)
        _sync(device)
        dt = time.perf_counter() - t0
        tokens = sum(len(g.response_token_ids) for g in gens)
        runs.append({"seconds": round(dt, 3), "tokens": tokens, "ms_per_step": round(1000 * dt / args.new_tokens, 2)})
    return runs


def hf_generate(model, tok, prompts, args, device) -> dict:
    """transformers' ``generate`` (sampling, KV cache) on the same prompts, each repeated ``group`` times."""
    import torch

    rows = [p for p in prompts for _ in range(args.group)]
    batch = tok.pad({"input_ids": rows}, return_tensors="pt").to(device)
    kw = dict(do_sample=True, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, top_k=0, top_p=1.0,
              temperature=1.0, pad_token_id=tok.pad_token_id)
    model.generate(**batch, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(**batch, **kw)
    _sync(device)
    dt = time.perf_counter() - t0
    return {"seconds": round(dt, 3), "ms_per_step": round(1000 * dt / args.new_tokens, 2)}


def profile_steps(engine, prompts, args, device) -> dict:
    """torch.profiler over a short generation (8 steps): top ops by self CPU and self device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = 8
    with profile(activities=acts) as prof:
        engine.generate(prompts, n_samples_per_prompt=args.group, max_new_tokens=steps, temperature=1.0,
                        batch_size=args.batch, seed=0)
        _sync(device)
    ev = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    top = lambda key: [{"op": e.key[:60], "calls": e.count, "self_ms": round(getattr(e, key) / 1000, 2)}  # noqa: E731
                       for e in sorted(ev, key=lambda e: -getattr(e, key))[:args.top]]
    count = lambda name: sum(e.count for e in ev if e.key == name)  # noqa: E731
    return {"steps": steps, "top_cpu": top("self_cpu_time_total"), "top_device": top(dev_attr) if device.type == "cuda" else [],
            "kernel_launches_per_step": round(count("cudaLaunchKernel") / steps, 1),
            "syncs_per_step": round((count("cudaStreamSynchronize") + count("cudaDeviceSynchronize")) / steps, 1),
            "memcpy_per_step": round((count("cudaMemcpyAsync") + count("cudaMemcpy")) / steps, 1),
            "malloc_per_step": round(count("cudaMalloc") / steps, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: qwen0.5b on a GPU, small on the CPU")
    ap.add_argument("--tokenizer", default=None, help="a folder with the tokenizer (default: the default model's)")
    ap.add_argument("--batch", type=int, default=128, help="sequences at once (prompts x group)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from rft_core.engines.hf import HFEngine
    from rft_core.models.hub import configure_cuda_backends
    from rft_core.models.loading import load_causal_lm
    from rft_core.models.pretrained import load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configure_cuda_backends()
    args.shape = args.shape or ("qwen0.5b" if device.type == "cuda" else "small")
    if args.tokenizer is None:
        from rft_core.models.hub import ensure_default_model

        args.tokenizer = str(ensure_default_model())
    folder = build_model(args.shape, 0, args.tokenizer, Path(scratch_dir("rft-decode-")) / "model")
    tok = load_tokenizer(str(folder))
    n_prompts = max(1, args.batch // args.group)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write about topic number {i}."}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(n_prompts)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    res: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
                 "shape": args.shape, "batch": args.batch, "new_tokens": args.new_tokens, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        model = load_causal_lm(str(folder), dtype=dtype).to(device).eval()
        engine = HFEngine(model, tok)
        engine.generate(prompts, n_samples_per_prompt=args.group, max_new_tokens=4, batch_size=args.batch, seed=99)  # warm-up
        out = {"engine_empty_cache": engine_runs(engine, prompts, args, device, empty_cache=True),
               "engine_keep_cache": engine_runs(engine, prompts, args, device, empty_cache=False),
               "hf_generate": hf_generate(model, tok, prompts, args, device),
               "profile": profile_steps(engine, prompts, args, device)}
        res["dtypes"][dtype] = out
        print(json.dumps({dtype: {k: v for k, v in out.items() if k != "profile"}}), flush=True)
        print(json.dumps({dtype: out["profile"]}, indent=None), flush=True)
        if args.json:  # after each dtype: a run stopped by its time limit keeps what it measured
            Path(args.json).write_text(json.dumps(res, indent=1))
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
