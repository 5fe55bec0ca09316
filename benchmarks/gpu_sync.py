"""GPU proof (issues 27 and 31): the resident workers' weight sync between two processes on one
GPU, timed per GB, and whether NCCL accepts such a pair.

Parent = the trainer, child = the rollout engine, both on ``cuda:0``:
1. CUDA IPC (``rft_core.weightsync.cuda_ipc.export_cuda_ipc`` / ``import_cuda_ipc``, what two workers
   on one GPU use): the parent packs the weights into buckets and sends their IPC handles; the
   child copies them into its own tensors; both digests must agree.
   ``cuda_ipc_from_cpu``: the same with the parent's weights on the CPU, packed onto the GPU by
   ``export_cuda_ipc`` (what a DeepSpeed ZeRO-3 export hands over: its consolidated state dict
   is on the CPU).
2. A two-rank NCCL group (``send_weights`` / ``receive_weights`` with backend ``nccl``): what two
   workers on different GPUs use. On one GPU NCCL refuses the pair; the error is recorded (the
   sync's NCCL group blocks on its waits, so the refusal is raised, not a watchdog teardown).

Weights: ``--sizes`` synthetic bfloat16 state dicts of that many GB (in 64 MB tensors), plus
``--model`` (a model path, bfloat16) when given.

    python benchmarks/gpu_sync.py [--sizes 0.27,2,8] [--model smollm2-135m-instruct] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from _env import ROOT  # noqa: E402,F401  (repository on sys.path)


def synthetic(gb: float, device: str = "cuda") -> dict:
    """A bfloat16 state dict of ``gb`` GB in tensors of 32 Mi elements (64 MB)."""
    import torch

    n, per = int(gb * 1e9 / 2), 32 * 2**20
    g = torch.Generator(device=device).manual_seed(0)
    out, i = {}, 0
    while n > 0:
        k = min(per, n)
        out[f"layers.{i:04d}.weight"] = torch.randn(k, generator=g, device=device, dtype=torch.bfloat16)
        n -= k
        i += 1
    return out


def _child(kind: str, shapes: dict, q_in, q_out, port: int) -> None:
    import torch

    from rft_core.weightsync.collective import receive_weights
    from rft_core.weightsync.cuda_ipc import import_cuda_ipc
    from rft_core.weightsync.plan import SyncPlan

    torch.cuda.set_device(0)
    target = {k: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for k, s in shapes.items()}
    plan = SyncPlan.of(target, bucket_mb=1024)
    try:
        if kind.startswith("cuda_ipc"):
            handles = q_in.get(timeout=600)
            rep = import_cuda_ipc(handles, target, plan)
        else:
            rep = receive_weights(target, plan, addr="127.0.0.1", port=port, backend="nccl", timeout_s=60)
        q_out.put({"ok": True, "seconds": rep.seconds, "bytes": rep.bytes, "digest": rep.digest, "buckets": rep.buckets})
    except Exception as exc:  # noqa: BLE001  recorded, not raised: the probe reports what happened
        q_out.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]})


def sync_once(kind: str, tensors: dict) -> dict:
    """One sync of ``tensors`` from this process to a new child process on the same GPU."""
    import torch
    import torch.multiprocessing as mp

    from rft_core.network import free_port
    from rft_core.weightsync.collective import send_weights
    from rft_core.weightsync.cuda_ipc import export_cuda_ipc
    from rft_core.weightsync.digest import weights_digest
    from rft_core.weightsync.plan import SyncPlan

    ctx = mp.get_context("spawn")
    q_in, q_out, port = ctx.Queue(), ctx.Queue(), free_port()
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    p = ctx.Process(target=_child, args=(kind, shapes, q_in, q_out, port))
    p.start()
    plan = SyncPlan.of(tensors, bucket_mb=1024)
    t0 = time.perf_counter()
    res: dict = {"kind": kind, "gb": round(plan.payload_bytes / 1e9, 3)}
    try:
        if kind.startswith("cuda_ipc"):
            src = {k: v.cpu() for k, v in tensors.items()} if kind == "cuda_ipc_from_cpu" else tensors
            t0 = time.perf_counter()
            handles, buffers = export_cuda_ipc(src, plan, "cuda")
            res["pack_s"] = round(time.perf_counter() - t0, 4)
            q_in.put(handles)
            got = q_out.get(timeout=600)
            del buffers
        else:
            send_weights(tensors, plan, addr="127.0.0.1", port=port, backend="nccl", timeout_s=60, device="cuda")
            got = q_out.get(timeout=120)
    except Exception as exc:  # noqa: BLE001  recorded
        got = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        try:
            got = q_out.get(timeout=30) | {"sender_error": got["error"]}
        except Exception:  # noqa: BLE001
            pass
    p.join(30)
    if p.is_alive():
        p.kill()
    res.update(got)
    if got.get("ok"):
        res["digest_match"] = got["digest"] == weights_digest(tensors, "device")
        res["receiver_s_per_gb"] = round(got["seconds"] / max(got["bytes"] / 1e9, 1e-12), 4)
    torch.cuda.synchronize()
    return res


def checksum_speed(tensors: dict) -> dict:
    """Seconds per GB of the sync's verification on the GPU (the ``device`` digest, the tensors
    where they are) and of the host-side digests (a copy to the host, then sha256 as before issue
    46, or XXH3-128)."""
    import functools

    import torch

    from rft_core.weightsync.digest import weights_digest

    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    weights_digest(tensors, "device")  # its multiplier table, once per device
    torch.cuda.synchronize()
    out = {}
    for name, method in (("device_digest", "device"), ("sha256_host", "sha256"), ("xxh3_host", "xxh3")):
        fn = functools.partial(weights_digest, method=method)
        t0 = time.perf_counter()
        fn(tensors)
        torch.cuda.synchronize()
        out[f"{name}_s_per_gb"] = round((time.perf_counter() - t0) / max(gb, 1e-12), 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.27,2,8", help="synthetic bfloat16 state dicts, GB")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    results = []
    cases = [(f"synthetic {gb} GB", lambda gb=gb: synthetic(float(gb))) for gb in args.sizes.split(",")]
    if args.model:
        from rft_core.models.loading import load_causal_lm
        from rft_core.weightsync.plan import state_tensors

        cases.append((args.model, lambda: state_tensors(load_causal_lm(args.model, dtype="bfloat16").to("cuda"))))
    for name, make in cases:
        tensors = make()
        speed = {"case": name, "kind": "checksum", **checksum_speed(tensors)}
        results.append(speed)
        print(json.dumps(speed), flush=True)
        for kind in ("cuda_ipc", "cuda_ipc_from_cpu", "nccl"):
            r = sync_once(kind, tensors)
            r["case"] = name
            results.append(r)
            print(json.dumps(r), flush=True)
        del tensors
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "results": results}
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
