"""CPU proof (issues 44 and 46): the resident workers' weight sync between two Ray actors on one
host, timed per sync, on the default model (SmolLM2-135M in float32, 538 MB: the demo preset).

The real workers: a ``PolicyWorker`` actor holding the model's weights as its trainer would (a
bare model in place of a trained one: the sync reads ``merged_tensors`` of its strategy) and a
``RolloutWorker`` actor holding its own copy; each round changes the sender's weights a little
and asks the rollout worker for that version (``inference_model``), which pulls it through the
transport ``choose_transport`` picks (``shm`` on one host since issue 46; ``gloo`` before) and
verifies it. Reports each round's seconds (the receiver's whole pull: prepare, move, verify;
``RolloutWorker.syncs``) and the driver's wall time of the call, with the load average.

With ``--lora-rank R`` the sender holds a LoRA policy (peft adapters of rank R, all-linear) and
each round moves its adapters a little: in float32 the rollout worker receives the merged weights
(peft's ``merge_and_unload`` on a copy, then every weight), with ``--dtype bfloat16`` it keeps the
adapters on its base and receives the adapters only (``rft_core.models.lora.keeps_adapters``).

    python benchmarks/cpu_sync.py [--rounds 6] [--no-shm] [--dtype bfloat16] [--lora-rank 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _env import ROOT  # noqa: E402,F401  (repository on sys.path)


def _sender_class(shm: bool, dtype: str, lora_rank: int | None):
    import dataclasses
    from types import SimpleNamespace

    import torch

    from rft_core.models.loading import load_causal_lm
    from rft_core.models.lora import apply_lora
    from rft_core.stages.sources import version_key
    from rft_core.weightsync.trained import adapter_tensors
    from rft_core.workers.policy import PolicyWorker

    class BenchPolicy(PolicyWorker):
        """A policy worker whose "trainer" is the bare model, with a ``hold`` that changes it."""

        def hold(self, path: str, ref: str) -> None:
            if self.held is None:
                model = load_causal_lm(path, dtype=dtype)
                if lora_rank:
                    model = apply_lora(model, rank=lora_rank, alpha=2.0 * lora_rank, dropout=0.0,
                                       target_modules="all-linear", base_path=path, seed=0)
                self.held = SimpleNamespace(strategy=SimpleNamespace(model=model))
            model = self.held.strategy.model
            with torch.no_grad():  # an update: the first weight, or every adapter of a LoRA policy
                for t in (adapter_tensors(model).values() if lora_rank else [next(model.parameters())]):
                    t.add_(1e-3)
            self.trained(ref)
            assert self.version == version_key(ref)

        def prepare_weights(self, ref, dtype=None):
            offer = super().prepare_weights(ref, dtype)
            return offer if shm or offer is None else dataclasses.replace(offer, shm_free=0)  # --no-shm: gloo

    return BenchPolicy


def _pull(worker, ref: str, dtype: str) -> None:
    """In the rollout actor: make its copy hold ``ref`` (the model itself stays there)."""
    worker.inference_model(ref, dtype=dtype, role="policy")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each actor")
    ap.add_argument("--no-shm", action="store_true", help="offer no shared memory (the sync goes over gloo)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lora-rank", type=int, default=None, help="a LoRA policy of this rank (all-linear, alpha 2 x rank)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    from rft_core.config import LoraConfig
    from rft_core.models.loading import ensure_default_model
    from rft_core.workers.base import NAMESPACE, actor_name
    from rft_core.workers.rollout import RolloutWorker

    path = str(ensure_default_model())
    pool = f"bench-cpu-sync-{os.getpid()}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    try:
        sender = ray.remote(_sender_class(not args.no_shm, args.dtype, args.lora_rank)).options(
            name=actor_name(pool, "policy"), num_cpus=0).remote(pool, threads=args.threads)
        lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
        receiver = ray.remote(RolloutWorker).options(name=actor_name(pool, "rollout"), num_cpus=0).remote(
            pool, threads=args.threads, lora=lora)
        ray.get(receiver.__ray_call__.remote(_pull, path, args.dtype))  # its copy, from storage
        rounds = []
        for i in range(args.rounds):
            ref = f"{path}#v{i + 1}"
            ray.get(sender.hold.remote(path, ref))
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            ray.get(receiver.__ray_call__.remote(_pull, ref, args.dtype))
            wall = time.perf_counter() - t0
            sync = ray.get(receiver.__ray_call__.remote(lambda w: w.syncs[-1]))
            assert sync["version"] == f"path:{ref}", sync
            rounds.append({"round": i + 1, "seconds": round(sync["seconds"], 3), "wall_s": round(wall, 3),
                           "backend": sync["backend"], "bytes": sync["bytes"], "load1": round(load, 2),
                           **{k: round(sync[k], 3) for k in ("send_s", "receive_s") if k in sync}})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        ray.shutdown()
    steady = [r["seconds"] for r in rounds[1:]] or [rounds[0]["seconds"]]
    out = {"model": path, "dtype": args.dtype, "lora_rank": args.lora_rank, "rounds": rounds,
           "median_s": round(statistics.median(steady), 3), "min_s": round(min(steady), 3), "load_avg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
