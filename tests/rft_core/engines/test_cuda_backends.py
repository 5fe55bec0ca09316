"""GPU readiness of model loading (``rft_core.models.hub``): a flash-attn that is installed but
broken falls back to sdpa with a warning instead of failing every model load, a working one is
chosen on a GPU in 16 bits, and ``configure_cuda_backends`` enables TF32 on CUDA only."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

import pytest
import torch

from rft_core.models import hub
from rft_core.models.hub import attn_implementation, configure_cuda_backends, flash_attn_usable


class _FakeFlashAttn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A ``flash_attn`` package found by the import system; importing it raises ``error`` (what a
    wheel built for another torch does when it loads its CUDA extension) or succeeds."""

    def __init__(self, error: Exception | None):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if self.error is not None:
            raise self.error


@pytest.fixture
def on_gpu(monkeypatch):
    """A GPU that transformers would accept flash-attn on (flash_attn_usable probed afresh)."""
    import transformers.utils

    monkeypatch.delenv("RFT_ATTN_IMPLEMENTATION", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    flash_attn_usable.cache_clear()
    yield monkeypatch
    flash_attn_usable.cache_clear()
    sys.modules.pop("flash_attn", None)


def test_broken_flash_attn_falls_back_to_sdpa_with_a_warning(on_gpu, caplog):
    error = ImportError("flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDevice")
    on_gpu.setattr(sys, "meta_path", [_FakeFlashAttn(error)] + sys.meta_path)
    with caplog.at_level(logging.WARNING, logger="rft_core.models.loading"):
        assert attn_implementation("bfloat16") == "sdpa"
    assert "flash-attn is installed but does not import (ImportError: flash_attn_2_cuda" in caplog.text
    assert "undefined symbol" in caplog.text
    # probed once per process: a second load neither retries nor warns again
    caplog.clear()
    assert attn_implementation("float16") == "sdpa" and caplog.text == ""


def test_working_flash_attn_is_used_on_a_gpu_in_16_bits_only(on_gpu):
    on_gpu.setattr(sys, "meta_path", [_FakeFlashAttn(None)] + sys.meta_path)
    assert attn_implementation("bfloat16") == "flash_attention_2"
    assert attn_implementation("float32") == "sdpa"  # flash-attn has no float32 kernels
    on_gpu.setenv("RFT_ATTN_IMPLEMENTATION", "eager")
    assert attn_implementation("bfloat16") == "eager"


def test_flash_attn_rejected_by_transformers_is_not_imported(on_gpu, caplog):
    import transformers.utils

    finder = _FakeFlashAttn(AssertionError("must not be imported"))
    on_gpu.setattr(sys, "meta_path", [finder] + sys.meta_path)
    on_gpu.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="rft_core.models.loading"):
        assert attn_implementation("bfloat16") == "sdpa"
    assert "transformers cannot use it" in caplog.text


def test_configure_cuda_backends_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    assert configure_cuda_backends() is False
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_configure_cuda_backends_enables_tf32_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: calls.append(p))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert hub.configure_cuda_backends() is True
    assert calls == ["high"] and torch.backends.cudnn.allow_tf32 is True
