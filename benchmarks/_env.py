"""Shared setup of the benchmark scripts (imported first, as ``from _env import ROOT``): the
repository on ``sys.path`` and a quiet, offline environment (no telemetry, no hub downloads, no
tokenizer thread pools)."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for _key, _value in {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false",
                     "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)


def scratch_dir(prefix: str, dir: str | None = None) -> str:
    """Make a temporary folder for one benchmark run (``tempfile.mkdtemp``) and remove it when the
    script exits, so that repeated benchmarks do not fill the disk (a 4-iteration demo run leaves
    1.6-2.6 GB of shards and checkpoints). ``RFT_BENCH_KEEP=1`` keeps it for inspection.

    Args:
        prefix: the folder name's prefix (``rft-bench-stage-``).
        dir: where to make it; None for the system's temporary folder.

    Returns:
        The folder's absolute path (str).
    """
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    if os.environ.get("RFT_BENCH_KEEP") != "1":
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
