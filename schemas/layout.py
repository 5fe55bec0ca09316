"""Deterministic, Hive-style run layout under any fsspec URI.

{run_root}/iter=000012/{stage}/part-00000.parquet + {stage}/_MANIFEST.json
"""
from __future__ import annotations


def iteration_uri(run_root: str, iteration: int) -> str:
    """URI of one iteration's folder, e.g. ``file:///runs/x/iter=000003``."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"{run_root.rstrip('/')}/iter={iteration:06d}"


def stage_uri(run_root: str, iteration: int, stage: str) -> str:
    """URI of one stage's folder inside an iteration."""
    if not stage or "/" in stage:
        raise ValueError(f"bad stage name {stage!r}")
    return f"{iteration_uri(run_root, iteration)}/{stage}"
