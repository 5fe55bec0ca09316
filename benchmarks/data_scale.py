"""Benchmark: a 1,000,000-row prompt file, from opening it to the first iteration's prompts stage.

Writes a verl-style Parquet file (``data_source``, ``prompt`` as system + user messages,
``ability``, ``reward_model.ground_truth``, ``extra_info``) into a temp folder, then, in a fresh
child process per row-group layout, measures:

  open_s      ``open_data(path)``: footer, columns and types checked
  first_s     open + ``iteration_indices(1)`` + ``entries`` + ``build_prompts`` (chat template,
              tokenized): the seconds from opening the file to the first iteration's prompts
  later_s     the same for iteration 100000 on the already opened dataset
  peak_rss_mb the child's peak RSS (``resource.getrusage``), and ``data_rss_mb``, its growth
              over the peak after imports and loading the tokenizer

and then, in another fresh child, the real prompts stage program (``rft_core.stages.prompts.run``
with ``data.source: files``, as the iteration flow calls it):

  fingerprint_s     ``dataset_fingerprint(data)``: what the flow computes for the stage's hash
  stage_first_s     the first iteration's prompts stage committed into an empty run folder
                    (tokenizer load, open, row selection, per-row checks, rendering, Parquet commit)
  stage_resume_s    the same call again: the committed stage found and reused
  stage_peak_rss_mb the child's peak RSS

and prints one JSON object (with ``uptime``'s load averages).

    .venv/bin/python benchmarks/data_scale.py [--rows 1000000] [--row-group-sizes 100000,1000000]
        [--per-iteration 8] [--tokenizer smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from _env import ROOT  # noqa: E402,F401  (repository on sys.path, offline environment)

SYSTEM = "You are a helpful assistant. Solve the problem. Give the final answer on the last line as: Answer: <answer>"


def write_file(path: str, rows: int, row_group_size: int, seed: int = 0) -> float:
    """Write ``rows`` arithmetic rows in verl's layout, ``row_group_size`` rows per row group
    (built columnar, one row group at a time); returns the seconds taken."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = time.perf_counter()
    rng = np.random.default_rng(seed)
    writer = None
    for start in range(0, rows, row_group_size):
        n = min(row_group_size, rows - start)
        a, b = rng.integers(1, 1000, n), rng.integers(1, 1000, n)
        questions = pa.array([f"What is {x} + {y}?" for x, y in zip(a.tolist(), b.tolist())])
        contents = pa.concat_arrays([pa.array([SYSTEM] * n), questions])
        order = np.arange(2 * n).reshape(2, n).T.ravel()  # system_0, user_0, system_1, user_1, ...
        roles = pa.array(["system", "user"] * n)
        messages = pa.StructArray.from_arrays([roles, contents.take(pa.array(order))], names=["role", "content"])
        table = pa.table({
            "data_source": pa.array(["arithmetic"] * n),
            "prompt": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)), messages),
            "ability": pa.array(["math"] * n),
            "reward_model": pa.StructArray.from_arrays([pa.array(["rule"] * n), pa.array([str(x) for x in (a + b).tolist()])],
                                                       names=["style", "ground_truth"]),
            "extra_info": pa.StructArray.from_arrays([pa.array(np.arange(start, start + n))], names=["index"]),
        })
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=row_group_size)
    writer.close()
    return time.perf_counter() - t


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(path: str, per_iteration: int, tokenizer: str) -> dict:
    """Run in the child: the timings and memory of the module docstring."""
    from rft_core.data.mixture import open_data
    from rft_core.data.prompts import build_prompts
    from rft_core.models.loading import load_tokenizer

    t = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - t
    base_mb = _peak_mb()
    t0 = time.perf_counter()
    ds = open_data(path)
    open_s = time.perf_counter() - t0
    idx = ds.iteration_indices(1, per_iteration=per_iteration, seed=1234)
    batch = build_prompts(ds.entries(idx), tok, data_source=ds.name, system_prompt="", max_prompt_tokens=512)
    first_s = time.perf_counter() - t0
    assert batch.table.num_rows == per_iteration
    t1 = time.perf_counter()
    idx = ds.iteration_indices(100_000, per_iteration=per_iteration, seed=1234)
    build_prompts(ds.entries(idx), tok, data_source=ds.name, system_prompt="", max_prompt_tokens=512)
    later_s = time.perf_counter() - t1
    return {"rows": len(ds), "row_groups": ds.parts[0]._meta.num_row_groups, "tokenizer_load_s": round(tokenizer_s, 3),
            "open_s": round(open_s, 3), "first_s": round(first_s, 3), "later_s": round(later_s, 3),
            "rss_after_tokenizer_mb": round(base_mb, 1), "peak_rss_mb": round(_peak_mb(), 1),
            "data_rss_mb": round(_peak_mb() - base_mb, 1), "first_prompt": batch.table.column("prompt_text")[0].as_py()}


