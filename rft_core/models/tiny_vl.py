"""The offline vision-language default ``tiny-qwen2-vl``: a 2-layer, 32-wide Qwen2-VL with a
1-block vision tower and random (seeded) weights, with the SmolLM2 tokenizer plus the four
vision tokens, built once into the cache folder. Imports only ``rft_core.models.hub``, so the
path resolver can build it on demand."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from rft_core.models.hub import LOAD_LOCK, cache_dir, ensure_default_model, prepare_tokenizer

TINY_VL_MODEL = "tiny-qwen2-vl"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"


def build_tiny_qwen2_vl(out_dir: str | Path, *, seed: int = 0) -> str:
    """Save a tiny random Qwen2-VL, its tokenizer and PIL image processor to ``out_dir``.

    Images are resized into 56x56 .. 112x112 pixels (4..16 merged image tokens each).
    """
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with LOAD_LOCK:
        tok = prepare_tokenizer(AutoTokenizer.from_pretrained(str(ensure_default_model())))
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}, **special),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, in_channels=3, temporal_patch_size=2),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(out_dir)
    return str(out_dir)


def ensure_tiny_vl_model() -> Path:
    """The cached tiny Qwen2-VL folder, built on first use (under the model-load lock)."""
    target = cache_dir() / "models" / TINY_VL_MODEL
    with LOAD_LOCK:
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-vl-"))
            build_tiny_qwen2_vl(tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    return target
