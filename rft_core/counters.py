"""Event counters of this process: what the stage programs read from storage and what the
resident workers did (a leaf module: the loaders import it, it imports nothing of the project)."""
from __future__ import annotations

import collections
import os
from pathlib import Path

COUNTS: collections.Counter = collections.Counter()  # event -> count (or seconds, bytes)


def count(event: str, n: float = 1) -> None:
    """Add ``n`` to this process's counter ``event`` (read with ``counts``)."""
    COUNTS[event] += n


def count_bytes_read(path: "str | os.PathLike") -> None:
    """Count the bytes of a checkpoint read from storage (``bytes_read``): a file, or the weight
    files (``*.safetensors``, ``*.bin``) of a model folder. A hub id (no local folder) counts 0."""
    p = Path(path)
    if p.is_file():
        COUNTS["bytes_read"] += p.stat().st_size
    elif p.is_dir():
        COUNTS["bytes_read"] += sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))


def counts() -> dict[str, float]:
    """This process's event counters: ``model_loads`` (models read from storage), ``bytes_read``
    (their weight files and optimizer states), ``engine_builds`` (rollout engines built over a
    model read for them), in a resident worker ``weight_syncs``, ``weight_sync_seconds`` and
    ``weight_sync_bytes`` (``rft_core.workers.rollout``), and where a policy kept in memory was
    rebuilt (a resident policy worker, stage mode keeping its models) ``recovered_updates`` (the
    committed updates re-applied) and ``inexact_rebuilds`` (those whose GPU re-run differed from
    the recorded digest: ``rft_core.stages.recovery.check_digest``)."""
    return dict(COUNTS)
