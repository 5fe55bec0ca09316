"""Benchmark: generated tokens/s of the HF rollout engine before and after the speed work.

Modes, run interleaved (A B C A B C ...) so that a change in machine load hits all of them:
  before   plain batches of (prompt, sample) requests in input order, each prompt computed n times
  sorted   prompts sorted by length, batches of whole groups (less left padding)
  after    sorted + each prompt's KV cache computed once and repeated for its n samples (the default)

Writes the section "## Rollout engine speed" of docs/benchmarks.md (other sections are kept).

    .venv/bin/python benchmarks/rollout_speed.py [--prompts 16] [--n 4] [--max-new-tokens 64] [--repeats 2]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

MODES = {"before": dict(sort_by_length=False, share_prefill=False),
         "sorted": dict(sort_by_length=True, share_prefill=False),
         "after": dict(sort_by_length=True, share_prefill=True)}
WORKLOADS = {  # name -> (config preset, overrides): the demo's short prompts, and long varied ones
    "demo (basic_arithmetic)": ("configs/grpo_demo.yaml", []),
    "mixed lengths (gsm_symbolic)": ("configs/grpo_gsm_symbolic.yaml", []),
}
SECTION = "## Rollout engine speed"


def _prompts(preset: str, overrides: list[str], n_prompts: int) -> tuple[list[list[int]], object]:
    from rft_core.config import load_config
    from rft_core.stages import prompts as prompts_stage
    from rft_core.stages.contracts import PromptsInput
    from schemas import read_shard

    cfg = load_config(ROOT / preset, [*overrides, f"data.prompts_per_iteration={n_prompts}"])
    ref = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=cfg.policy.path, iteration=1,
                                         out=scratch_dir("rft-rollout-speed-") + "/prompts"))
    return read_shard(ref).column("prompt_token_ids").to_pylist(), cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS), help="default: all")
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks.md"))
    args = ap.parse_args()

    import torch

    from rft_core.engines.hf import HFEngine
    from rft_core.models.loading import DEFAULT_MODEL, load_causal_lm, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(DEFAULT_MODEL)
    engine = HFEngine(load_causal_lm(DEFAULT_MODEL), tok)
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.workload or list(WORKLOADS):
        preset, overrides = WORKLOADS[name]
        prompts, cfg = _prompts(preset, overrides, args.prompts)
        lens = sorted(len(p) for p in prompts)
        runs: dict[str, list[tuple[int, float]]] = {m: [] for m in MODES}
        for rep in range(args.repeats):
            for mode, flags in MODES.items():
                t0 = time.perf_counter()
                gens = engine.generate(prompts, n_samples_per_prompt=args.n, max_new_tokens=args.max_new_tokens,
                                       temperature=cfg.rollout.temperature, batch_size=args.batch_size, seed=rep, **flags)
                dt = time.perf_counter() - t0
                tokens = sum(len(g.response_token_ids) for g in gens)
                runs[mode].append((tokens, dt))
                print(f"{name} | {mode} | rep {rep} | {tokens} tokens in {dt:.1f}s = {tokens / dt:.1f} tok/s", flush=True)
        base = statistics.median(t / s for t, s in runs["before"])
        for mode in MODES:
            tps = statistics.median(t / s for t, s in runs[mode])
            rows.append(f"| {name} | {lens[0]}-{lens[-1]} | {mode} | {statistics.mean(t for t, _ in runs[mode]):.0f} | "
                        f"{statistics.median(s for _, s in runs[mode]):.1f} | {tps:.1f} | {tps / base:.2f}x |")
    load_after = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"Measured {_dt.date.today()} on {platform.machine()}, {os.cpu_count()} CPU cores, torch CPU "
        f"({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}), SmolLM2-135M-Instruct float32; {args.prompts} prompts x {args.n} samples, "
        f"max_new_tokens {args.max_new_tokens}, batch_size {args.batch_size}, median of {args.repeats} interleaved runs. "
        f"Load average {load_before:.1f} before / {load_after:.1f} after (other processes share the cores: compare "
        "the modes with each other, not with other tables).",
        "",
        f"Command: `.venv/bin/python benchmarks/rollout_speed.py --prompts {args.prompts} --n {args.n} "
        f"--max-new-tokens {args.max_new_tokens} --repeats {args.repeats}"
        + (f" --threads {args.threads}" if args.threads else "") + "`",
        "",
        "| workload | prompt tokens | mode | generated tokens | seconds | tokens/s | vs before |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "`before`: batches of (prompt, sample) requests in input order, every prompt computed n times. "
        "`sorted`: prompts sorted by length, batches of whole groups. `after` (the default): sorted, and each "
        "prompt's KV cache computed once and repeated for its n samples, so generate decodes from the cached "
        "prefix (HF `generate` with `use_cache=True` throughout). Samples differ between modes (other "
        "batches, other random draws), so token counts differ too; tokens/s is the comparable number. "
        "`sorted` and `after` draw the same samples (same batches and seeds), so their difference is the "
        "prompt prefill saved. On a loaded 2-core machine, one torch thread is used: with two, OpenMP's "
        "spin-waiting made every mode about 10x slower.",
        "",
    ]
    out = Path(args.out)
    old = out.read_text() if out.exists() else "# Benchmarks\n"
    if SECTION in old:
        start = old.index(SECTION)
        nxt = old.find("\n## ", start + 1)
        new = old[:start] + "\n".join(lines) + (old[nxt:] if nxt >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + "\n".join(lines)
    out.write_text(new)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
