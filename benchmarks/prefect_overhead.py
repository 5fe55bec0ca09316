"""Benchmark: what Prefect itself costs an iteration subflow, with no model and no storage.

A training flow runs N iteration subflows; each submits 3 concurrent task runs and 4 sequential
ones (the stages' shape), sleeps ``--body`` seconds (the stage programs' compute) and creates 2
artifacts (the iteration's metrics table and samples), as ``flows/iteration.py`` does. Against a
temporary Prefect server (``prefect_test_harness``, SQLite, as ``make demo``), it reports per
iteration and setting the median seconds of:

- ``enter``: from the subflow's call to its body's first line (the flow run created, Running);
- ``tasks``: the 7 task runs (their orchestration only: each returns at once);
- ``artifacts``: the two artifacts;
- ``exit``: from the body's return to the call's return (state Completed, the engine's teardown);
- ``overhead``: the call's wall seconds less ``--body``.

Settings: ``prefect default`` (the iteration sends flow-run heartbeats, every 180 s) and
``as rft train runs it`` (``flows.train.without_heartbeats``).

    .venv/bin/python benchmarks/prefect_overhead.py [--iterations 8] [--body 2.0]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time

from _env import ROOT  # noqa: F401,E402  (repository on sys.path, offline environment)

PARTS = ("enter", "tasks", "artifacts", "exit", "overhead")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--body", type=float, default=2.0, help="seconds each iteration's body sleeps (its compute)")
    args = ap.parse_args()

    from prefect import flow, task
    from prefect.artifacts import create_table_artifact
    from prefect.testing.utilities import prefect_test_harness

    from flows.train import without_heartbeats

    marks: dict[str, float] = {}

    @task
    def stage(x: int) -> int:
        return x + 1

    @flow(name="rl-iteration")
    def iteration(i: int) -> None:
        marks["in"] = time.perf_counter()
        futures = [stage.submit(i) for _ in range(3)]  # rewards, actor and reference log-probs
        x = 0
        for _ in range(4):  # prompts, rollout, advantages, update
            x = stage(x)
        [f.result() for f in futures]
        marks["tasks"] = time.perf_counter()
        time.sleep(args.body)
        marks["body"] = time.perf_counter()
        create_table_artifact(key=f"metrics-iter-{i:06d}", table=[{"iteration": i}])
        create_table_artifact(key=f"samples-iter-{i:06d}", table=[{"iteration": i}])
        marks["artifacts"] = time.perf_counter()

    @flow(name="rft-train")
    def train(settings) -> list[dict[str, float]]:
        rows = []
        with settings():  # as flows/train.py: once around the iterations
            for i in range(1, args.iterations + 1):
                t0 = time.perf_counter()
                iteration(i)
                t1 = time.perf_counter()
                rows.append({"enter": marks["in"] - t0, "tasks": marks["tasks"] - marks["in"],
                             "artifacts": marks["artifacts"] - marks["body"], "exit": t1 - marks["artifacts"],
                             "overhead": t1 - t0 - args.body})
        return rows

    load0 = os.getloadavg()[0]
    results = {}
    with prefect_test_harness(server_startup_timeout=180):
        for name, settings in (("prefect default", contextlib.nullcontext), ("as rft train runs it", without_heartbeats)):
            rows = train(settings)[1:]  # the first iteration warms the server's caches
            results[name] = {p: statistics.median(r[p] for r in rows) for p in PARTS}
    print(f"\nMeasured {time.strftime('%Y-%m-%dT%H:%M:%S')} on {platform.machine()}, {os.cpu_count()} CPU cores; "
          f"load average (1 min) {load0:.2f} before, {os.getloadavg()[0]:.2f} after; {args.iterations} iterations "
          f"of {args.body} s (median of iterations 2-{args.iterations}).\n")
    print("| iteration subflow | " + " | ".join(f"{p} (s)" for p in PARTS) + " |")
    print("|---" * (len(PARTS) + 1) + "|")
    for name, med in results.items():
        print(f"| {name} | " + " | ".join(f"{med[p]:.3f}" for p in PARTS) + " |")


if __name__ == "__main__":
    main()
