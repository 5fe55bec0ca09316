"""Videos through the Prefect flows on the tiny random Qwen2-VL: one GRPO iteration on
``vl_video_digits`` (MP4 bytes bit-exact in the prompts and rollout shards, a mixed text / video
batch, reward functions given ``sample.videos``, a checkpoint that is still a VL folder with its
video settings), the held-out eval of a VL policy, and two PPO iterations with a VL critic (gae),
every log-prob, update and critic pass packed."""
from __future__ import annotations

from pathlib import Path

import pytest

from schemas import read_manifest, read_shard
from tests.flows.conftest import flow_cfg

TASK = {"num_frames": 4, "fps": 2.0, "frame_height": 56, "frame_width": 84, "digit_size": 28, "text_only_fraction": 0.3}


def clip_frames(sample) -> dict:
    """A python reward source that decodes the videos it is given: score 1 for a sample with a
    video (weighted 0 unless a test wants rewards that differ), how many frames the videos
    hold, and whether the moving digit's value (the row's metadata) is the reference."""
    from rft_core.data.video import VideoSettings, decode_video

    every = VideoSettings(fps=None, min_frames=1)
    frames = sum(len(decode_video(v, every, temporal_patch_size=2).frames) for v in sample.videos)
    matches = bool(sample.videos) and str(sample.metadata.get("digit")) == sample.reference
    return {"score": float(frames > 0), "frames": float(frames), "answer_is_digit": float(matches)}


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from rft_core.models.vl import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlvideo") / "tiny-vl")


def _cfg(tiny_vl, root, clip_weight: float = 0.0, **extra):
    recipe = [{"source": "exact"}, {"source": "clip", "weight": clip_weight}]
    return flow_cfg(tiny_vl, root, **{
        "data.task": "vl_video_digits", "data.size": 40, "data.task_config": TASK, "data.prompts_per_iteration": 4,
        "data.system_prompt": "", "rollout.n_samples_per_prompt": 3, "rollout.max_new_tokens": 4,
        "reward.sources": {"exact": {"type": "exact_match"},
                           "clip": {"type": "python", "function": f"{__name__}:clip_frames"}},
        "reward.recipes": {"vl_video_digits": recipe}, **extra})


def test_vl_video_iteration(prefect_harness, tiny_vl, tmp_path):
    from flows.train import train
    from rft_core.data.prompts import load_task
    from rft_core.models.vl import VIDEO_CONFIG_NAME, VLProcessor, is_vl_model

    cfg = _cfg(tiny_vl, tmp_path / "run", iterations=1)
    result = train(cfg)
    root = f"{cfg.run_root}/iter=000001"
    prompts = read_shard(f"{root}/prompts").to_pylist()
    rollout = read_shard(f"{root}/rollout").to_pylist()
    ds = load_task("vl_video_digits", size=40, seed=cfg.data.seed, task_config=TASK)
    proc = VLProcessor(tiny_vl)
    by_id = {p["prompt_id"]: p for p in prompts}
    assert len(rollout) == 12 and {len(p["videos"]) for p in prompts} == {0, 1}  # text-only and video prompts
    for p in prompts:  # the dataset's MP4 bytes, bit-exact, and 12 video tokens per clip (2 x 4 x 6 / 4)
        assert p["videos"] == ds[int(p["prompt_id"].rsplit("-", 1)[1])]["videos"]
        assert p["prompt_token_ids"].count(proc.video_token_id) == 12 * len(p["videos"])
    for r in rollout:
        assert r["videos"] == by_id[r["prompt_id"]]["videos"]
        assert r["prompt_token_ids"] == by_id[r["prompt_id"]]["prompt_token_ids"]
    rewards = {w["sample_id"]: dict(w["reward_metrics"]) for w in read_shard(f"{root}/rewards").to_pylist()}
    for r in rollout:  # the reward function decoded each sample's own clip: 4 frames per video
        m = rewards[r["sample_id"]]
        assert m["clip.frames"] == 4.0 * len(r["videos"]) and m["clip.answer_is_digit"] == float(bool(r["videos"]))
    assert read_shard(f"{root}/actor_logprobs").num_rows == 12 and read_shard(f"{root}/ppo_update").num_rows >= 1
    ckpt = Path(result.final_policy_folder)
    assert is_vl_model(str(ckpt)) and (ckpt / VIDEO_CONFIG_NAME).is_file()
    again = VLProcessor(str(ckpt))  # the checkpoint counts video tokens as its parent
    assert again.video == proc.video and again.video_token_id == proc.video_token_id


