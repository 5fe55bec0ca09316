"""Benchmark: validating every row of a 1,000,000-row dataset before a run (issue 30 item 1).

Writes the same 1,000,000 rows in verl's layout (``data_source``, ``prompt`` as system + user
chat messages, ``reward_model.ground_truth``, ``extra_info``) as a JSON Lines file (with a
blank line after every 100,000th row, so the row -> line map is exercised) and as a Parquet
file (row groups of 100,000), into a temp folder. Then, per file, in a fresh child process:

  first_run_s    ``validate_run_data(cfg)`` as the train flow calls it into an empty run root:
                 fingerprint, open, every row checked, the marker written
  cached_run_s   the same call again (a resume): the marker found, no row read
  peak_rss_mb    the child's peak RSS over those two calls (Linux VmHWM, reset before them via
                 ``/proc/self/clear_refs``), and ``data_rss_mb``, its growth over the RSS before
                 them (after the imports and a warm-up validation of a 10-row copy, as in a flow
                 process)
  arrow_peak_mb  the peak of Arrow's memory pool
  open_s         then the two steps apart: ``open_data_config`` (files resolved, read (JSON
                 Lines: parsed into one Arrow table; Parquet: the footer), columns and types checked)
  check_s        and ``validate_dataset`` on the opened dataset: every row, column-wise

and, with ``--with-scan``, the per-row Python pass the project had before (``row_scan``: every
row through the prompts stage's own row check, ``FileDataset._entry``; kept here only, for this
comparison), in another child. Prints one JSON object (with ``uptime``'s load averages) and,
with ``--json FILE``, writes it there.

    .venv/bin/python benchmarks/validate_data.py [--rows 1000000] [--with-scan] [--json docs/raw/validate.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

from _env import ROOT  # noqa: E402,F401  (repository on sys.path, offline environment)

SYSTEM = "Solve the problem. Give the final answer on the last line as: Answer: <answer>"
BLANK_EVERY = 100_000


def write_files(folder: str, rows: int, row_group_size: int = 100_000, seed: int = 0) -> dict:
    """The JSON Lines and Parquet files of the module docstring; returns their paths, sizes and
    the seconds taken."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = time.perf_counter()
    rng = np.random.default_rng(seed)
    a, b = rng.integers(1, 1000, rows), rng.integers(1, 1000, rows)
    questions = [f"What is {x} + {y}?" for x, y in zip(a.tolist(), b.tolist())]
    answers = [str(s) for s in (a + b).tolist()]
    jsonl = os.path.join(folder, "train.jsonl")
    with open(jsonl, "w") as f:
        for start in range(0, rows, BLANK_EVERY):
            f.write("".join(json.dumps({"data_source": "arithmetic",
                                        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                        "reward_model": {"style": "rule", "ground_truth": s},
                                        "extra_info": {"index": start + i}}) + "\n"
                            for i, (q, s) in enumerate(zip(questions[start:start + BLANK_EVERY],
                                                           answers[start:start + BLANK_EVERY]))))
            f.write("\n")  # a blank line: rows after it are one line further down
    parquet = os.path.join(folder, "train.parquet")
    messages = pa.StructArray.from_arrays(
        [pa.array(["system", "user"] * rows),
         pa.array([m for q in questions for m in (SYSTEM, q)])], names=["role", "content"])
    table = pa.table({
        "data_source": pa.array(["arithmetic"] * rows),
        "prompt": pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * rows + 1, 2, dtype=np.int32)), messages),
        "reward_model": pa.StructArray.from_arrays([pa.array(["rule"] * rows), pa.array(answers)],
                                                   names=["style", "ground_truth"]),
        "extra_info": pa.StructArray.from_arrays([pa.array(np.arange(rows))], names=["index"]),
    })
    pq.write_table(table, parquet, row_group_size=row_group_size)
    return {"write_s": round(time.perf_counter() - t, 2), "jsonl_mb": round(os.path.getsize(jsonl) / 2**20, 1),
            "parquet_mb": round(os.path.getsize(parquet) / 2**20, 1), "paths": {"jsonl": jsonl, "parquet": parquet}}


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024  # kB