def measure_stage(path: str, per_iteration: int, tokenizer: str) -> dict:
    """Run in the child: the prompts stage program on ``path`` (see the module docstring)."""
    from rft_core.config import DataConfig
    from rft_core.data.mixture import dataset_fingerprint
    from rft_core.stages import prompts as prompts_stage
    from rft_core.stages.contracts import PromptsInput
    from schemas import read_manifest, stage_uri

    data = DataConfig(source="files", path=path, prompts_per_iteration=per_iteration, system_prompt="",
                      max_prompt_tokens=512)
    base_mb = _peak_mb()
    with tempfile.TemporaryDirectory(prefix="rft-data-stage-") as run_root:
        t0 = time.perf_counter()
        fingerprint = dataset_fingerprint(data)
        fingerprint_s = time.perf_counter() - t0
        inp = PromptsInput(data=data, tokenizer_path=tokenizer, iteration=1, out=stage_uri(run_root, 1, "prompts"),
                           data_fingerprint=fingerprint)
        ref = prompts_stage.run(inp)
        first_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        again = prompts_stage.run(inp.model_copy(update={"data_fingerprint": dataset_fingerprint(data)}))
        resume_s = time.perf_counter() - t1
        assert again == ref and ref.num_rows == per_iteration
        summary = read_manifest(ref.uri)[0].summary
    return {"fingerprint_s": round(fingerprint_s, 4), "stage_first_s": round(first_s, 3),
            "stage_resume_s": round(resume_s, 3), "stage_program_seconds": round(summary["seconds"], 3),
            "stage_rss_after_imports_mb": round(base_mb, 1), "stage_peak_rss_mb": round(_peak_mb(), 1),
            "stage_first_row": summary["rows"][0]}


def _child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--row-group-sizes", default="100000,1000000")
    ap.add_argument("--per-iteration", type=int, default=8)
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: the file to measure
    ap.add_argument("--write", help=argparse.SUPPRESS)  # child mode: the file to write
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # child mode: the prompts stage program on this file
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.per_iteration, args.tokenizer)))
        return
    if args.stage:
        print(json.dumps(measure_stage(args.stage, args.per_iteration, args.tokenizer)))
        return
    if args.write:
        print(json.dumps({"write_s": round(write_file(args.write, args.rows, int(args.row_group_sizes)), 1)}))
        return
    # Both steps run in children of this small process: Linux carries a process's peak RSS
    # across fork + exec, so a parent that had built the file would inflate the child's number.
    out = {"rows": args.rows, "per_iteration": args.per_iteration, "tokenizer": args.tokenizer, "runs": []}
    with tempfile.TemporaryDirectory(prefix="rft-data-scale-") as tmp:
        for rg in [int(x) for x in args.row_group_sizes.split(",")]:
            path = os.path.join(tmp, f"prompts-rg{rg}.parquet")
            wrote = _child("--write", path, "--rows", str(args.rows), "--row-group-sizes", str(rg))
            run = _child("--measure", path, "--per-iteration", str(args.per_iteration), "--tokenizer", args.tokenizer)
            run.update(_child("--stage", path, "--per-iteration", str(args.per_iteration), "--tokenizer", args.tokenizer))
            run.update(row_group_size=rg, file_mb=round(os.path.getsize(path) / 2**20, 1), **wrote)
            out["runs"].append(run)
            os.remove(path)
    out["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
