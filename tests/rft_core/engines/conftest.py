"""Shared fixtures of the engine tests: the tiny model and tokenizer, and an empty process-wide
engine cache around every test (the GPU engines are cached per process)."""
from __future__ import annotations

import pytest

from rft_core.engines import release_engine
from rft_core.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def parts(tiny_model):
    """(model, tokenizer) of the tiny test model."""
    return load_causal_lm(tiny_model), load_tokenizer(tiny_model)


@pytest.fixture(autouse=True)
def _empty_engine_cache():
    release_engine()
    yield
    release_engine()
