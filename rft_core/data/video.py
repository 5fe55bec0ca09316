"""Videos in datasets and shards: any accepted form in, encoded container bytes stored, frames out.

A dataset row's ``videos`` may hold file paths, ``file://`` URLs of local files, or encoded
container bytes (MP4, WebM, MKV, AVI, GIF, ... anything FFmpeg demuxes). The prompt stage stores
each video as the file's own bytes, so a shard is self-contained and a video round-trips
bit-exactly; ``to_video_bytes`` decodes every frame once before anything is stored, so an
unreadable, truncated or empty video fails with an error naming it there, not in a later stage.
Stages that need tensors decode the bytes again with ``decode_video``: PyAV (FFmpeg bindings),
every frame decoded in stream order, then a uniform subset of ``sample_frame_indices`` returned
as RGB uint8 arrays. ``rft_core.models.vl.VLProcessor`` turns those frames into the Qwen2-VL
``pixel_values_videos`` / ``video_grid_thw``.

Frame sampling follows transformers' ``Qwen2VLVideoProcessor.sample_frames``
(``transformers/models/qwen2_vl/video_processing_qwen2_vl.py``), which mirrors Qwen's
qwen-vl-utils ``smart_nframes``: n = frames / video_fps * fps clamped to
[min_frames, min(max_frames, frames)] and floored to a multiple of ``temporal_patch_size``;
indices floor(i * frames / n) for i < n. Differences, each a case transformers refuses: with
``fps=None`` every frame is taken up to ``max_frames`` (transformers takes all, uncapped), and a
clip with fewer frames than ``temporal_patch_size`` keeps all its frames (the processor pads the
last temporal patch by repeating the last frame, as transformers' ``patchify`` does).

``encode_video`` writes frames as lossless RGB H.264 (libx264rgb, qp 0) in MP4 with FFmpeg's
bit-exact flags and one encoder thread: the same frames give the same bytes in one environment
(PyAV / FFmpeg / x264 version), which the synthetic ``vl_video_digits`` task relies on.
"""
from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rft_core.data.images import read_local_file


class VideoError(ValueError):
    """A video cannot be read, decoded or encoded; the message names it (row / index / path)."""


@dataclass(frozen=True)
class VideoSettings:
    """How videos are sampled and sized for a Qwen2-VL-style processor.

    Attributes:
        fps: frames per second to sample (None: every frame, up to ``max_frames``). Default 2.0,
            qwen-vl-utils' ``FPS``.
        min_frames, max_frames: bounds on the sampled frame count (transformers'
            ``Qwen2VLVideoProcessor`` defaults 4 and 768).
        min_pixels, max_pixels: bounds on each resized frame's height * width, pixels
            (``smart_resize``; transformers' video defaults 128*28*28 and 768*28*28).
    Raises:
        ValueError: a non-positive fps, min > max, or a bound below 1; the message names the field.
    """

    fps: float | None = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28

    def __post_init__(self) -> None:
        if self.fps is not None and not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"video settings: fps must be a positive number or None, got {self.fps!r}")
        for lo, hi in (("min_frames", "max_frames"), ("min_pixels", "max_pixels")):
            a, b = getattr(self, lo), getattr(self, hi)
            if not (isinstance(a, int) and isinstance(b, int)) or a < 1 or b < a:
                raise ValueError(f"video settings: need integers 1 <= {lo} <= {hi}, got {lo}={a!r}, {hi}={b!r}")


@dataclass(frozen=True)
class VideoInfo:
    """What decoding a video found.

    Attributes:
        num_frames: frames that decoded (counted, not the container's claim).
        fps: the stream's average frame rate, frames/s (None when the container has none).
        height, width: frame size, pixels.
    """

    num_frames: int
    fps: float | None
    height: int
    width: int


@dataclass(frozen=True)
class DecodedVideo:
    """Sampled frames of a video.

    Attributes:
        frames: (n, H, W, 3) uint8 RGB.
        indices: the n frame indices (0-based, decode order) that were kept.
        info: the whole video's ``VideoInfo``.
        sampled_fps: n / num_frames * fps (transformers' ``VideoMetadata.sampled_fps``; 24 when
            the video has no frame rate, transformers' fallback).
    """

    frames: np.ndarray
    indices: list[int]
    info: VideoInfo
    sampled_fps: float


