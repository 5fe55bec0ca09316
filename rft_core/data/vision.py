"""``vl_digits``: a real image task with a verifiable answer, offline.

The 1797 8x8 handwritten digits of scikit-learn's ``load_digits`` (UCI optdigits), shipped
beside this module as ``digits.csv.gz`` (BSD-3, ``digits.LICENSE.txt``) and read with numpy,
upscaled to ``image_size`` pixels (nearest neighbour) and stored as PNG bytes. A row asks
"Which digit is shown in the image?" (one image), or, with ``images_per_prompt=2``, for the sum
of the two digits (two images); ``text_only_fraction`` of the rows are plain arithmetic
questions without images, so batches mix text-only and image samples. The answer is the
number; grade with the ``exact_match`` reward source.

``vl_video_digits`` (``VideoDigitsDataset``): short clips, encoded at run time as lossless MP4
(``rft_core.data.video.encode_video``), in which one digit slides across the frame from one side
to the other while, by default, a different digit stands still in the other lane. A row asks
"Which digit moves across the frame?" (one video); the answer is the moving digit, which a single
frame does not reveal. ``text_only_fraction`` of the rows are plain arithmetic questions.
"""
from __future__ import annotations

import gzip
import io
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from rft_core.data.video import encode_video


DIGITS_FILE = Path(__file__).with_name("digits.csv.gz")


@lru_cache(maxsize=1)
def digits_data() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn's ``load_digits()`` gives them, read from ``digits.csv.gz``.

    Returns:
        (images: (1797, 8, 8) float64 grey levels 0..16, targets: (1797,) int digits 0..9),
        both read-only.
    """
    with gzip.open(DIGITS_FILE, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float64)
    images, targets = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    images.flags.writeable = targets.flags.writeable = False
    return images, targets


@lru_cache(maxsize=4096)
def digit_array(index: int, image_size: int) -> np.ndarray:
    """Digit ``index`` (0..1796) as (image_size, image_size) uint8 grey levels: the 0..16 values
    scaled to 0..255 and rounded, upscaled by nearest neighbour (read-only array)."""
    from PIL import Image

    images, _ = digits_data()
    arr = np.round(images[index] * (255.0 / 16.0)).astype(np.uint8)
    out = np.asarray(Image.fromarray(arr, mode="L").resize((image_size, image_size), Image.NEAREST))
    out.flags.writeable = False
    return out


@lru_cache(maxsize=4096)
def digit_png(index: int, image_size: int) -> bytes:
    """PNG bytes of digit ``index`` (0..1796), grey on black, ``image_size`` x ``image_size``, RGB."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(digit_array(index, image_size), mode="L").convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


class DigitsDataset:
    """Seeded rows of the digits task (see the module docstring); indexable like a
    reasoning-gym dataset.

    Args:
        size: number of rows.
        seed: row ``i`` is built from ``numpy PCG64(seed, i)``.
        images_per_prompt: 1 (name the digit) or 2 (sum of the two digits).
        text_only_fraction: share of rows without images (``a + b`` questions).
        image_size: pixels per side (Qwen2-VL needs multiples of 28 to avoid resizing).
    Raises:
        ValueError: a bad argument, named.
    """

    def __init__(self, size: int, seed: int = 0, *, images_per_prompt: int = 1, text_only_fraction: float = 0.0,
                 image_size: int = 28) -> None:
        if size < 1:
            raise ValueError(f"vl_digits: size must be >= 1, got {size}")
        if images_per_prompt not in (1, 2):
            raise ValueError(f"vl_digits: images_per_prompt must be 1 or 2, got {images_per_prompt}")
        if not 0.0 <= text_only_fraction <= 1.0:
            raise ValueError(f"vl_digits: text_only_fraction must be in [0, 1], got {text_only_fraction}")
        if image_size < 8:
            raise ValueError(f"vl_digits: image_size must be >= 8, got {image_size}")
        self.size, self.seed = size, seed
        self.images_per_prompt, self.text_only_fraction, self.image_size = images_per_prompt, text_only_fraction, image_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.size:
            raise IndexError(f"vl_digits index {i} outside 0..{self.size - 1}")
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        _, targets = digits_data()
        if rng.random() < self.text_only_fraction:
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
            return {"question": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b),
                    "images": [], "metadata": {"kind": "text"}}
        picks = [int(x) for x in rng.integers(0, len(targets), size=self.images_per_prompt)]
        digits = [int(targets[p]) for p in picks]
        images = [digit_png(p, self.image_size) for p in picks]
        if self.images_per_prompt == 1:
            q, ans = "Which digit is shown in the image? Answer with the digit only.", str(digits[0])
        else:
            q, ans = "Each image shows one digit. What is the sum of the two digits? Answer with the number only.", str(sum(digits))
        return {"question": q, "answer": ans, "images": images, "metadata": {"kind": "image", "digit_indices": picks,
                                                                            "digits": digits}}


