"""GPU proof (issue 31): the demo preset for N iterations on one GPU, without Prefect.

The device machines have no Prefect (and cannot fetch it), so this runs the stage programs of
``flows/iteration.py`` in the same order, in one process, each through
``rft_core.stages.runner.run_stage`` exactly as a Prefect task calls it: prompts -> rollout ->
rewards, actor log-probs (when recomputed), reference log-probs (when the KL needs them) ->
advantages -> policy update. Dynamic sampling and critics are not covered (the demo uses
neither; the script refuses such a config). Per iteration it records the flow's metrics
(``iteration_metrics``), wall seconds and peak GPU memory (``torch.cuda.max_memory_allocated``).

    python benchmarks/gpu_demo.py [--config configs/grpo_demo.yaml] [--iterations 4] [--set key=value ...] [--json out.json]

Exit status 2 when no CUDA device is visible (``--cpu`` runs it on the CPU instead).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _env import ROOT  # noqa: E402  (repository on sys.path, offline environment)


def run(cfg, cuda: bool) -> list[dict]:
    """Run ``cfg.iterations`` iterations under ``cfg.run_root``; the metrics of each."""
    import torch

    from rft_core.api import (ActorLogprobsInput, AdvantagesInput, PPOUpdateInput, PromptsInput, RefLogprobsInput,
                              RewardsInput, RolloutInput, dataset_fingerprint, iteration_metrics, next_state, run_stage)
    from schemas import stage_uri

    if cfg.dynamic_sampling.enabled or cfg.needs_critic:
        raise SystemExit("gpu_demo covers the demo's stages only: no dynamic sampling, no critic")
    policy, state, rows = cfg.policy.path, cfg.initial_state, []
    for it in range(1, cfg.iterations + 1):
        def out(stage: str) -> str:
            return stage_uri(cfg.run_root, it, stage)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        kl = cfg.kl.model_copy(update={"kl_coef": state.kl_coef})
        temp = cfg.rollout.temperature
        prompts = run_stage(PromptsInput(data=cfg.data, tokenizer_path=cfg.policy.path, iteration=it, attempt=0,
                                         out=out("prompts"), data_fingerprint=dataset_fingerprint(cfg.data)))
        rollout = run_stage(RolloutInput(prompts=prompts, policy=policy, rollout=cfg.rollout, iteration=it,
                                         dtype=cfg.policy.dtype, attempt=0, out=out("rollout")))
        parts = {"rewards": run_stage(RewardsInput(rollout=rollout, prompts=prompts, reward=cfg.reward, out=out("rewards")))}
        if cfg.recomputes_old_logprobs:
            parts["actor_logprobs"] = run_stage(ActorLogprobsInput(
                rollout=rollout, model=policy, logprobs=cfg.logprobs, temperature=temp, dtype=cfg.policy.dtype,
                out=out("actor_logprobs")))
        if kl.needs_reference:
            parts["ref_logprobs"] = run_stage(RefLogprobsInput(
                rollout=rollout, model=cfg.reference_model.path, logprobs=cfg.logprobs, temperature=temp,
                dtype=cfg.reference_model.dtype, out=out("ref_logprobs")))
        adv = run_stage(AdvantagesInput(
            rollout=rollout, rewards=parts["rewards"], actor_logprobs=parts.get("actor_logprobs"),
            ref_logprobs=parts.get("ref_logprobs"), critic_values=None, kl=kl, advantage=cfg.advantage,
            shaping=cfg.shaping, state=state, max_new_tokens=cfg.rollout.max_new_tokens, out=out("advantages")))
        policy = run_stage(PPOUpdateInput(
            rollout=rollout, advantages=adv, actor_logprobs=parts.get("actor_logprobs"),
            ref_logprobs=parts.get("ref_logprobs"), policy=policy, update=cfg.update, kl=kl, temperature=temp,
            dtype=cfg.policy.dtype, background_optimizer=False, out=out("ppo_update")))
        m = iteration_metrics(it, {"prompts": prompts, "rollout": rollout, **parts, "advantages": adv, "ppo_update": policy})
        m["seconds/iteration"] = round(time.perf_counter() - t0, 3)
        if cuda:
            m["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        state = next_state(adv)
        rows.append(m)
        print(json.dumps(m, default=str), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/grpo_demo.yaml"))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--run-root", default=None, help="default: a new temporary folder")
    ap.add_argument("--json", default=None, help="write the per-iteration metrics here")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a dry run of the script)")
    args = ap.parse_args()
    import torch

    if args.cpu:
        os.environ["RFT_DEVICE"] = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu", file=sys.stderr)
        return 2
    from rft_core.config import load_config

    run_root = args.run_root or tempfile.mkdtemp(prefix="rft-gpu-demo-")
    cfg = load_config(args.config, [*args.overrides, f"iterations={args.iterations}", f"run_root={run_root}"])
    t0 = time.perf_counter()
    rows = run(cfg, cuda=not args.cpu)
    result = {"config": args.config, "overrides": args.overrides, "run_root": run_root, "device":
              "cpu" if args.cpu else torch.cuda.get_device_name(0), "torch": torch.__version__,
              "wall_seconds": round(time.perf_counter() - t0, 3), "iterations": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
