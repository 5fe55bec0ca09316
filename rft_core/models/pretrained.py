"""Model paths and the loading primitives every model kind uses: resolve a configured path
(the default alias, the tiny VL alias, a local folder or a hub id), load a tokenizer, load any
transformers Auto class under the process-wide load lock."""
from __future__ import annotations

from pathlib import Path

from rft_core.models.hub import (
    DEFAULT_MODEL,
    LOAD_LOCK,
    ModelLoadError,
    ensure_default_model,
    prepare_tokenizer,
    quiet_transformers,
    set_trainable,
    torch_dtype,
)
from rft_core.models.tiny_vl import TINY_VL_MODEL, ensure_tiny_vl_model


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

    with LOAD_LOCK:
        resolved = resolve_model_path(path)
        try:
            tok = AutoTokenizer.from_pretrained(resolved)
        except Exception as exc:
            raise ModelLoadError(f"cannot load tokenizer from {path!r} ({resolved}): {exc}") from exc
    return prepare_tokenizer(tok)


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

    quiet_transformers()
    with LOAD_LOCK:
        resolved = resolve_model_path(path)
        try:
            kwargs = {}
            if adjust_config is not None:
                kwargs["config"] = adjust_config(AutoConfig.from_pretrained(resolved))
            model = auto_cls.from_pretrained(resolved, dtype=torch_dtype(dtype), **kwargs, **(model_kwargs or {}))
        except Exception as exc:
            raise ModelLoadError(f"cannot load {what} from {path!r} ({resolved}): {exc}") from exc
    return set_trainable(model, trainable)
