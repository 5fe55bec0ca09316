"""Deterministic, Hive-style run layout under any fsspec URI.

{run_root}/iter=000012/{stage}/part-00000.parquet + {stage}/_MANIFEST.json
"""
from __future__ import annotations

import re

_STAGE_URI = re.compile(r"^(?P<root>.+)/iter=(?P<it>\d{6})/(?P<stage>[^/]+)/?$")
_STAGE_SPEC = re.compile(r"^iter=(?P<it>\d+)/(?P<stage>[^/]+)$")


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


def split_stage_uri(uri: str) -> tuple[str, int, str] | None:
    """(run root, iteration, stage) of a stage folder of the run layout, or None when ``uri``
    is not one (an eval folder, a bare shard folder)."""
    m = _STAGE_URI.match(uri)
    return (m.group("root"), int(m.group("it")), m.group("stage")) if m else None


def stage_spec(iteration: int, stage: str) -> str:
    """The short name of a stage of a run, as commands take it: ``iter=1/ppo_update``."""
    return f"iter={iteration}/{stage}"


def parse_stage_spec(spec: str) -> tuple[int, str]:
    """(iteration, stage) of ``iter=N/<stage>`` (N with or without leading zeros).

    Raises:
        ValueError: ``spec`` has another form (the message shows the expected one).
    """
    m = _STAGE_SPEC.match(spec.strip().strip("/"))
    if not m:
        raise ValueError(f"bad stage {spec!r}: expected iter=N/<stage>, e.g. iter=1/ppo_update")
    return int(m.group("it")), m.group("stage")

