"""Load policy / reference models and tokenizers: the entry point of every stage.

``load_causal_lm`` picks the model kind of a path (a LoRA adapter folder, a vision-language
folder, a plain causal LM); the pieces below it live in ``rft_core.models.hub`` (cache, the
embedded default, the load lock, dtypes) and ``rft_core.models.pretrained`` (path resolution,
tokenizer, ``from_pretrained`` under the lock), re-exported here as the public surface.
"""
from __future__ import annotations

from rft_core.models.hub import (
    DEFAULT_MODEL,
    LOAD_LOCK,
    ModelLoadError,
    attn_implementation,
    cache_dir,
    default_gguf_path,
    ensure_default_model,
    set_trainable,
    torch_dtype,
)
from rft_core.models.lora import is_adapter_dir, keeps_adapters, load_adapter_policy
from rft_core.models.pretrained import (
    count_model_load,
    leased_tokenizer,
    load_pretrained,
    load_tokenizer,
    pad_token_id,
    resolve_model_path,
)
from rft_core.models.vl import is_vl_model, load_vl_model

__all__ = ["DEFAULT_MODEL", "LOAD_LOCK", "ModelLoadError", "attn_implementation", "cache_dir", "default_gguf_path",
           "ensure_default_model", "leased_tokenizer", "load_causal_lm", "load_pretrained", "load_tokenizer",
           "pad_token_id", "resolve_model_path",
           "set_trainable", "torch_dtype"]


def load_causal_lm(path: str, *, dtype: str = "float32", trainable: bool = False, merge_adapter: bool | None = None):
    """Load a causal LM (policy or reference) on CPU: a LoRA checkpoint as its base model with
    the adapter (merged in float32; below float32 the float32 adapters kept on top of the
    bfloat16 base, computing as the trainer does: ``rft_core.models.lora.keeps_adapters``), a
    Qwen2-VL / Qwen2.5-VL folder with the image-text-to-text class, anything else with
    ``AutoModelForCausalLM``.

    Args:
        path: see ``resolve_model_path``.
        dtype: "float32" or "bfloat16".
        trainable: False puts the model in eval mode with gradients off.
        merge_adapter: a LoRA checkpoint merged (True: always, e.g. a copy that receives the
            trainer's merged weights, ``rft_core.weightsync.trained.inference_tensors``; False:
            never, e.g. a copy that receives the trainer's adapters); None: as
            ``keeps_adapters(dtype)`` says (in float32 only).
    Counts a model load and the bytes of its weight files (``rft_core.counters.counts``).
    Raises:
        ModelLoadError: unreadable path or weights, named in the message.
    """
    from transformers import AutoModelForCausalLM

    count_model_load(path)
    if is_adapter_dir(path):
        merge = not keeps_adapters(dtype) if merge_adapter is None else merge_adapter
        return load_adapter_policy(path, dtype=dtype, trainable=trainable, merge=merge)
    if is_vl_model(path):
        return load_vl_model(path, dtype=dtype, trainable=trainable)
    return load_pretrained(AutoModelForCausalLM, path, dtype=dtype, trainable=trainable,
                           model_kwargs={"attn_implementation": attn_implementation(dtype)})
