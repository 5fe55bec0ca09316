"""Test setup: a private Prefect home and one session-scoped Prefect test harness."""
from __future__ import annotations

import os
import tempfile

_home = tempfile.mkdtemp(prefix="rft-prefect-home-")
os.environ.setdefault("PREFECT_HOME", _home)
os.environ["PREFECT_HOME"] = _home
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402

from tests.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (startup is slow)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Folder of a tiny random Llama (2 layers, width 32) with the SmolLM2 tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