def to_video_bytes(video: Any, *, where: str = "video") -> bytes:
    """Encoded container bytes of ``video`` (a path, a file:// URL or bytes), checked by decoding
    every frame (``probe_video``).

    Raises:
        VideoError: an unreadable file, a URL that is not file://, bytes that are not a video,
            a truncated video or one with no decodable frame, or an unsupported type; the message
            starts with ``where``.
    """
    if isinstance(video, (bytes, bytearray, memoryview)):
        data = bytes(video)
    elif isinstance(video, (str, Path)):
        data = read_local_file(video, where=where, error=VideoError)
    else:
        raise VideoError(f"{where}: expected a path, file:// URL or encoded video bytes, got {type(video).__name__}")
    probe_video(data, where=where)
    return data


def _decoded_frames(data: bytes, where: str, keep: set[int] | None):
    """Decode every frame of the first video stream; returns (info, {index: rgb array} of ``keep``).

    The single place that talks to PyAV; FFmpeg's errors become ``VideoError``.
    """
    import av

    if not data:
        raise VideoError(f"{where}: empty video (0 bytes)")
    kept: dict[int, np.ndarray] = {}
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise VideoError(f"{where}: no video stream in {len(data)} bytes (not a video, or truncated)")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else None
            n, times, size = 0, [], None
            for frame in container.decode(stream):
                size = size or (frame.height, frame.width)
                if (frame.height, frame.width) != size:
                    raise VideoError(f"{where}: frame {n} is {frame.width}x{frame.height}, frame 0 is {size[1]}x{size[0]}")
                if keep is None or n in keep:
                    kept[n] = frame.to_ndarray(format="rgb24")
                if frame.time is not None:
                    times.append(frame.time)
                n += 1
            declared = _declared_length(container, stream)
    except av.error.FFmpegError as exc:
        raise VideoError(f"{where}: not a decodable video ({len(data)} bytes): {exc}") from exc
    if n == 0:
        raise VideoError(f"{where}: no decodable frames in {len(data)} bytes")
    _check_complete(where, n, fps, max(times) - min(times) if times else None, declared)
    return VideoInfo(num_frames=n, fps=fps, height=size[0], width=size[1]), kept


def _declared_length(container, stream) -> tuple[int, float | None]:
    """(frames the stream header declares or 0, seconds the video stream lasts or None)."""
    seconds = None
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None and len(container.streams) == 1:  # no other stream to be longer
        seconds = container.duration / 1_000_000  # AV_TIME_BASE
    return int(stream.frames or 0), seconds


def _check_complete(where: str, n: int, fps: float | None, span: float | None, declared) -> None:
    """Raise when fewer frames decoded than the container declares: by count when its header
    has one (AVI, MP4), else (Matroska / WebM) by duration, when the decoded frames' span plus
    1.5 frame intervals falls short of the declared duration by more than 5% of it (slack for
    variable frame rates)."""
    frames, seconds = declared
    if frames:
        if n < frames:
            raise VideoError(f"{where}: truncated or corrupt: the container declares {frames} frames, {n} decode")
        return
    if seconds and fps and span is not None and span + 1.5 / fps < 0.95 * seconds:
        raise VideoError(f"{where}: truncated or corrupt: the container declares {seconds:.3f} s, "
                         f"its {n} decodable frames span {span + 1 / fps:.3f} s")


def probe_video(data: bytes, *, where: str = "video") -> VideoInfo:
    """Decode every frame of ``data`` (nothing converted) and report what was found.

    Raises:
        VideoError: not a video, no video stream, no decodable frame, frames that change size,
            or fewer frames than the container declares (truncated).
    """
    info, _ = _decoded_frames(data, where, keep=set())
    return info


