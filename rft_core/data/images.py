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


def read_local_file(source: str | Path, *, where: str, error: type[ValueError]) -> bytes:
    """The bytes of a local file given as a path or a ``file://`` URL (percent-escapes decoded);
    shared by images and videos (``rft_core.data.video``).

    Raises:
        error (the caller's ValueError subclass): a URL whose scheme is not ``file``, or an
            unreadable file; the message starts with ``where``.
    """
    text = str(source)
    if "://" in text:
        url = urlparse(text)
        if url.scheme != "file":
            raise error(f"{where}: only local files are read, got URL {text!r}")
        text = unquote(url.path)
    try:
        return Path(text).expanduser().read_bytes()
    except OSError as exc:
        raise error(f"{where}: cannot read {text!r}: {exc}") from exc


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
        data = read_local_file(image, where=where, error=ImageError)
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
