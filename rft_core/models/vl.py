"""Vision-language policies: the Qwen2-VL / Qwen2.5-VL family through transformers.

Token layout. A prompt with k images holds, per image, ``<|vision_start|>`` + n_i x
``<|image_pad|>`` + ``<|vision_end|>``, where n_i = t_i * h_i * w_i / merge_size**2 for the
image's patch grid ``image_grid_thw[i] = (t_i, h_i, w_i)`` (Qwen2-VL, arXiv:2409.12191). The
prompt shard stores these expanded ids, so lengths and masks work as for text; the images
themselves are stored as encoded bytes and turned into ``pixel_values`` (sum_i t_i*h_i*w_i,
C * temporal_patch * patch**2) float32 and ``image_grid_thw`` (k, 3) int64 by ``VLProcessor``
in the stage that needs tensors. For a batch, the images of all rows are concatenated in row
order. The model computes its 3-D rotary positions (M-RoPE) itself from the attention mask and
``mm_token_type_ids`` (1 at image tokens), so no position_ids are passed.

Images are processed by transformers' PIL backend (``Qwen2VLImageProcessorPil``): no
torchvision needed. The offline default ``tiny-qwen2-vl`` is a 2-layer, 32-wide Qwen2-VL with
a 1-block vision tower and random weights (seeded), built once into the cache folder with the
SmolLM2 tokenizer plus the four vision tokens.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from rft_core.data.images import decode_image

TINY_VL_MODEL = "tiny-qwen2-vl"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END


class VLError(ValueError):
    """Images and image placeholders do not match, or a model is not a VL model."""


def is_vl_model(path: str) -> bool:
    """True when the model folder's config has a vision tower (``vision_config``)."""
    from rft_core.models.loading import resolve_model_path

    if path == TINY_VL_MODEL:
        return True
    cfg = Path(resolve_model_path(path)) / "config.json"  # a hub id gives a relative path: not found -> False
    return cfg.exists() and "vision_config" in json.loads(cfg.read_text())


def build_tiny_qwen2_vl(out_dir: str | Path, *, seed: int = 0) -> str:
    """Save a tiny random Qwen2-VL, its tokenizer and PIL image processor to ``out_dir``.

    Images are resized into 56x56 .. 112x112 pixels (4..16 merged image tokens each).
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rft_core.models.loading import DEFAULT_MODEL, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
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
    from rft_core.models.loading import _LOAD_LOCK, cache_dir

    target = cache_dir() / "models" / TINY_VL_MODEL
    with _LOAD_LOCK:
        if not (target / "config.json").exists():
            import shutil
            import tempfile

            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-vl-"))
            build_tiny_qwen2_vl(tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    return target


def load_vl_model(path: str, *, dtype: str = "float32", trainable: bool = False):
    """A Qwen2-VL / Qwen2.5-VL model (``AutoModelForImageTextToText``) under the load lock;
    what ``load_causal_lm`` returns for a VL folder.

    Raises:
        ModelLoadError: unreadable path or weights.
    """
    from rft_core.models.loading import load_causal_lm

    return load_causal_lm(path, dtype=dtype, trainable=trainable)


class VLProcessor:
    """Tokenizer + PIL image processor of a VL model folder, with the placeholder expansion and
    the batch bookkeeping described in the module docstring.

    Raises:
        ModelLoadError / OSError: the folder has no tokenizer or preprocessor_config.json.
    """

    def __init__(self, path: str) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from rft_core.models.loading import load_tokenizer

        from rft_core.models.loading import resolve_model_path

        folder = resolve_model_path(path)
        self.tokenizer = load_tokenizer(folder)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
        self.merge = int(self.image_processor.merge_size)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_token_id is None or self.image_token_id == self.tokenizer.unk_token_id:
            raise VLError(f"tokenizer of {path!r} has no {IMAGE_PAD} token: not a Qwen2-VL-style model")

    def save_pretrained(self, out_dir) -> None:
        """Save the tokenizer and the image processor (a checkpoint folder stays a VL model folder)."""
        self.tokenizer.save_pretrained(out_dir)
        self.image_processor.save_pretrained(out_dir)

    def process_images(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """``pixel_values`` (sum of t*h*w, D) float32 and ``image_grid_thw`` (k, 3) int64 of
        encoded images, in order; ``{}`` for no images."""
        if not images:
            return {}
        out = self.image_processor(images=[decode_image(b) for b in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Merged image tokens of each image: t*h*w / merge_size**2."""
        return [int(t * h * w) // (self.merge ** 2) for t, h, w in grid_thw.tolist()]

    def render_prompt(self, question: str, n_images: int, system_prompt: str = "") -> str:
        """Chat-templated prompt text with ``n_images`` image placeholders before the question."""
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": IMAGE_PLACEHOLDER * n_images + question}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def prompt_ids(self, text: str, images: Sequence[bytes]) -> list[int]:
        """Token ids of ``text`` with each ``<|image_pad|>`` expanded to its image's token count.

        Raises:
            VLError: the number of placeholders differs from the number of images.
        """
        n_placeholders = text.count(IMAGE_PAD)
        if n_placeholders != len(images):
            raise VLError(f"prompt has {n_placeholders} {IMAGE_PAD} placeholders but {len(images)} images")
        if images:
            counts = self.tokens_per_image(self.process_images(images)["image_grid_thw"])
            parts = text.split(IMAGE_PAD)
            text = parts[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, parts[1:]))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def batch_inputs(self, images_per_row: Sequence[Sequence[bytes]], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Model inputs for a batch whose rows hold these images: ``pixel_values`` and
        ``image_grid_thw`` of every image in row order, and ``mm_token_type_ids`` (B, T) int32,
        1 at image tokens. Rows without images add nothing; a batch without images gives only
        ``mm_token_type_ids``.

        Raises:
            VLError: a row's image-token count differs from what its images need.
        """
        flat = [img for row in images_per_row for img in row]
        vision = self.process_images(flat)
        counts = self.tokens_per_image(vision["image_grid_thw"]) if flat else []
        k = 0
        for r, row in enumerate(images_per_row):
            need = sum(counts[k:k + len(row)])
            k += len(row)
            have = int((input_ids[r] == self.image_token_id).sum())
            if have != need:
                raise VLError(f"batch row {r}: {have} image tokens in the ids but its {len(row)} image(s) need {need}")
        return {**vision, "mm_token_type_ids": (input_ids == self.image_token_id).int()}


@lru_cache(maxsize=4)
def cached_processor(path: str) -> VLProcessor:
    """One ``VLProcessor`` per model path and process."""
    return VLProcessor(path)


def vl_processor_or_none(path: str) -> VLProcessor | None:
    """The cached ``VLProcessor`` of ``path`` when it is a vision-language model, else None."""
    return cached_processor(path) if is_vl_model(path) else None
