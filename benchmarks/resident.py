"""Benchmark (issue 27): the demo preset for N iterations with ``orchestration.workers=stage``,
then with ``workers=resident`` and ``checkpoint.every=K``, one after the other.

Per iteration and mode it records:
- ``bytes_written``: the bytes of every file committed under the run root for that iteration
  (Parquet parts, weights, tokenizer, optimizer state), read from the manifests;
- ``bytes_read``: the bytes of model weights and optimizer states read from storage
  (``rft_core.counters.counts``; the experience shards, a few MB, are not counted);
- ``model_loads``: models read from storage; ``engine_builds``: rollout engines built over a
  model read for them;
- ``weight_syncs``, ``weight_sync_s``, ``weight_sync_bytes``: in-memory weight syncs
  (trainer -> rollout engine) and their seconds and bytes; ``weight_sync_wait_s``: the seconds
  a rollout waited for the sync ahead to land (the part of the sync the driver's work between
  an update and the next rollout did not hide; counted where it waited);
- ``seconds``: the iteration's wall seconds (the flow's ``seconds/iteration``);
- ``outside_seconds``: ``seconds`` less its stages' own (``stage_seconds``): the task runs, the
  resident calls, the weight sync when a rollout waits for it, the reads and writes around each
  program (issue 44's target: at most 0.5 s in a steady resident iteration). A stage committed
  before the iteration started (its prompts, run beside the previous iteration's update,
  ``flows/iteration.py``'s ``_prompts_ahead``, ``tests/drive.py``) is not subtracted: its seconds are listed in
  ``ahead_seconds`` (the iteration takes it as it is, without a task run of its own);
- ``step_seconds`` (flow driver): from this iteration's start to the next one's (the last: to the
  end of the run, its workers stopped), i.e. also what the training flow does between two
  iterations (the iteration's artifacts, metrics.jsonl, TensorBoard, the curve), which
  ``seconds`` leaves out.

``--driver flow`` (default, ``make bench-resident``): the Prefect training flow with resident
workers as Ray actors (a local Ray), exactly as a user runs it. ``--driver inprocess``: no
Prefect and no Ray (``tests.drive`` with the workers as objects in this process, the weight sync
over a gloo pair in two threads): for machines without them, such as the GPU machines.

    .venv/bin/python benchmarks/resident.py [--iterations 4] [--every 4] [--set key=value ...] \\
        [--json docs/raw/resident.json] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

COUNTERS = ("model_loads", "engine_builds", "bytes_read", "weight_syncs", "weight_sync_seconds", "weight_sync_bytes",
            "weight_sync_wait_seconds")


def bytes_written(run_root: str, iteration: int) -> int:
    """Bytes of the files committed under ``iter=<iteration>`` (every stage folder's manifest)."""
    from schemas import read_manifest
    from schemas.storage import stage_folders

    total = 0
    for it, _, uri in stage_folders(run_root):
        if it == iteration and Path(uri, "_MANIFEST.json").exists():
            total += sum(f.bytes for f in read_manifest(uri)[0].files)
    return total


def final_weights(run_root: str, iteration: int) -> dict[str, str]:
    """The manifest checksum of each weight file of the last update's checkpoint, wherever it committed them
    (``rft_core.stages.lineage.weights_stage``: the ``ppo_update`` stage, or for a resident
    checkpoint iteration the ``ppo_update-policy`` sibling its policy worker wrote in the background).

    Raises:
        RuntimeError: the iteration's weights are on no committed stage.
    """
    from rft_core.stages.lineage import weights_stage
    from schemas import ShardRef, read_manifest, stage_uri

    stage = weights_stage(ShardRef.from_manifest(stage_uri(run_root, iteration, "ppo_update")))
    if stage is None:
        raise RuntimeError(f"{run_root}: iteration {iteration} committed no policy weights")
    m, _ = read_manifest(stage.uri)
    return {e.path: e.checksum for e in m.files if e.path.startswith("policy/") and e.path.endswith(".safetensors")}


def committed_before(run_root: str, iteration: int, stages, start: float) -> dict[str, float]:
    """Of ``stages`` (``{stage: seconds}`` of ``iteration``), those whose manifest was written
    before ``start`` (epoch seconds): work done ahead, during the previous iteration."""
    from schemas import read_manifest, stage_uri

    return {s: v for s, v in stages.items()
            if _dt.datetime.fromisoformat(read_manifest(stage_uri(run_root, iteration, s))[0].created_at).timestamp()
            < start}


def _rows(run_root: str, metrics: list[dict], cumulative: list[dict], steps: list[float] | None = None,
          walls: list[float] | None = None) -> list[dict]:
    """Per-iteration rows from the iterations' metrics, the cumulative counters after each and
    (flow driver) each iteration's ``step_seconds`` and, from its start (``walls``, epoch seconds),
    the stages done ahead of it (``ahead_seconds``)."""
    out, prev = [], {}
    for i, (m, c) in enumerate(zip(metrics, cumulative)):
        d = {k: c.get(k, 0) - prev.get(k, 0) for k in COUNTERS}
        prev = c
        out.append({"iteration": m["iteration"], "seconds": m["seconds/iteration"],
                    "bytes_written": bytes_written(run_root, m["iteration"]), "bytes_read": int(d["bytes_read"]),
                    "model_loads": int(d["model_loads"]), "engine_builds": int(d["engine_builds"]),
                    "weight_syncs": int(d["weight_syncs"]), "weight_sync_s": round(d["weight_sync_seconds"], 3),
                    "weight_sync_bytes": int(d["weight_sync_bytes"]),
                    "weight_sync_wait_s": round(d["weight_sync_wait_seconds"], 3), "reward_mean": m.get("reward_mean"),
                    "stage_seconds": {k.split("/", 1)[1]: v for k, v in m.items()
                                      if k.startswith("seconds/") and k != "seconds/iteration"}})
        ahead = committed_before(run_root, m["iteration"], out[-1]["stage_seconds"], walls[i]) if walls else {}
        out[-1]["ahead_seconds"] = ahead
        out[-1]["outside_seconds"] = round(out[-1]["seconds"] - sum(v for s, v in out[-1]["stage_seconds"].items()
                                                                    if s not in ahead), 3)
        if steps:
            out[-1]["step_seconds"] = round(steps[i], 3)
    return out


def run_flow(cfg) -> list[dict]:
    """The Prefect training flow (resident workers as Ray actors when configured), each
    iteration's start taken as the training flow calls it (``flows.train.rl_iteration``)."""
    import flows.train
    from flows.train import train

    starts, walls, iteration = [], [], flows.train.rl_iteration

    def timed(*args, **kwargs):
        starts.append(time.perf_counter())
        walls.append(time.time())
        return iteration(*args, **kwargs)

    flows.train.rl_iteration = timed
    try:
        result = train(cfg)
    finally:
        flows.train.rl_iteration = iteration
    starts.append(time.perf_counter())
    cumulative = [{k: m.get(f"run/{k}", 0) for k in COUNTERS} for m in result.metrics]
    return _rows(cfg.run_root, result.metrics, cumulative, [b - a for a, b in zip(starts, starts[1:])], walls)


def inprocess_runner(cfg):
    """The ``run`` callable of ``tests.drive`` for ``cfg``: ``run_stage``, or under
    ``orchestration.workers=resident`` the role workers as objects of this process (policy,
    rollout with the policy as its in-process peer, reference), each stage to its role's worker."""
    from rft_core.stages.runner import run_stage
    from rft_core.workers.policy import PolicyWorker
    from rft_core.workers.pool import ROLE_OF_PROGRAM
    from rft_core.workers.reference import ReferenceWorker
    from rft_core.workers.rollout import RolloutWorker

    if cfg.orchestration.workers != "resident":
        return lambda inp: run_stage(inp, cfg.runner(inp.program))
    policy = PolicyWorker(cfg.run_root)
    pool = {"policy": policy, "rollout": RolloutWorker(cfg.run_root, peer=policy, lora=cfg.update.lora),
            "reference": ReferenceWorker(cfg.run_root)}

    def run(inp):
        return pool[ROLE_OF_PROGRAM[inp.program]].run(inp) if inp.program in ROLE_OF_PROGRAM else run_stage(inp)

    return run


def run_inprocess(cfg) -> list[dict]:
    """``tests.drive`` in this process; resident workers as worker objects of their roles."""
    from rft_core.counters import COUNTS
    from tests.drive import drive

    run = inprocess_runner(cfg)
    COUNTS.clear()
    metrics, cumulative, walls = [], [], []

    def record(m: dict) -> None:
        metrics.append(m)
        cumulative.append(dict(COUNTS))
        walls.append(time.time() - m["seconds/iteration"])  # the iteration's start
        print(json.dumps({k: v for k, v in m.items() if not k.startswith("seconds/") or k == "seconds/iteration"}),
              flush=True)

    drive(cfg, run, on_iteration=record, freeze_heap=True)  # as rft train (rft_core/heap.py)
    from rft_core.stages.writer import wait_for_optimizer_writes

    wait_for_optimizer_writes()
    return _rows(cfg.run_root, metrics, cumulative, walls=walls)


def markdown(res: dict) -> str:
    """The docs/benchmarks.md section of a result."""
    lines = [f"Measured {res['date']} on {res['machine']}; {res['load']}. Command: `{res['command']}`. Model "
             f"`{res['model']}`, {res['iterations']} iterations of the demo preset{res['overrides_note']}; resident: "
             f"`checkpoint.every={res['checkpoint_every']}` (driver: {res['driver']}).", "",
             "| mode | iter | seconds | outside the stages (s) | step (s) | bytes written | bytes read | model loads | "
             "engine builds | weight sync s (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in ("stage", "resident"):
        for r in res[mode]["iterations"]:
            sync = f"{r['weight_sync_s']} ({r['weight_sync_bytes'] / 1e6:.0f})" if r["weight_syncs"] else "-"
            lines.append(f"| {mode} | {r['iteration']} | {r['seconds']} | {r.get('outside_seconds', '-')} | "
                         f"{r.get('step_seconds', '-')} | {r['bytes_written'] / 1e6:.1f} MB | "
                         f"{r['bytes_read'] / 1e6:.1f} MB | {r['model_loads']} | {r['engine_builds']} | {sync} |")
    for mode in ("stage", "resident"):
        its = res[mode]["iterations"][1:]
        if its:
            lines.append("")
            lines.append(f"- {mode}, iterations 2-{res['iterations']}: mean {sum(r['seconds'] for r in its) / len(its):.1f} s, "
                         f"{sum(r['bytes_written'] for r in its) / len(its) / 1e6:.1f} MB written and "
                         f"{sum(r['bytes_read'] for r in its) / len(its) / 1e6:.1f} MB read per iteration.")
    lines.append(f"- final weights of the two modes identical (file checksums): {'yes' if res.get('final_weights_equal') else 'no'} "
                 "(on the tiny model in CI: `tests/flows/test_resident_flow.py`).")
    syncs = [r for r in res["resident"]["iterations"] if r["weight_syncs"]]
    if syncs:
        sb, ss = sum(r["weight_sync_bytes"] for r in syncs), sum(r["weight_sync_s"] for r in syncs)
        lines.append(f"- weight sync: {len(syncs)} syncs, {ss / max(sb / 1e9, 1e-12):.2f} s per GB "
                     f"({sb / 1e6 / len(syncs):.0f} MB each, digest-verified).")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/grpo_demo.yaml"))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--every", type=int, default=4, help="checkpoint.every of the resident run")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--driver", choices=("flow", "inprocess"), default="flow")
    ap.add_argument("--modes", default="stage,resident")
    ap.add_argument("--json", default=None, help="write the result here (make bench-resident: docs/raw/resident.json)")
    ap.add_argument("--doc", default=None, help="write the section 'Resident workers' of this markdown file")
    args = ap.parse_args()

    from rft_core.config import load_config
    from rft_core.models.loading import DEFAULT_MODEL, ensure_default_model

    ensure_default_model()  # the one-time conversion is not part of any iteration
    load0 = os.getloadavg()[0]
    res: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "iterations": args.iterations,
                 "checkpoint_every": args.every, "driver": args.driver,
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.node()}"}
    for mode in args.modes.split(","):
        extra = ["orchestration.workers=resident", f"checkpoint.every={args.every}"] if mode == "resident" else []
        root = scratch_dir(f"rft-bench-{mode}-")
        cfg = load_config(args.config, [*args.overrides, *extra, f"iterations={args.iterations}", f"run_root={root}"])
        t0 = time.perf_counter()
        rows = run_flow(cfg) if args.driver == "flow" else run_inprocess(cfg)
        res[mode] = {"iterations": rows, "wall_seconds": round(time.perf_counter() - t0, 1), "run_root": root,
                     "final_weights": final_weights(root, args.iterations)}
        res["model"] = cfg.policy.path + (" (SmolLM2-135M-Instruct)" if cfg.policy.path == DEFAULT_MODEL else "")
        print(json.dumps({mode: rows}, indent=None, default=str), flush=True)
    if "stage" in res and "resident" in res:
        res["final_weights_equal"] = res["stage"]["final_weights"] == res["resident"]["final_weights"]
    res["load"] = f"load average (1 min) {load0:.2f} before, {os.getloadavg()[0]:.2f} after"
    res["command"] = ("make bench-resident" if args.driver == "flow" and not args.overrides else
                      "benchmarks/resident.py " + " ".join(f"--set {o}" for o in args.overrides)
                      + f" --driver {args.driver} --every {args.every} --iterations {args.iterations}")
    res["overrides_note"] = f" with {', '.join(args.overrides)}" if args.overrides else ""
    try:
        import torch

        res["torch"] = torch.__version__
        if torch.cuda.is_available():
            res["machine"] += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if args.doc and "stage" in res and "resident" in res:
        from gpu_smoke import write_section

        write_section(Path(args.doc), "Resident workers (`make bench-resident`)", markdown(res))
    print(markdown(res) if "stage" in res and "resident" in res else "")


if __name__ == "__main__":
    main()
