"""Vision-language policies: the Qwen2-VL / Qwen2.5-VL family through transformers.

Token layout. A prompt with k images and m videos holds, per image, ``<|vision_start|>`` +
n_i x ``<|image_pad|>`` + ``<|vision_end|>``, and per video the same with ``<|video_pad|>``,
where n_i = t_i * h_i * w_i / merge_size**2 for the patch grid ``(t_i, h_i, w_i)`` of
``image_grid_thw`` / ``video_grid_thw`` (Qwen2-VL, arXiv:2409.12191 Sec. 2.1; t counts temporal
patches of ``temporal_patch_size`` frames: 1 for an image, ceil(frames / 2) for a video). The
prompt shard stores these expanded ids, so lengths and masks work as for text; images and videos
themselves are stored as encoded bytes and turned into tensors by ``VLProcessor`` in the stage
that needs them: ``pixel_values`` (sum_i t_i*h_i*w_i, C * temporal_patch * patch**2) float32 and
``image_grid_thw`` (k, 3) int64 for images, ``pixel_values_videos`` / ``video_grid_thw`` likewise
for videos (plus ``second_per_grid_ts`` (m,) float32 for Qwen2.5-VL, whose M-RoPE spaces video
frames in time, arXiv:2502.13923 Sec. 2.1.3). For a batch, the images of all rows are concatenated
in row order, and so are the videos. The model computes its 3-D rotary positions (M-RoPE) itself
from the attention mask and ``mm_token_type_ids`` (1 at image tokens, 2 at video tokens), so no
position_ids are passed.

Images are processed by transformers' PIL backend (``Qwen2VLImageProcessorPil``): no
torchvision needed. transformers' only Qwen2-VL video processor (``Qwen2VLVideoProcessor``)
imports torchvision, so videos take the same PIL path: frames are decoded and sampled by
``rft_core.data.video`` (PyAV), each frame is resized / rescaled / normalised by the PIL image
processor at the video pixel bounds (the same ``smart_resize``, bicubic, CLIP mean and std as the
video processor), and consecutive ``temporal_patch_size`` frames are stacked into one patch in
the layout of ``Qwen2VLVideoProcessor.patchify``; a last incomplete patch repeats the last frame.
Frames resized by PIL differ from torchvision's resize by interpolation rounding only.

Video settings (fps, min/max frames, min/max pixels) come from the folder's
``video_preprocessor_config.json``, else, as in transformers' loader, the image processor's
pixel bounds with ``VideoSettings`` defaults for the rest, then the caller's overrides;
``save_pretrained`` writes the effective ones, so a checkpoint counts video tokens as its parent.

The offline default ``tiny-qwen2-vl`` is a 2-layer, 32-wide Qwen2-VL with a 1-block vision tower
and random weights (seeded), built once into the cache folder with the SmolLM2 tokenizer plus
the four vision tokens.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from rft_core.data.images import decode_image
from rft_core.data.video import (
    VideoError,
    VideoSettings,
    decode_video,
    probe_video,
    sample_frame_indices,
)
from rft_core.models.hub import attn_implementation
from rft_core.models.pretrained import (
    load_pretrained,
    load_tokenizer,
    resolve_model_path,
)
from rft_core.models.tiny_vl import (  # noqa: F401 - the VL token names are part of this module's surface
    IMAGE_PAD,
    TINY_VL_MODEL,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_tiny_qwen2_vl,
)

IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
VIDEO_CONFIG_NAME = "video_preprocessor_config.json"  # transformers' VIDEO_PROCESSOR_NAME
_PAD_SPLIT = re.compile(f"({re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PAD)})")
_TIME_SCALED_VIDEO_MODELS = ("qwen2_5_vl",)  # M-RoPE with second_per_grid_ts (Qwen2.5-VL)


class VLError(ValueError):
    """Images / videos and their placeholders do not match, or a model is not a VL model."""


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


def folder_video_settings(folder: str, image_size: Mapping[str, int], overrides: Mapping[str, Any] | None = None) -> VideoSettings:
    """The video settings of a model folder (see the module docstring) with ``overrides`` applied.

    Args:
        folder: a resolved model folder or hub id.
        image_size: the image processor's ``size`` ({"shortest_edge", "longest_edge"}: pixel
            bounds), the fallback when the folder has no video config.
        overrides: VideoSettings field -> value.
    Raises:
        VLError: an override that is not a VideoSettings field, or a bad value (named).
    """
    from transformers.utils import cached_file

    found: dict[str, Any] = {"min_pixels": int(image_size["shortest_edge"]), "max_pixels": int(image_size["longest_edge"])}
    path = cached_file(folder, VIDEO_CONFIG_NAME, _raise_exceptions_for_missing_entries=False)
    if path is not None:
        cfg = json.loads(Path(path).read_text())
        size = cfg.get("size") or {}
        found.update({k: int(v) for k, v in (("min_pixels", size.get("shortest_edge", cfg.get("min_pixels"))),
                                             ("max_pixels", size.get("longest_edge", cfg.get("max_pixels"))),
                                             ("min_frames", cfg.get("min_frames")), ("max_frames", cfg.get("max_frames")))
                      if v is not None})
        if "fps" in cfg:
            found["fps"] = cfg["fps"] if cfg.get("do_sample_frames", True) else None
    fields = {f.name for f in dataclasses.fields(VideoSettings)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        raise VLError(f"unknown video setting(s) {unknown}; valid: {sorted(fields)}")
    try:
        return VideoSettings(**{**found, **dict(overrides or {})})
    except ValueError as exc:
        raise VLError(f"video settings of {folder!r}: {exc}") from exc


class VLProcessor:
    """Tokenizer + PIL image processor of a VL model folder, with the placeholder expansion and
    the batch bookkeeping described in the module docstring.

    Args:
        path: model folder, alias or hub id.
        video: ``VideoSettings`` field overrides (fps, min_frames, max_frames, min_pixels,
            max_pixels) on top of the folder's.
    Raises:
        ModelLoadError / OSError: the folder has no tokenizer or preprocessor_config.json.
        VLError: the tokenizer has no ``<|image_pad|>`` token, or a bad video setting.
    """

    def __init__(self, path: str, video: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        folder = resolve_model_path(path)
        self.path = path
        self.tokenizer = load_tokenizer(folder)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
        self.merge = int(self.image_processor.merge_size)
        self.patch = int(self.image_processor.patch_size)
        self.temporal_patch = int(self.image_processor.temporal_patch_size)
        self.image_token_id = self._token_id(IMAGE_PAD)
        if self.image_token_id is None:
            raise VLError(f"tokenizer of {path!r} has no {IMAGE_PAD} token: not a Qwen2-VL-style model")
        self.video_token_id = self._token_id(VIDEO_PAD)
        self.video = folder_video_settings(folder, self.image_processor.size, video)
        self.video_time_scaled = AutoConfig.from_pretrained(folder).model_type in _TIME_SCALED_VIDEO_MODELS

    def _token_id(self, token: str) -> int | None:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        return None if tid is None or tid == self.tokenizer.unk_token_id else int(tid)

    def save_pretrained(self, out_dir) -> None:
        """Save the tokenizer, the image processor and the effective video settings (a checkpoint
        folder stays a VL model folder that counts video tokens the same way)."""
        self.tokenizer.save_pretrained(out_dir)
        self.image_processor.save_pretrained(out_dir)
        ip, v = self.image_processor, self.video
        cfg = {"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": v.fps is not None, "fps": v.fps,
               "min_frames": v.min_frames, "max_frames": v.max_frames,
               "size": {"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels}, "patch_size": self.patch,
               "temporal_patch_size": self.temporal_patch, "merge_size": self.merge, "do_resize": True,
               "resample": int(ip.resample), "do_rescale": True, "rescale_factor": ip.rescale_factor, "do_normalize": True,
               "image_mean": list(ip.image_mean), "image_std": list(ip.image_std), "do_convert_rgb": True}
        (Path(out_dir) / VIDEO_CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # ---- images -------------------------------------------------------------------------
    def process_images(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """``pixel_values`` (sum of t*h*w, D) float32 and ``image_grid_thw`` (k, 3) int64 of
        encoded images, in order; ``{}`` for no images."""
        if not images:
            return {}
        out = self.image_processor(images=[decode_image(b) for b in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Merged tokens of each image (or video) grid: t*h*w / merge_size**2."""
        return [int(t * h * w) // (self.merge ** 2) for t, h, w in grid_thw.tolist()]

    tokens_per_video = tokens_per_image

    # ---- videos -------------------------------------------------------------------------
    def _require_video_token(self) -> int:
        if self.video_token_id is None:
            raise VLError(f"tokenizer of {self.path!r} has no {VIDEO_PAD} token: this model cannot take videos")
        return self.video_token_id

    def video_grid(self, data: bytes, *, where: str = "video") -> list[int]:
        """The patch grid [t, h, w] ``process_videos`` gives this video, from its decoded frame
        count and size only (no pixels converted): t = ceil(frames sampled / temporal_patch),
        (h, w) = smart_resize(H, W) / patch_size.

        Raises:
            VideoError: the video does not decode (``rft_core.data.video.probe_video``).
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            smart_resize,
        )

        info = probe_video(data, where=where)
        try:
            n = len(sample_frame_indices(info.num_frames, info.fps, self.video, self.temporal_patch))
            h, w = smart_resize(info.height, info.width, factor=self.patch * self.merge,
                                min_pixels=self.video.min_pixels, max_pixels=self.video.max_pixels)
        except ValueError as exc:
            raise VideoError(f"{where}: {exc}") from exc
        return [math.ceil(n / self.temporal_patch), h // self.patch, w // self.patch]

    def _video_patches(self, data: bytes, where: str) -> tuple[torch.Tensor, list[int], float]:
        """(patches (t*h*w, C*tp*p*p) float32, grid [t, h, w], sampled fps) of one video."""
        from PIL import Image

        video = decode_video(data, self.video, temporal_patch_size=self.temporal_patch, where=where)
        size = {"shortest_edge": self.video.min_pixels, "longest_edge": self.video.max_pixels}
        try:
            out = self.image_processor(images=[Image.fromarray(f) for f in video.frames], size=size, return_tensors="pt")
        except ValueError as exc:  # e.g. smart_resize's aspect-ratio limit
            raise VideoError(f"{where}: {exc}") from exc
        n, tp, p = len(video.frames), self.temporal_patch, self.patch
        _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        per_frame = out["pixel_values"].float().reshape(n, gh * gw, -1, tp, p, p)[:, :, :, 0]  # (n, S, C, p, p)
        if pad := -n % tp:  # repeat the last frame into the last temporal patch (Qwen2VLVideoProcessor.patchify)
            per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, *per_frame.shape[1:])])
        gt = per_frame.shape[0] // tp
        # (gt, tp, S, C, p, p) -> (gt, S, C, tp, p, p): rows temporal-major then spatial, features (C, tp, p, p)
        patches = per_frame.reshape(gt, tp, *per_frame.shape[1:]).permute(0, 2, 3, 1, 4, 5).reshape(gt * gh * gw, -1)
        return patches.contiguous(), [gt, gh, gw], video.sampled_fps

    def process_videos(self, videos: Sequence[bytes], *, where: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` (sum of t*h*w, C*temporal_patch*patch**2) float32 and
        ``video_grid_thw`` (m, 3) int64 of encoded videos, in order (Qwen2.5-VL also
        ``second_per_grid_ts`` (m,) float32 = temporal_patch / sampled fps, seconds); ``{}`` for
        no videos.

        Args:
            where: a name per video for error messages (default "video k").
        Raises:
            VideoError: a video does not decode; the message names it.
            VLError: the tokenizer has no ``<|video_pad|>`` token.
        """
        if not videos:
            return {}
        self._require_video_token()
        names = list(where) if where is not None else [f"video {k}" for k in range(len(videos))]
        parts = [self._video_patches(b, name) for b, name in zip(videos, names)]
        out = {"pixel_values_videos": torch.cat([x for x, _, _ in parts]),
               "video_grid_thw": torch.tensor([g for _, g, _ in parts], dtype=torch.long)}
        if self.video_time_scaled:
            out["second_per_grid_ts"] = torch.tensor([self.temporal_patch / fps for _, _, fps in parts], dtype=torch.float32)
        return out

    # ---- prompts and batches ------------------------------------------------------------
    def render_prompt(self, question: str, n_images: int, system_prompt: str = "", n_videos: int = 0) -> str:
        """Chat-templated prompt text with ``n_images`` image placeholders, then ``n_videos``
        video placeholders, before the question."""
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": IMAGE_PLACEHOLDER * n_images + VIDEO_PLACEHOLDER * n_videos + question}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def prompt_ids(self, text: str, images: Sequence[bytes], videos: Sequence[bytes] = (), *, where: str = "prompt") -> list[int]:
        """Token ids of ``text`` with each ``<|image_pad|>`` / ``<|video_pad|>`` expanded to its
        image's / video's token count (placeholders of each kind matched in order).

        Raises:
            VLError: the number of placeholders of a kind differs from the number of items.
            VideoError: a video does not decode (named ``{where} video k``).
        """
        for token, items, what in ((IMAGE_PAD, images, "images"), (VIDEO_PAD, videos, "videos")):
            if text.count(token) != len(items):
                raise VLError(f"{where}: prompt has {text.count(token)} {token} placeholders but {len(items)} {what}")
        if videos:
            self._require_video_token()
        counts = {
            IMAGE_PAD: iter(self.tokens_per_image(self.process_images(images)["image_grid_thw"]) if images else []),
            VIDEO_PAD: iter(self.tokens_per_video(torch.tensor([self.video_grid(v, where=f"{where} video {k}")
                                                                for k, v in enumerate(videos)])) if videos else []),
        }
        parts = _PAD_SPLIT.split(text)  # odd positions are the placeholders, in order
        text = "".join(part * next(counts[part]) if i % 2 else part for i, part in enumerate(parts))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def batch_inputs(self, images_per_row: Sequence[Sequence[bytes]], input_ids: torch.Tensor,
                     videos_per_row: Sequence[Sequence[bytes]] | None = None) -> dict[str, torch.Tensor]:
        """Model inputs for a batch whose rows hold these images and videos: ``pixel_values`` and
        ``image_grid_thw`` of every image in row order, ``pixel_values_videos`` and
        ``video_grid_thw`` (and ``second_per_grid_ts`` for Qwen2.5-VL) of every video in row
        order, and ``mm_token_type_ids`` (B, T) int32: 1 at image tokens, 2 at video tokens, 0
        elsewhere. A kind no row has adds nothing; a batch with neither gives only
        ``mm_token_type_ids``.

        Args:
            images_per_row: B lists of encoded images ([] for none).
            input_ids: (B, T) int64, the expanded prompt ids (padded, plus any response).
            videos_per_row: B lists of encoded videos (None: no videos in the batch).
        Raises:
            VLError: a row count that is not B, or a row's image / video token count that differs
                from what its items need (the message names the row).
            VideoError: a video does not decode (named ``batch row r video k``).
        """
        B = input_ids.shape[0]
        videos_per_row = [[] for _ in range(B)] if videos_per_row is None else videos_per_row
        if len(images_per_row) != B or len(videos_per_row) != B:
            raise VLError(f"batch of {B} rows got {len(images_per_row)} image lists and {len(videos_per_row)} video lists")
        images = self.process_images([img for row in images_per_row for img in row])
        videos = self.process_videos([v for row in videos_per_row for v in row],
                                     where=[f"batch row {r} video {k}" for r, row in enumerate(videos_per_row) for k in range(len(row))])
        types = (input_ids == self.image_token_id).int()
        if self.video_token_id is not None:
            types = types + 2 * (input_ids == self.video_token_id).int()
        for kind, per_row, grids, code in (("image", images_per_row, images.get("image_grid_thw"), 1),
                                           ("video", videos_per_row, videos.get("video_grid_thw"), 2)):
            counts = self.tokens_per_image(grids) if grids is not None else []
            k = 0
            for r, row in enumerate(per_row):
                need, k = sum(counts[k:k + len(row)]), k + len(row)
                have = int((types[r] == code).sum())
                if have != need:
                    raise VLError(f"batch row {r}: {have} {kind} tokens in the ids but its {len(row)} {kind}(s) need {need}")
        return {**images, **videos, "mm_token_type_ids": types}


@lru_cache(maxsize=4)
def cached_processor(path: str, video: tuple[tuple[str, Any], ...] = ()) -> VLProcessor:
    """One ``VLProcessor`` per model path, video overrides (sorted (key, value) pairs) and process."""
    return VLProcessor(path, video=dict(video))


def vl_processor_or_none(path: str, video: Mapping[str, Any] | None = None) -> VLProcessor | None:
    """The cached ``VLProcessor`` of ``path`` (with these ``VideoSettings`` overrides) when it is
    a vision-language model, else None."""
    return cached_processor(path, tuple(sorted((video or {}).items()))) if is_vl_model(path) else None
