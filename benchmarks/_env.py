"""Shared setup of the benchmark scripts (imported first, as ``from _env import ROOT``): the
repository on ``sys.path`` and a quiet, offline environment (no telemetry, no hub downloads, no
tokenizer thread pools)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for _key, _value in {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false",
                     "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_key, _value)