def moving_digit_frames(moving: int, *, lane_y: int, left_to_right: bool, num_frames: int, frame_height: int,
                        frame_width: int, digit_size: int, still: int | None = None, still_xy: tuple[int, int] = (0, 0)) -> np.ndarray:
    """RGB frames (num_frames, frame_height, frame_width, 3) uint8 of digit ``moving`` sliding
    across the frame at top-left y = ``lane_y``: in frame f its left edge is at
    x_f = round(f * (frame_width - digit_size) / (num_frames - 1)) (mirrored for right-to-left),
    so it starts at one border and ends at the other; digit ``still`` (if any) is drawn at
    ``still_xy`` (x, y) in every frame. Overlaps take the brighter pixel.

    Raises:
        ValueError: num_frames < 2, or a digit that does not fit in the frame.
    """
    if num_frames < 2:
        raise ValueError(f"moving_digit_frames: num_frames must be >= 2, got {num_frames}")
    if not (0 <= lane_y <= frame_height - digit_size and digit_size <= frame_width):
        raise ValueError(f"moving_digit_frames: a {digit_size}px digit at y={lane_y} does not fit in {frame_width}x{frame_height}")
    frames = np.zeros((num_frames, frame_height, frame_width), dtype=np.uint8)
    glyph, s = digit_array(moving, digit_size), digit_size
    for f in range(num_frames):
        x = round(f * (frame_width - s) / (num_frames - 1))
        x = x if left_to_right else frame_width - s - x
        frames[f, lane_y:lane_y + s, x:x + s] = glyph
    if still is not None:
        sx, sy = still_xy
        region = frames[:, sy:sy + s, sx:sx + s]
        np.maximum(region, digit_array(still, s)[None], out=region)
    return np.repeat(frames[..., None], 3, axis=-1)


class VideoDigitsDataset:
    """Seeded rows of the ``vl_video_digits`` task (see the module docstring), indexable like a
    reasoning-gym dataset. Entries: ``{question, answer, videos: [mp4 bytes], metadata}``.

    Args:
        size: number of rows.
        seed: row ``i`` is built from ``numpy PCG64(seed, i)``: the digits, the lanes, the
            direction and the still digit's place; the clip is encoded at access time
            (same bytes for the same row in one environment).
        num_frames, fps: clip length (frames) and frame rate (frames/s).
        frame_height, frame_width, digit_size: pixels; with ``distractor`` the frame holds two
            lanes (frame_height >= 2 * digit_size).
        distractor: draw a still digit of another value in the other lane.
        text_only_fraction: share of rows without a video (``a + b`` questions).
    Raises:
        ValueError: a bad argument, named.
    """

    QUESTION = "Which digit moves across the frame? Answer with the digit only."

    def __init__(self, size: int, seed: int = 0, *, num_frames: int = 4, fps: float = 2.0, frame_height: int = 56,
                 frame_width: int = 84, digit_size: int = 28, distractor: bool = True, text_only_fraction: float = 0.0) -> None:
        if size < 1:
            raise ValueError(f"vl_video_digits: size must be >= 1, got {size}")
        if num_frames < 2 or not fps > 0:
            raise ValueError(f"vl_video_digits: need num_frames >= 2 and fps > 0, got {num_frames}, {fps}")
        if digit_size < 8 or frame_width < 2 * digit_size or frame_height < (2 if distractor else 1) * digit_size:
            raise ValueError(f"vl_video_digits: frame {frame_width}x{frame_height} too small for {digit_size}px digits "
                             f"(need digit_size >= 8, width >= 2*digit_size, height >= {'2*' if distractor else ''}digit_size)")
        if not 0.0 <= text_only_fraction <= 1.0:
            raise ValueError(f"vl_video_digits: text_only_fraction must be in [0, 1], got {text_only_fraction}")
        self.size, self.seed, self.num_frames, self.fps = size, seed, num_frames, float(fps)
        self.frame_height, self.frame_width, self.digit_size = frame_height, frame_width, digit_size
        self.distractor, self.text_only_fraction = distractor, text_only_fraction

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.size:
            raise IndexError(f"vl_video_digits index {i} outside 0..{self.size - 1}")
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        _, targets = digits_data()
        if rng.random() < self.text_only_fraction:
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
            return {"question": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b),
                    "videos": [], "metadata": {"kind": "text"}}
        s, H, W = self.digit_size, self.frame_height, self.frame_width
        moving = int(rng.integers(0, len(targets)))
        left_to_right = bool(rng.integers(0, 2))
        meta: dict[str, Any] = {"kind": "video", "digit_index": moving, "digit": int(targets[moving]),
                                "direction": "left_to_right" if left_to_right else "right_to_left"}
        still, still_xy = None, (0, 0)
        if self.distractor:
            lane = int(rng.integers(0, 2))
            lane_y = 0 if lane == 0 else H - s
            others = np.flatnonzero(targets != targets[moving])
            still = int(others[rng.integers(0, len(others))])
            still_xy = (int(rng.integers(0, W - s + 1)), H - s if lane == 0 else 0)
            meta.update(still_index=still, still_digit=int(targets[still]), still_xy=list(still_xy))
        else:
            lane_y = int(rng.integers(0, H - s + 1))
        meta["lane_y"] = lane_y
        frames = moving_digit_frames(moving, lane_y=lane_y, left_to_right=left_to_right, num_frames=self.num_frames,
                                     frame_height=H, frame_width=W, digit_size=s, still=still, still_xy=still_xy)
        video = encode_video(frames, self.fps, where=f"vl_video_digits row {i}")
        return {"question": self.QUESTION, "answer": str(targets[moving]), "videos": [video], "metadata": meta}
