"""``vl_digits``: a real image task with a verifiable answer, offline.

The 1797 8x8 handwritten digits that ship with scikit-learn (``load_digits``, UCI optdigits),
upscaled to ``image_size`` pixels (nearest neighbour) and stored as PNG bytes. A row asks
"Which digit is shown in the image?" (one image), or, with ``images_per_prompt=2``, for the sum
of the two digits (two images); ``text_only_fraction`` of the rows are plain arithmetic
questions without images, so batches mix text-only and image samples. The answer is the
number; grade with the ``exact_match`` reward source.
"""
from __future__ import annotations

import io
from functools import lru_cache
from typing import Any

import numpy as np


@lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float64), d.target.astype(int)


@lru_cache(maxsize=4096)
def digit_png(index: int, image_size: int) -> bytes:
    """PNG bytes of digit ``index`` (0..1796), grey on black, ``image_size`` x ``image_size``, RGB."""
    from PIL import Image

    images, _ = _digits()
    arr = np.round(images[index] * (255.0 / 16.0)).astype(np.uint8)
    img = Image.fromarray(arr, mode="L").resize((image_size, image_size), Image.NEAREST).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
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
        _, targets = _digits()
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
