"""Videos through the prompts and rollout stages on the tiny random Qwen2-VL: the encoded bytes
round-trip bit-exactly through both shards with hand-checked video token counts, and bad videos
(unreadable, truncated, no frames, or any video for a text-only policy) stop the prompts stage
with an error naming the file, the row and the video before anything is committed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rft_core.config import DataConfig, RolloutConfig
from rft_core.data.prompts import DatasetError, load_task
from rft_core.data.video import encode_video
from rft_core.models.vl import VLProcessor, build_tiny_qwen2_vl
from rft_core.stages.contracts import PromptsInput, RolloutInput
from rft_core.stages.prompts import run as run_prompts
from rft_core.stages.rollout import run as run_rollout
from schemas import read_shard
from tests.rft_core.data.test_video import _avi, _frames

TASK = {"num_frames": 4, "fps": 2.0, "frame_height": 56, "frame_width": 84, "digit_size": 28, "text_only_fraction": 0.3}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vls") / "tiny-vl")


def test_video_bytes_round_trip_through_prompts_and_rollout(tiny_vl, tmp_path):
    data = DataConfig(task="vl_video_digits", size=30, seed=5, task_config=TASK, prompts_per_iteration=5,
                      system_prompt="", max_prompt_tokens=256)
    prompts_ref = run_prompts(PromptsInput(data=data, tokenizer_path=tiny_vl, iteration=1, out=str(tmp_path / "prompts")))
    prompts = read_shard(prompts_ref, stage="prompts").to_pylist()
    ds = load_task("vl_video_digits", size=30, seed=5, task_config=TASK)
    proc = VLProcessor(tiny_vl)
    kinds = set()
    for p in prompts:
        entry = ds[int(p["prompt_id"].rsplit("-", 1)[1])]
        assert p["videos"] == entry["videos"] and p["images"] == []  # the encoded MP4 bytes, bit-exact
        kinds.add(len(p["videos"]))
        # 4 frames at 2 fps, all kept -> t = 2; 56x84 -> 4x6 patches of 14 -> 2*4*6 / 2^2 = 12 tokens
        assert p["prompt_token_ids"].count(proc.video_token_id) == 12 * len(p["videos"])
    assert kinds == {0, 1}  # text-only and video prompts in one shard
    rollout_ref = run_rollout(RolloutInput(prompts=prompts_ref, policy=tiny_vl, iteration=1, out=str(tmp_path / "rollout"),
                                           rollout=RolloutConfig(n_samples_per_prompt=2, max_new_tokens=3, batch_size=4)))
    rollout = read_shard(rollout_ref, stage="rollout").to_pylist()
    by_id = {p["prompt_id"]: p for p in prompts}
    assert len(rollout) == 10
    for r in rollout:
        assert r["videos"] == by_id[r["prompt_id"]]["videos"] and r["prompt_token_ids"] == by_id[r["prompt_id"]]["prompt_token_ids"]
        assert len(r["rollout_logprobs"]) == len(r["response_token_ids"]) > 0
    with pytest.raises(ValueError, match="rollout.engine='vllm' does not take images or videos"):
        run_rollout(RolloutInput(prompts=prompts_ref, policy=tiny_vl, iteration=1, out=str(tmp_path / "rollout-vllm"),
                                 rollout=RolloutConfig(engine="vllm")))
    assert not (tmp_path / "rollout-vllm" / "_MANIFEST.json").exists()


def _bad_cases(tmp: Path) -> dict[str, tuple[bytes, str]]:
    good_avi = _avi(_frames(12, h=32, w=48))
    return {
        "unreadable": (b"this is not a video", r"not a decodable video \(19 bytes\)"),
        "truncated": (good_avi[: len(good_avi) * 9 // 10], "truncated or corrupt: the container declares 12 frames"),
        "no_frames": (_avi(_frames(1), encode=False), r"no decodable frames in [0-9]+ bytes"),
    }


@pytest.mark.parametrize("case", ["unreadable", "truncated", "no_frames"])
def test_bad_videos_stop_the_prompts_stage_before_the_commit(tiny_vl, tmp_path, case):
    data_bytes, why = _bad_cases(tmp_path)[case]
    good = tmp_path / "good.mp4"
    good.write_bytes(encode_video(np.zeros((4, 56, 56, 3), np.uint8), 2.0))
    bad = tmp_path / f"{case}.mp4"
    bad.write_bytes(data_bytes)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Which digit moves?", "answer": "3", "videos": [str(good), str(bad)]}) + "\n")
    data = DataConfig(source="files", path=str(rows), prompts_per_iteration=1, system_prompt="")
    out = tmp_path / "prompts"
    with pytest.raises(DatasetError, match=f"rows.jsonl line 1 \\(row 0\\).*row 0 video 1 \\(.*{case}.mp4\\): {why}"):
        run_prompts(PromptsInput(data=data, tokenizer_path=tiny_vl, iteration=1, out=str(out)))
    assert not (out / "_MANIFEST.json").exists() and not list(out.glob("*.parquet"))


def test_a_video_for_a_text_only_policy_is_refused(tiny_model, tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(encode_video(np.zeros((4, 56, 56, 3), np.uint8), 2.0))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "Which digit moves?", "answer": "3", "videos": [str(clip)]}) + "\n")
    data = DataConfig(source="files", path=str(rows), prompts_per_iteration=2, system_prompt="")
    out = tmp_path / "prompts"
    with pytest.raises(DatasetError, match="rows.jsonl line 2 \\(row 1\\).*has 1 video\\(s\\) but the policy is a text-only model"):
        run_prompts(PromptsInput(data=data, tokenizer_path=tiny_model, iteration=1, out=str(out)))
    assert not (out / "_MANIFEST.json").exists()
