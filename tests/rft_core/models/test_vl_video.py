"""Videos in the Qwen2-VL path: hand-checked patch grids and token counts, the patch layout
against the image processor, placeholder expansion, and mixed text / image / video /
image+video batches through the tiny random Qwen2-VL (and a tiny Qwen2.5-VL, whose M-RoPE uses
``second_per_grid_ts``) giving each row the logits it gets alone."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from rft_core.data.video import VideoError, encode_video
from rft_core.models.vl import (
    IMAGE_PAD,
    VIDEO_PAD,
    VLError,
    VLProcessor,
    build_tiny_qwen2_vl,
    load_vl_model,
)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vl") / "tiny-vl")


@pytest.fixture(scope="module")
def proc(tiny_vl):
    return VLProcessor(tiny_vl)  # pixels 56*56 .. 112*112 (the image processor's), fps 2, frames 4 .. 768


def _clip(n: int, h: int, w: int, fps: float = 2.0, seed: int = 0) -> bytes:
    return encode_video(np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8), fps)


def _png(w: int, h: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_video_grids_and_token_counts_hand_checked(proc, tiny_vl):
    assert (proc.video.min_pixels, proc.video.max_pixels, proc.video.fps) == (56 * 56, 112 * 112, 2.0)
    videos = [
        # 4 frames at 2 fps -> 4/2*2 = 4 frames -> t = 4/2 = 2; 56x84 is a multiple of 28 within the
        # pixel bounds -> 4x6 patches of 14 -> 2*4*6 / 2^2 = 12 tokens
        _clip(4, 56, 84),
        # 1 frame: t = ceil(1/2) = 1 (the last frame repeated); 28x28 = 784 < 3136 pixels ->
        # scale by sqrt(3136/784) = 2 -> 56x56 -> 4x4 patches -> 4 tokens
        _clip(1, 28, 28),
        # 10 frames at 10 fps -> 10/10*2 = 2 -> min_frames 4 -> t = 2; 140x140 = 19600 > 12544 ->
        # beta = sqrt(19600/12544) = 1.25, floor(140/1.25/28)*28 = 112 -> 8x8 patches -> 2*64/4 = 32
        _clip(10, 140, 140, fps=10.0),
        # 7 frames at 2 fps -> 7 -> floored to 6 -> t = 3; 30x50 -> round to 28x56 = 1568 < 3136 ->
        # beta = sqrt(3136/1500), ceil(30*1.4459/28)*28 = 56, ceil(50*1.4459/28)*28 = 84 -> 4x6 -> 3*24/4 = 18
        _clip(7, 30, 50),
    ]
    out = proc.process_videos(videos)
    grids = [[2, 4, 6], [1, 4, 4], [2, 8, 8], [3, 4, 6]]
    assert out["video_grid_thw"].tolist() == grids and out["video_grid_thw"].dtype == torch.long
    assert proc.tokens_per_video(out["video_grid_thw"]) == [12, 4, 32, 18]
    assert out["pixel_values_videos"].shape == (48 + 16 + 128 + 72, 3 * 2 * 14 * 14)
    assert out["pixel_values_videos"].dtype == torch.float32 and "second_per_grid_ts" not in out  # Qwen2-VL
    assert [proc.video_grid(v) for v in videos] == grids  # the cheap count the prompt stage uses
    # settings: fps=None keeps every frame up to max_frames=4 -> 7 frames -> 4 -> t = 2
    p2 = VLProcessor(tiny_vl, video={"fps": None, "max_frames": 4, "min_frames": 1})
    assert p2.video_grid(videos[3]) == [2, 4, 6]
    with pytest.raises(VLError, match=r"unknown video setting\(s\) \['frames'\]"):
        VLProcessor(tiny_vl, video={"frames": 3})


def test_video_patch_layout_matches_the_image_processor(proc):
    """A frame's patches sit at temporal slot (frame index mod 2) of the video rows; a 1-frame
    video repeats its frame in both slots, exactly as the image processor does for an image."""
    frames = np.random.default_rng(1).integers(0, 256, size=(2, 56, 84, 3), dtype=np.uint8)
    pngs = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    img = proc.process_images(pngs)["pixel_values"].reshape(2, 24, 3, 2, 14, 14)  # (frame, patch, C, slot, p, p)
    two = proc.process_videos([encode_video(frames, 1.0)])  # 2 frames at 1 fps: both kept
    vid = two["pixel_values_videos"].reshape(24, 3, 2, 14, 14)
    assert two["video_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.equal(vid[:, :, 0], img[0, :, :, 0]) and torch.equal(vid[:, :, 1], img[1, :, :, 0])
    one = proc.process_videos([encode_video(frames[:1], 2.0)])
    assert torch.equal(one["pixel_values_videos"], proc.process_images(pngs[:1])["pixel_values"])


def test_prompt_expansion_with_images_and_videos(proc):
    text = proc.render_prompt("Which digit moves?", 1, n_videos=2)
    assert text.count(IMAGE_PAD) == 1 and text.count(VIDEO_PAD) == 2
    assert text.index(IMAGE_PAD) < text.index(VIDEO_PAD)
    ids = proc.prompt_ids(text, [_png(56, 56)], [_clip(4, 56, 84), _clip(1, 28, 28)])
    assert ids.count(proc.image_token_id) == 4 and ids.count(proc.video_token_id) == 12 + 4
    vpos = [i for i, t in enumerate(ids) if t == proc.video_token_id]
    assert max(i for i, t in enumerate(ids) if t == proc.image_token_id) < vpos[0]
    assert vpos[11] + 1 < vpos[12]  # the two videos are separate runs
    with pytest.raises(VLError, match=r"row 7: prompt has 2 <\|video_pad\|> placeholders but 1 videos"):
        proc.prompt_ids(text, [_png(56, 56)], [_clip(4, 56, 84)], where="row 7")
    with pytest.raises(VideoError, match=r"row 7 video 1: not a decodable video \(3 bytes\)"):
        proc.prompt_ids(text, [_png(56, 56)], [_clip(4, 56, 84), b"xyz"], where="row 7")


def _mixed_rows(proc):
    """Rows: text only, one image, one video, an image and two videos; 3 response tokens each. The
    last video is 10 frames at 10 fps (4 kept: 0.5 s per temporal patch, Qwen2.5-VL's
    ``second_per_grid_ts``), the others 2 fps (1.0 s), so a video given another's time spacing
    (a wrong offset into the batch's videos) changes the positions."""
    specs = [("What is 2 + 3?", [], []),
             ("Which digit?", [_png(56, 56, 1)], []),
             ("Which digit moves?", [], [_clip(4, 56, 84, seed=2)]),
             ("Same digit?", [_png(28, 28, 3)], [_clip(6, 56, 56, seed=4), _clip(10, 28, 28, fps=10.0, seed=5)])]
    rng = np.random.default_rng(0)
    seqs = [proc.prompt_ids(proc.render_prompt(q, len(i), n_videos=len(v)), i, v) + [int(t) for t in rng.integers(100, 5000, 3)]
            for q, i, v in specs]
    return seqs, [i for _, i, _ in specs], [v for _, _, v in specs]


def _padded(seqs, pad):
    L = max(map(len, seqs))
    ids = torch.tensor([[pad] * (L - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def _check_rows_alone(model, proc, seqs, images, videos, atol=1e-5):
    ids, mask = _padded(seqs, proc.tokenizer.pad_token_id)
    batch = proc.batch_inputs(images, ids, videos)
    with torch.no_grad():
        together = model(input_ids=ids, attention_mask=mask, **batch).logits
        for r, s in enumerate(seqs):
            alone_ids = torch.tensor([s])
            alone = model(input_ids=alone_ids, attention_mask=torch.ones_like(alone_ids),
                          **proc.batch_inputs([images[r]], alone_ids, [videos[r]])).logits[0]
            assert torch.allclose(together[r, ids.shape[1] - len(s):], alone, atol=atol), r
    return ids, mask, batch


def test_mixed_batch_gives_each_row_its_own_logits(proc, tiny_vl):
    seqs, images, videos = _mixed_rows(proc)
    model = load_vl_model(tiny_vl)
    ids, _, batch = _check_rows_alone(model, proc, seqs, images, videos)
    # images and videos in row order: row 1's 56x56 image, row 3's 28x28 image (-> 56x56);
    # row 2's 4x56x84 clip, row 3's 6x56x56 clip (6 frames -> t = 3) and 10x28x28 clip at 10 fps (4 frames
    # kept at 2 fps -> t = 2; 28x28 -> 56x56)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert batch["video_grid_thw"].tolist() == [[2, 4, 6], [3, 4, 4], [2, 4, 4]]
    assert batch["pixel_values"].shape[0] == 32 and batch["pixel_values_videos"].shape[0] == 48 + 48 + 32
    types = batch["mm_token_type_ids"]
    assert types.dtype == torch.int32
    assert (types == 1).sum(1).tolist() == [0, 4, 0, 4] and (types == 2).sum(1).tolist() == [0, 0, 12, 12 + 8]
    with pytest.raises(VLError, match=r"batch row 1: 0 video tokens in the ids but its 1 video\(s\) need 12"):
        proc.batch_inputs(images, ids, [[], videos[2], [], videos[3]])
    with pytest.raises(VLError, match="batch of 4 rows got 4 image lists and 3 video lists"):
        proc.batch_inputs(images, ids, videos[:3])
    with pytest.raises(VideoError, match="batch row 3 video 1: not a decodable video"):
        proc.batch_inputs(images, ids, [[], [], videos[2], [videos[3][0], b"junk"]])


def test_generation_with_videos_matches_a_teacher_forced_pass(proc, tiny_vl):
    """Greedy ``generate`` with video inputs (its M-RoPE deltas carried across steps) scores its
    tokens as a full forward over prompt + response does, per row of a mixed batch."""
    seqs, images, videos = _mixed_rows(proc)
    prompts = [s[:-3] for s in seqs]
    model = load_vl_model(tiny_vl)
    ids, mask = _padded(prompts, proc.tokenizer.pad_token_id)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                             pad_token_id=proc.tokenizer.pad_token_id, return_dict_in_generate=True, output_logits=True,
                             **proc.batch_inputs(images, ids, videos))
        step = torch.stack(gen.logits, dim=1).float().log_softmax(-1)  # (B, 4, V)
        full_mask = torch.cat([mask, torch.ones(len(prompts), 4, dtype=mask.dtype)], dim=1)
        forward = model(input_ids=gen.sequences, attention_mask=full_mask,
                        **proc.batch_inputs(images, gen.sequences, videos)).logits.float().log_softmax(-1)
    P = ids.shape[1]
    assert torch.allclose(forward[:, P - 1:-1], step, atol=1e-4)


def _tiny_qwen25_vl(src: str, out) -> str:
    """A tiny random Qwen2.5-VL beside the tiny Qwen2-VL: same tokenizer and image processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    shutil.copytree(src, out)
    base = json.loads((out / "config.json").read_text())
    text = {k: base["text_config"][k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}, **text},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [0], "tokens_per_second": 2},
        **{k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(out)
    return str(out)


def test_qwen25_vl_gets_second_per_grid_ts(tiny_vl, tmp_path):
    path = _tiny_qwen25_vl(tiny_vl, tmp_path / "tiny-qwen25-vl")
    proc = VLProcessor(path)
    assert proc.video_time_scaled
    # 2 / sampled fps: 4 frames at 2 fps keep all (2 fps -> 1.0 s per temporal patch); 10 frames
    # at 10 fps keep 4 (sampled fps 4/10*10 = 4 -> 0.5 s); 1 frame at 2 fps -> 1.0 s
    out = proc.process_videos([_clip(4, 56, 84), _clip(10, 56, 56, fps=10.0), _clip(1, 28, 28)])
    assert out["second_per_grid_ts"].tolist() == [1.0, 0.5, 1.0]
    seqs, images, videos = _mixed_rows(proc)
    model = load_vl_model(path)
    ids, mask, batch = _check_rows_alone(model, proc, seqs, images, videos)
    assert batch["second_per_grid_ts"].tolist() == [1.0, 1.0, 0.5]  # 4 @ 2 fps, 6 @ 2 fps, 10 @ 10 fps
    with torch.no_grad():  # the time spacing reaches the model's M-RoPE: another spacing, other logits
        base = model(input_ids=ids, attention_mask=mask, **batch).logits
        other = model(input_ids=ids, attention_mask=mask, **{**batch, "second_per_grid_ts": batch["second_per_grid_ts"] * 3}).logits
    assert not torch.allclose(base[2], other[2], atol=1e-4)  # row 2 has a video
    assert torch.allclose(base[1], other[1], atol=1e-6)  # row 1 has none


def test_video_settings_are_saved_with_the_checkpoint(tiny_vl, tmp_path):
    proc = VLProcessor(tiny_vl, video={"fps": 1.0, "max_frames": 8, "max_pixels": 84 * 84})
    proc.save_pretrained(tmp_path / "ckpt")
    shutil.copy(f"{tiny_vl}/config.json", tmp_path / "ckpt" / "config.json")
    saved = json.loads((tmp_path / "ckpt" / "video_preprocessor_config.json").read_text())
    assert saved["size"] == {"shortest_edge": 3136, "longest_edge": 7056} and saved["fps"] == 1.0
    again = VLProcessor(str(tmp_path / "ckpt"))
    assert again.video == proc.video
    clip = _clip(8, 112, 112)
    # 8 frames at 2 fps, 1 fps -> 4 frames -> t = 2; 112x112 > 84*84 -> beta = 112/84, 84x84 -> 6x6 -> 2*36/4 = 18
    assert again.video_grid(clip) == proc.video_grid(clip) == [2, 6, 6]
