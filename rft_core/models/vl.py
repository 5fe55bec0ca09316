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
from rft_core.models.hub import attn_implementation
from rft_core.models.pretrained import load_pretrained, load_tokenizer, resolve_model_path
from rft_core.models.tiny_vl import (  # noqa: F401 - the VL token names are part of this module's surface
    IMAGE_PAD,
    TINY_VL_MODEL,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_tiny_qwen2_vl,
)

IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END


class VLError(ValueError):
    """Images and image placeholders do not match, or a model is not a VL model."""


def is_vl_model(path: str) -> bool:
    """True when the model folder's config has a vision tower (``vision_config``)."""
    if path == TINY_VL_MODEL:
        return True
    cfg = Path(resolve_model_path(path)) / "config.json"  # a hub id gives a relative path: not found -> False
    return cfg.exists() and "vision_config" in json.loads(cfg.read_text())


def load_vl_model(path: str, *, dtype: str = "float32", trainable: bool = False):
    """A Qwen2-VL / Qwen2.5-VL model (``AutoModelForImageTextToText``) under the load lock;
    what ``load_causal_lm`` returns for a VL folder.

    Raises:
        ModelLoadError: unreadable path or weights.
    """
    from transformers import AutoModelForImageTextToText

    return load_pretrained(AutoModelForImageTextToText, path, dtype=dtype, trainable=trainable,
                           model_kwargs={"attn_implementation": attn_implementation(dtype)}, what="vision-language model")


class VLProcessor:
    """Tokenizer + PIL image processor of a VL model folder, with the placeholder expansion and
    the batch bookkeeping described in the module docstring.

    Raises:
        ModelLoadError / OSError: the folder has no tokenizer or preprocessor_config.json.
    """

    def __init__(self, path: str) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

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