def test_vl_video_eval(prefect_harness, tiny_vl, tmp_path):
    from flows.eval import evaluate
    from rft_core.data.prompts import load_task, prompt_key

    cfg = _cfg(tiny_vl, tmp_path / "run", **{"eval.num_prompts": 5, "eval.max_new_tokens": 3, "eval.batch_size": 2})
    out = tmp_path / "ev"
    res = evaluate(cfg, None, str(out))
    rows = read_shard(f"{out}/eval", stage="eval").to_pylist()
    assert len(rows) == res.num_prompts == 5 and all(1 <= r["response_length"] <= 3 for r in rows)
    prompts = read_shard(f"{out}/prompts", stage="prompts").to_pylist()
    rollout = read_shard(f"{out}/rollout", stage="rollout").to_pylist()
    assert [r["videos"] for r in rollout] == [p["videos"] for p in prompts] and any(p["videos"] for p in prompts)
    assert read_manifest(f"{out}/rollout")[0].summary["decoding"] == "greedy"
    assert res.accuracy == sum(r["correct"] for r in rows) / 5
    # held out by question and clip: no held-out prompt is a training prompt
    train = load_task("vl_video_digits", size=40, seed=cfg.data.seed, task_config=TASK)
    seen = {prompt_key(train[i]) for i in range(40)}
    held = load_task("vl_video_digits", size=10 ** 6, seed=read_manifest(f"{out}/prompts")[0].summary["heldout_seed"],
                     task_config=TASK)
    for p in prompts:
        entry = held[int(p["prompt_id"].rsplit("-", 1)[1])]
        assert entry["videos"] == p["videos"] and prompt_key(entry) not in seen


@pytest.mark.rotation(0)  # long: one turn in 8 (tests/rotation.py); the video and critic flows run every time
def test_vl_critic_gae_two_iterations(prefect_harness, tiny_vl, tmp_path):
    from flows.train import train
    from rft_core.models.critic import VALUE_HEAD_FILE, VLValueModel, load_critic
    from rft_core.models.vl import VIDEO_CONFIG_NAME

    # rewards: 1 for a video sample, 0 for a text one (the random policy never answers right), so
    # the returns differ from the fresh critic's V = 0 and the critic has something to fit
    cfg = _cfg(tiny_vl, tmp_path / "run", clip_weight=1.0, iterations=2, **{"advantage.estimator": "gae", "advantage.gae_lambda": 0.9,
                                                           "critic.lr": 1e-2, "kl.kl_coef": 0.0,
                                                           # every pass packed: M-RoPE positions per sequence
                                                           "logprobs.packing": True, "update.packing": True,
                                                           "critic.packing": True})
    result = train(cfg)
    root = cfg.run_root
    rollout = read_shard(f"{root}/iter=000001/rollout").to_pandas().set_index("sample_id")
    v1 = read_shard(f"{root}/iter=000001/critic_values").to_pandas()
    assert all(x == 0.0 for row in v1["values"] for x in row)  # a fresh VL critic's value head is zero
    assert [len(v) for v in v1["values"]] == [len(rollout.response_token_ids[s]) for s in v1.sample_id]
    v2 = read_shard(f"{root}/iter=000002/critic_values").to_pandas()
    assert any(abs(x) > 1e-6 for row in v2["values"] for x in row)  # iteration 2 reads the trained critic
    upd2, _ = read_manifest(f"{root}/iter=000002/critic_update")
    assert upd2.inputs["critic"] == read_manifest(f"{root}/iter=000001/critic_update")[1]
    ckpt = Path(f"{result.final_critic.uri}/critic")
    assert (ckpt / VALUE_HEAD_FILE).is_file() and (ckpt / VIDEO_CONFIG_NAME).is_file()
    assert isinstance(load_critic(str(ckpt)), VLValueModel) and result.metrics[1]["value_loss"] > 0