def sample_frame_indices(num_frames: int, video_fps: float | None, settings: VideoSettings,
                         temporal_patch_size: int) -> list[int]:
    """Indices of the frames to keep (the rule in the module docstring).

    Args:
        num_frames: decodable frames of the video (>= 1).
        video_fps: its frame rate (frames/s); needed only when ``settings.fps`` is set.
        temporal_patch_size: frames per temporal patch (2 for Qwen2-VL / Qwen2.5-VL).
    Returns:
        n increasing indices in [0, num_frames), n a multiple of ``temporal_patch_size`` unless the
        video (or ``max_frames``) has fewer frames than that.
    Raises:
        ValueError: num_frames < 1, temporal_patch_size < 1, or fps sampling of a video without a
            frame rate.
    """
    if num_frames < 1 or temporal_patch_size < 1:
        raise ValueError(f"sample_frame_indices: need num_frames >= 1 and temporal_patch_size >= 1, "
                         f"got {num_frames}, {temporal_patch_size}")
    cap = min(settings.max_frames, num_frames)
    if settings.fps is None:
        n = float(cap)
    else:
        if not video_fps:
            raise ValueError("sample_frame_indices: the video has no frame rate, so fps sampling is impossible; "
                             "set the video fps setting to None")
        n = min(max(num_frames / video_fps * settings.fps, settings.min_frames), cap)
    n = math.floor(n / temporal_patch_size) * temporal_patch_size or cap
    return [i * num_frames // n for i in range(n)]


def decode_video(data: bytes, settings: VideoSettings, *, temporal_patch_size: int, where: str = "video") -> DecodedVideo:
    """The sampled RGB frames of an encoded video.

    Args:
        data: encoded container bytes.
        settings: frame sampling (``VideoSettings``).
        temporal_patch_size: the model's frames per temporal patch.
    Returns:
        ``DecodedVideo`` with frames (n, H, W, 3) uint8.
    Raises:
        VideoError: what ``probe_video`` raises, or fps sampling of a video without a frame rate.
    """
    info = probe_video(data, where=where)
    try:
        indices = sample_frame_indices(info.num_frames, info.fps, settings, temporal_patch_size)
    except ValueError as exc:
        raise VideoError(f"{where}: {exc}") from exc
    _, kept = _decoded_frames(data, where, keep=set(indices))
    frames = np.stack([kept[i] for i in indices])
    sampled_fps = len(indices) / info.num_frames * info.fps if info.fps else 24.0
    return DecodedVideo(frames=frames, indices=indices, info=info, sampled_fps=sampled_fps)


def encode_video(frames: Sequence[np.ndarray] | np.ndarray, fps: float, *, where: str = "video") -> bytes:
    """MP4 bytes of RGB frames, lossless (decoding gives the same pixels; see the module docstring).

    Args:
        frames: (T, H, W, 3) uint8, T >= 1, all frames one size.
        fps: frame rate, frames/s (a positive number; stored as a rational).
    Raises:
        VideoError: no frames, a wrong shape or dtype, a non-positive fps, or an encoder error.
    """
    from fractions import Fraction

    import av

    arr = np.asarray(frames)
    if arr.ndim != 4 or arr.shape[0] < 1 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise VideoError(f"{where}: frames must be a (T>=1, H, W, 3) uint8 array, got shape {arr.shape} dtype {arr.dtype}")
    if not (math.isfinite(fps) and fps > 0):
        raise VideoError(f"{where}: fps must be positive, got {fps!r}")
    buf = io.BytesIO()
    try:
        with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
            stream = container.add_stream("libx264rgb", rate=Fraction(fps).limit_denominator(1001),
                                          options={"qp": "0", "threads": "1", "preset": "medium"})
            stream.width, stream.height, stream.pix_fmt = arr.shape[2], arr.shape[1], "rgb24"
            for frame in arr:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
            container.mux(stream.encode(None))
    except av.error.FFmpegError as exc:
        raise VideoError(f"{where}: cannot encode {arr.shape[0]} frames of {arr.shape[2]}x{arr.shape[1]}: {exc}") from exc
    return buf.getvalue()
