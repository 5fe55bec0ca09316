"""Videos in the data layer: every input form stored bit-exactly, lossless encoding, hand-checked
frame sampling, the bad-input errors (unreadable, truncated, no frames), and the seeded
``vl_video_digits`` clips checked pixel by pixel."""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_core.data.video import (
    VideoError,
    VideoSettings,
    decode_video,
    encode_video,
    probe_video,
    sample_frame_indices,
    to_video_bytes,
)
from rft_core.data.vision import VideoDigitsDataset, digit_array, digits_data


def _frames(n: int, h: int = 24, w: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def _avi(frames: np.ndarray, fps: int = 2, encode: bool = True) -> bytes:
    """An MPEG-4 Part 2 AVI (its header declares the frame count); no frames when encode=False."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        c.start_encoding()
        if encode:
            for f in frames:
                c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
            c.mux(s.encode(None))
    return buf.getvalue()


def _webm(frames: np.ndarray, fps: int = 2) -> bytes:
    """A VP8 WebM (its header declares a duration, no frame count)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as c:
        s = c.add_stream("libvpx", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode(None))
    return buf.getvalue()


def test_encode_store_decode_round_trips_bit_exactly(tmp_path):
    frames = _frames(6, h=27, w=33)  # odd sizes too
    data = encode_video(frames, 3.0)
    assert encode_video(frames, 3.0) == data  # deterministic
    path = tmp_path / "a clip.mp4"
    path.write_bytes(data)
    forms = [data, bytearray(data), str(path), path, path.as_uri()]  # file:// URL with an escaped space
    stored = [to_video_bytes(v, where=f"row 0 video {k}") for k, v in enumerate(forms)]
    assert all(b == data for b in stored)
    # store as list<binary> in Parquet (what the prompts / rollout shards hold) and read back
    table = pa.table({"videos": pa.array([stored[:2], [], stored[2:3]], type=pa.list_(pa.binary()))})
    pq.write_table(table, tmp_path / "shard.parquet")
    back = pq.read_table(tmp_path / "shard.parquet").column("videos").to_pylist()
    assert back == [[data, data], [], [data]]
    # decoding the stored bytes gives the encoded pixels exactly (lossless RGB H.264)
    dec = decode_video(back[2][0], VideoSettings(fps=None, min_frames=1), temporal_patch_size=2)
    assert dec.indices == list(range(6)) and np.array_equal(dec.frames, frames)
    assert probe_video(data) == dec.info and (dec.info.num_frames, dec.info.fps, dec.info.height, dec.info.width) == (6, 3.0, 27, 33)
    assert dec.sampled_fps == 3.0


def test_frame_sampling_hand_checked():
    s = VideoSettings()  # fps 2, min_frames 4, max_frames 768
    # 12 frames at 2 fps, sample 1 fps: 12/2*1 = 6 frames, i*12//6
    assert sample_frame_indices(12, 2.0, VideoSettings(fps=1.0), 2) == [0, 2, 4, 6, 8, 10]
    # 10 frames at 30 fps: 10/30*2 = 0.67 -> min_frames 4 -> [i*10//4] = 0, 2, 5, 7
    assert sample_frame_indices(10, 30.0, s, 2) == [0, 2, 5, 7]
    # 7 frames at 2 fps: 7 -> floor to a multiple of 2 -> 6 frames: i*7//6
    assert sample_frame_indices(7, 2.0, s, 2) == [0, 1, 2, 3, 4, 5]
    # fps=None: every frame up to max_frames, floored to whole temporal patches
    assert sample_frame_indices(100, 25.0, VideoSettings(fps=None, min_frames=1, max_frames=6), 2) == [0, 16, 33, 50, 66, 83]
    assert sample_frame_indices(3, None, VideoSettings(fps=None), 2) == [0, 1]
    # fewer frames than a temporal patch: all of them (the processor repeats the last)
    assert sample_frame_indices(1, 2.0, s, 2) == [0]
    with pytest.raises(ValueError, match="no frame rate"):
        sample_frame_indices(5, None, s, 2)
    with pytest.raises(ValueError, match="min_frames <= max_frames, got min_frames=5, max_frames=3"):
        VideoSettings(min_frames=5, max_frames=3)
    with pytest.raises(ValueError, match="fps must be a positive number or None, got 0"):
        VideoSettings(fps=0)


def test_bad_videos_are_named(tmp_path):
    good = _avi(_frames(12, h=32, w=48))
    assert probe_video(good).num_frames == 12
    with pytest.raises(VideoError, match=r"row 3 video 1: not a decodable video \(11 bytes\)"):
        to_video_bytes(b"hello world", where="row 3 video 1")
    with pytest.raises(VideoError, match="row 3 video 0: empty video"):
        to_video_bytes(b"", where="row 3 video 0")
    # an AVI cut at 90%: its header still declares 12 frames, fewer decode
    with pytest.raises(VideoError, match="clip.avi: truncated or corrupt: the container declares 12 frames, [0-9]+ decode"):
        probe_video(good[: len(good) * 9 // 10], where="clip.avi")
    # a WebM has no frame count in its header: cut in half, 5 of its 12 frames (6 s at 2 fps) decode
    with pytest.raises(VideoError, match=r"clip.webm: truncated or corrupt: the container declares 6.000 s, "
                                         r"its 5 decodable frames span 2.500 s"):
        webm = _webm(_frames(12, h=32, w=48))
        probe_video(webm[: len(webm) // 2], where="clip.webm")
    # an MP4 cut in half loses its index (moov at the end): not decodable at all
    mp4 = encode_video(_frames(8), 2.0)
    with pytest.raises(VideoError, match="row 0 video 0: (not a decodable video|no video stream)"):
        to_video_bytes(mp4[: len(mp4) // 2], where="row 0 video 0")
    # a valid container with a video stream and zero frames
    with pytest.raises(VideoError, match="row 5 video 0: no decodable frames in [0-9]+ bytes"):
        to_video_bytes(_avi(_frames(1), encode=False), where="row 5 video 0")
    with pytest.raises(VideoError, match="only local files are read, got URL 'https://x/y.mp4'"):
        to_video_bytes("https://x/y.mp4")
    with pytest.raises(VideoError, match="cannot read"):
        to_video_bytes(tmp_path / "missing.mp4")
    with pytest.raises(VideoError, match="got int"):
        to_video_bytes(7)
    with pytest.raises(VideoError, match=r"frames must be a \(T>=1, H, W, 3\) uint8 array, got shape \(0, 4, 4, 3\)"):
        encode_video(np.zeros((0, 4, 4, 3), np.uint8), 2.0)


def test_video_digits_clips_are_seeded_and_show_the_moving_digit():
    _, targets = digits_data()
    ds = VideoDigitsDataset(30, seed=5, num_frames=4, fps=2.0)
    row = ds[3]
    assert row == VideoDigitsDataset(30, seed=5)[3] and row != VideoDigitsDataset(30, seed=6)[3]
    m = row["metadata"]
    assert row["answer"] == str(targets[m["digit_index"]]) == str(m["digit"]) and m["still_digit"] != m["digit"]
    assert row["question"] == "Which digit moves across the frame? Answer with the digit only."
    (video,) = row["videos"]
    dec = decode_video(video, VideoSettings(fps=None, min_frames=1), temporal_patch_size=2)
    assert dec.frames.shape == (4, 56, 84, 3) and dec.info.fps == 2.0
    grey = dec.frames[..., 0]
    assert np.array_equal(grey, dec.frames[..., 2])  # grey on black
    glyph, still = digit_array(m["digit_index"], 28), digit_array(m["still_index"], 28)
    sx, sy = m["still_xy"]
    y = m["lane_y"]
    assert {y, sy} == {0, 28}  # the two lanes
    xs = [0, 19, 37, 56]  # round(f * (84 - 28) / 3) for f = 0..3
    if m["direction"] == "right_to_left":
        xs = [56 - x for x in xs]
    for f, x in enumerate(xs):
        assert np.array_equal(grey[f, y:y + 28, x:x + 28], glyph), f
        assert np.array_equal(grey[f, sy:sy + 28, sx:sx + 28], still), f
        rest = grey[f].copy()
        rest[y:y + 28, x:x + 28] = 0
        rest[sy:sy + 28, sx:sx + 28] = 0
        assert not rest.any()  # nothing else drawn
    mixed = VideoDigitsDataset(40, seed=1, text_only_fraction=0.5)
    rows = [mixed[i] for i in range(40)]
    assert 8 <= sum(not r["videos"] for r in rows) <= 32
    for r in rows:
        if not r["videos"]:
            a, b = (int(v) for v in r["question"].split("What is ")[1].split("?")[0].split(" + "))
            assert r["answer"] == str(a + b)
    directions = {VideoDigitsDataset(40, seed=2)[i]["metadata"]["direction"] for i in range(12)}
    assert directions == {"left_to_right", "right_to_left"}
    with pytest.raises(ValueError, match="too small for 28px digits"):
        VideoDigitsDataset(5, frame_height=40)
    with pytest.raises(IndexError, match="vl_video_digits index 30 outside 0..29"):
        ds[30]
