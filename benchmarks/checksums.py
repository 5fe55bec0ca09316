"""What a checkpoint's file checksums cost: the manifest's hashing of a checkpoint's files when a
stage commits them (``schemas.shards.commit_files``, on the background writer's path for the
policy's AdamW state and weights) and when a stage that loads them checks them
(``schemas.verify_files``, on the critical path of a stage-mode step that loads a model another
process wrote), by algorithm: XXH3-128 (manifest version 2 on) against sha256 (before).

The files are random bytes in the sizes of a checkpoint (default: the 0.4B shape of
``make bench-gpu`` on a GPU, bfloat16 weights 0.8 GB, float32 masters and AdamW moments 4.8 GB),
freshly written, as the writer hashes them (in the page cache). Each algorithm hashes them as
``_file_entries`` does (a pool of up to 4 threads); then ``commit_files`` and a ``verify_files``
with this process's memory of them forgotten run end to end.

    python benchmarks/checksums.py [--gb-weights 0.8] [--gb-optimizer 4.8] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _env import ROOT  # noqa: F401  (repository on sys.path, offline environment)


def _write(path: Path, gb: float) -> None:
    chunk = os.urandom(64 << 20)
    left = int(gb * 1e9)
    with open(path, "wb") as f:
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)


def main() -> None:
    import fsspec

    import schemas.storage as storage
    from schemas import commit_files, verify_files

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb-weights", type=float, default=0.8)
    ap.add_argument("--gb-optimizer", type=float, default=4.8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="folder for the files (default: system temp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    fs = fsspec.filesystem("file")
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "gb_weights": args.gb_weights,
           "gb_optimizer": args.gb_optimizer, "load_before": os.getloadavg()[0], "seconds": {}}
    with tempfile.TemporaryDirectory(prefix="rft-checksums-", dir=args.tmp) as tmp:
        stage = Path(tmp, "ppo_update")
        (stage / "policy").mkdir(parents=True)
        files = {"policy/model.safetensors": args.gb_weights, "optimizer.pt": args.gb_optimizer}
        for rel, gb in files.items():
            _write(stage / rel, gb)
        paths = [str(stage / rel) for rel in files]
        for algorithm in ("sha256", "xxh3_128"):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:
                    list(pool.map(lambda p: storage.file_checksum(fs, p, algorithm), paths))
                times.append(time.perf_counter() - t0)
            out["seconds"][f"hash_{algorithm}"] = times
        t0 = time.perf_counter()
        commit_files(str(stage), stage="ppo_update", config_hash="bench", files=list(files))
        out["seconds"]["commit_files"] = [time.perf_counter() - t0]
        storage._VERIFIED.clear()  # as a process that did not write them
        t0 = time.perf_counter()
        verify_files(str(stage))
        out["seconds"]["verify_files"] = [time.perf_counter() - t0]
    out["load_after"] = os.getloadavg()[0]
    gb = args.gb_weights + args.gb_optimizer
    for name, s in out["seconds"].items():
        print(f"{name:16s} {' '.join(f'{x:.2f}' for x in s)} s  ({gb / min(s):.1f} GB/s at best)")
    print(f"{gb:.1f} GB, {out['machine']}, load {out['load_before']:.2f} before, {out['load_after']:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
