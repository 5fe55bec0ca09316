"""``make bench-fsdp-demo`` (issue 47's must-show): the demo preset trained twice on the CPU, as a
user runs it, and the two runs' final weights compared:

    rft train -c configs/grpo_demo.yaml --set update.fsdp.reshard_after_forward=true \\
        --set orchestration.workers=resident --set orchestration.policy_ranks=2
    rft train -c configs/grpo_demo.yaml            # one process, no update.fsdp

It reports the largest absolute difference of the final safetensors and, per iteration, how many
rollout responses are the same token for token; exits 1 when the weights differ by more than
``--atol`` (1e-6). Needs Ray (the resident workers); ~8 min on 2 cores at load 1.

    .venv/bin/python benchmarks/fsdp_demo.py [--root DIR] [--json docs/raw/fsdp_demo.json]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

FSDP = ["update.fsdp.reshard_after_forward=true", "orchestration.workers=resident", "orchestration.policy_ranks=2"]


def train(root: Path, sets: list[str]) -> float:
    """One ``rft train`` of the demo preset under ``root``; its seconds.

    Raises:
        subprocess.CalledProcessError: the run failed (its log is ``root``.log).
    """
    cmd = [str(Path(sys.executable).with_name("rft")), "train", "-c", str(ROOT / "configs/grpo_demo.yaml"),
           "--set", f"run_root={root}", *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    with open(f"{root}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return round(time.perf_counter() - t0, 1)


def compare(plain: Path, fsdp: Path) -> dict:
    """Largest |difference| of the last update's weights, and equal responses per iteration."""
    from safetensors.torch import load_file

    from schemas import ShardRef, read_shard, stage_uri
    from rft_core.stages.checkpoints import policy_model_path

    out: dict = {"responses_equal": {}}
    it = 1
    while Path(stage_uri(str(plain), it + 1, "ppo_update")).exists():
        it += 1
    weights = []
    for root in (plain, fsdp):
        folder = Path(policy_model_path(ShardRef.from_manifest(stage_uri(str(root), it, "ppo_update"))))
        weights.append({k: v.float() for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()})
    out["max_abs_diff"] = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    for i in range(1, it + 1):
        a, b = (read_shard(stage_uri(str(r), i, "rollout"), stage="rollout").column("response_token_ids").to_pylist()
                for r in (plain, fsdp))
        out["responses_equal"][i] = f"{sum(x == y for x, y in zip(a, b))} of {len(a)}"
    out["iterations"] = it
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="folder for the two run roots (default: a new temporary one)")
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(args.root or scratch_dir("rft-fsdp-demo-"))
    load = os.getloadavg()[0]
    res = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "load_before": round(load, 2),
           "seconds": {"plain": train(root / "plain", []), "fsdp": train(root / "fsdp", FSDP)}}
    res.update(compare(root / "plain", root / "fsdp"))
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["max_abs_diff"] <= args.atol else 1


if __name__ == "__main__":
    sys.exit(main())