def _reset_peak() -> float:
    """Start a new peak-RSS window (Linux: ``5`` into ``/proc/self/clear_refs`` resets VmHWM);
    returns the RSS now (MiB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mb("VmRSS")
    except OSError:  # not Linux: the process's peak so far (getrusage) is the window's start
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_mb() -> float:
    """The peak RSS (MiB) since ``_reset_peak``."""
    try:
        return _status_mb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _small_copy(path: str, folder: str) -> str:
    """The first 10 rows of ``path`` in a file of the same format under ``folder``."""
    small = os.path.join(folder, "small" + (".jsonl" if path.endswith(".jsonl") else ".parquet"))
    if path.endswith(".jsonl"):
        with open(path) as f, open(small, "w") as g:
            g.writelines(next(f) for _ in range(10))
    else:
        import pyarrow.parquet as pq

        pq.write_table(pq.ParquetFile(path).read_row_group(0).slice(0, 10), small)
    return small


def measure(path: str) -> dict:
    """Run in the child: the timings and memory of the module docstring."""
    import gc

    import pyarrow as pa

    from rft_core.config import load_config
    from rft_core.data.mixture import open_data_config
    from rft_core.data.validate import Needs, validate_dataset, validate_run_data

    with tempfile.TemporaryDirectory(prefix="rft-validate-run-") as tmp:
        # warm-up on a 10-row copy in the same format: imports and Arrow kernels, as in a flow process
        small = _small_copy(path, tmp)
        validate_run_data(load_config(None, {"run_root": f"{tmp}/warm", "data.source": "files", "data.path": small}))
        gc.collect()
        base_mb, base_arrow = _reset_peak(), pa.default_memory_pool().max_memory()
        cfg = load_config(None, {"run_root": f"{tmp}/run", "data.source": "files", "data.path": path})
        t = time.perf_counter()
        first = validate_run_data(cfg)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        cached = validate_run_data(cfg)
        cached_s = time.perf_counter() - t
        assert first.ok and not first.cached and cached.cached
        peak_mb, arrow_mb = _peak_mb(), pa.default_memory_pool().max_memory()
        gc.collect()
        t = time.perf_counter()
        ds = open_data_config(cfg.data)
        open_s = time.perf_counter() - t
        t = time.perf_counter()
        report = validate_dataset(ds, Needs.of(cfg.reward))
        check_s = time.perf_counter() - t
        assert report.ok and report.rows == len(ds) == first.rows, report.message()
    return {"rows": first.rows, "first_run_s": round(first_s, 3), "cached_run_s": round(cached_s, 4),
            "open_s": round(open_s, 3), "check_s": round(check_s, 3), "rss_before_mb": round(base_mb, 1),
            "peak_rss_mb": round(peak_mb, 1), "data_rss_mb": round(peak_mb - base_mb, 1),
            "arrow_peak_mb": round(max(arrow_mb, base_arrow) / 2**20, 1)}


def row_scan(ds) -> tuple[int, int]:
    """(rows, bad rows) of a ``FileDataset``: every row, batch by batch (``Part.batches``), through
    the prompts stage's own Python row check (``FileDataset._entry``); an unreadable Parquet row
    group counts as one bad row. The per-row pass ``rft data check`` used before it ran the
    column checks (``rft_core.data.validate``); only this comparison uses it now."""
    from rft_core.data.prompts import DatasetError

    rows = bad = 0
    for k, part in enumerate(ds.parts):
        try:
            for start, batch in part.batches():
                for j, values in enumerate(batch):
                    rows += 1
                    try:
                        ds._entry(k, start + j, values)
                    except DatasetError:
                        bad += 1
        except DatasetError:  # an unreadable Parquet row group: the rest of the file is skipped
            bad += 1
    return rows, bad


def measure_scan(path: str) -> dict:
    """Run in the child: the per-row Python check over every row (``row_scan``)."""
    from rft_core.data.mixture import open_data

    with tempfile.TemporaryDirectory(prefix="rft-validate-scan-") as tmp:
        row_scan(open_data(_small_copy(path, tmp)))  # warm-up, as in measure
    base_mb = _reset_peak()
    t = time.perf_counter()
    ds = open_data(path)
    open_s = time.perf_counter() - t
    t = time.perf_counter()
    rows, bad = row_scan(ds)
    scan_s = time.perf_counter() - t
    assert bad == 0 and rows == len(ds)
    return {"rows": rows, "open_s": round(open_s, 3), "scan_s": round(scan_s, 3),
            "peak_rss_mb": round(_peak_mb(), 1), "data_rss_mb": round(_peak_mb() - base_mb, 1)}


def _child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"child {args} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--with-scan", action="store_true", help="also time the per-row Python scan (row_scan)")
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, path = args.child
        print(json.dumps(measure(path) if mode == "validate" else measure_scan(path)))
        return
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
           "python": platform.python_version(), "rows": args.rows, "load_before": _load()}
    import pyarrow

    out["pyarrow"] = pyarrow.__version__
    with tempfile.TemporaryDirectory(prefix="rft-validate-") as folder:
        files = write_files(folder, args.rows)
        out.update({k: v for k, v in files.items() if k != "paths"})
        for fmt, path in files["paths"].items():
            out[fmt] = _child("--child", "validate", path)
            if args.with_scan:
                out[f"{fmt}_scan"] = _child("--child", "scan", path)
    out["load_after"] = _load()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
