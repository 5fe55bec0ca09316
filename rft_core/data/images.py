"""Images in datasets and shards: any accepted form in, encoded bytes stored, PIL out.

A dataset row's ``images`` may hold file paths, ``file://`` URLs of local files, encoded bytes
(PNG/JPEG/...), or PIL images. The prompt stage stores each as encoded bytes (PNG for PIL
images, the file's own bytes otherwise) in the shards, so a shard is self-contained and an
image round-trips bit-exactly; stages that need tensors decode them again.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class ImageError(ValueError):
    """An image cannot be read or decoded; the message names it."""


def to_image_bytes(image: Any, *, where: str = "image") -> bytes:
    """Encoded bytes of ``image`` (path, file:// URL, bytes or PIL image).

    Raises:
        ImageError: unreadable file, a URL that is not file://, bytes that are not an image,
            or an unsupported type.
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif isinstance(image, (str, Path)):
        text = str(image)
        if "://" in text:
            url = urlparse(text)
            if url.scheme != "file":
                raise ImageError(f"{where}: only local files are read, got URL {text!r}")
            text = unquote(url.path)
        try:
            data = Path(text).expanduser().read_bytes()
        except OSError as exc:
            raise ImageError(f"{where}: cannot read {text!r}: {exc}") from exc
    else:
        raise ImageError(f"{where}: expected a path, file:// URL, bytes or PIL image, got {type(image).__name__}")
    decode_image(data, where=where)  # validate now, not in a later stage
    return data


def decode_image(data: bytes, *, where: str = "image"):
    """The RGB PIL image of encoded ``data``.

    Raises:
        ImageError: not a decodable image.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise ImageError(f"{where}: not a decodable image ({len(data)} bytes): {exc}") from exc
    return img.convert("RGB")
