"""Vision-language pieces: image normalisation, the digits task, the tiny Qwen2-VL, and the
placeholder / patch-grid bookkeeping (hand-checked counts) for mixed and multi-image batches."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from rft_core.data.images import ImageError, decode_image, to_image_bytes
from rft_core.data.vision import DIGITS_FILE, DigitsDataset, digit_png, digits_data
from rft_core.models.vl import IMAGE_PAD, VLError, build_tiny_qwen2_vl, VLProcessor


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vl") / "tiny-vl")


@pytest.fixture(scope="module")
def proc(tiny_vl):
    return VLProcessor(tiny_vl)


def _png(w: int, h: int, value: int = 128) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (value, 0, 255 - value)).save(buf, format="PNG")
    return buf.getvalue()


def test_image_inputs_of_every_form_round_trip(tmp_path):
    data = _png(30, 20)
    path = tmp_path / "a b.png"
    path.write_bytes(data)
    assert to_image_bytes(data) == data
    assert to_image_bytes(str(path)) == data and to_image_bytes(path) == data
    assert to_image_bytes(path.as_uri()) == data  # file:// URL (with an escaped space)
    pil = decode_image(data)
    again = to_image_bytes(pil)
    assert np.array_equal(np.asarray(decode_image(again)), np.asarray(pil)) and pil.size == (30, 20)
    with pytest.raises(ImageError, match="only local files are read, got URL 'http://x/y.png'"):
        to_image_bytes("http://x/y.png")
    with pytest.raises(ImageError, match="cannot read"):
        to_image_bytes(tmp_path / "missing.png")
    with pytest.raises(ImageError, match=r"row 3 image 0: not a decodable image \(5 bytes\)"):
        to_image_bytes(b"hello", where="row 3 image 0")
    with pytest.raises(ImageError, match="got int"):
        to_image_bytes(7)


def test_digits_file_is_scikit_learns_load_digits():
    """The shipped digits.csv.gz is scikit-learn 1.9.1's, byte for byte, read as load_digits reads it."""
    import hashlib

    images, targets = digits_data()
    assert hashlib.sha256(DIGITS_FILE.read_bytes()).hexdigest() == (
        "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22")
    assert images.shape == (1797, 8, 8) and images.dtype == np.float64 and targets.shape == (1797,)
    assert np.bincount(targets).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert images[0, 1].tolist() == [0, 0, 13, 15, 10, 15, 5, 0] and targets[0] == 0 and images.max() == 16
    assert not images.flags.writeable and not targets.flags.writeable
    assert DIGITS_FILE.with_name("digits.LICENSE.txt").read_text().count("BSD 3-Clause License") == 1


def test_digits_task_is_seeded_and_correct():
    images, targets = digits_data()
    ds = DigitsDataset(50, seed=3)
    row = ds[7]
    assert row == DigitsDataset(50, seed=3)[7] and row != DigitsDataset(50, seed=4)[7]
    (idx,) = row["metadata"]["digit_indices"]
    assert row["answer"] == str(targets[idx]) and row["metadata"]["digits"] == [int(targets[idx])]
    img = np.asarray(decode_image(row["images"][0]).convert("L"))
    assert img.shape == (28, 28)
    # nearest upscaling 8 -> 28: the pixel at each source cell's centre is that cell, scaled to 0..255
    centres = [int((j + 0.5) * 28 / 8) for j in range(8)]
    assert np.array_equal(img[np.ix_(centres, centres)], np.round(images[idx] * 255 / 16).astype(np.uint8))
    two = DigitsDataset(40, seed=1, images_per_prompt=2, text_only_fraction=0.5)
    rows = [two[i] for i in range(40)]
    text = [r for r in rows if not r["images"]]
    assert 8 <= len(text) <= 32  # about half are text-only
    for r in rows:
        if r["images"]:
            assert len(r["images"]) == 2 and r["answer"] == str(sum(r["metadata"]["digits"]))
        else:
            a, b = (int(x) for x in r["question"].split("What is ")[1].split("?")[0].split(" + "))
            assert r["answer"] == str(a + b)
    with pytest.raises(ValueError, match="images_per_prompt must be 1 or 2, got 3"):
        DigitsDataset(5, images_per_prompt=3)
    assert digit_png(0, 28) == digit_png(0, 28)


def test_tokens_per_image_hand_checked(proc):
    # 28x28 -> resized to the 56*56 minimum -> 4x4 patches of 14 -> 16 patches -> 16/2^2 = 4 tokens
    # 112x56 -> 8x4 patches = 32 -> 8 tokens; 112x112 is the maximum: 8x8 = 64 patches -> 16 tokens
    v = proc.process_images([_png(28, 28), _png(112, 56), _png(112, 112)])
    assert v["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8], [1, 8, 8]]
    assert v["pixel_values"].shape == (16 + 32 + 64, 3 * 2 * 14 * 14)
    assert proc.tokens_per_image(v["image_grid_thw"]) == [4, 8, 16]


def test_prompt_expansion_and_mismatch(proc):
    text = proc.render_prompt("Which digit?", 2)
    ids = proc.prompt_ids(text, [_png(28, 28), _png(112, 56)])
    assert ids.count(proc.image_token_id) == 4 + 8
    pos = [i for i, t in enumerate(ids) if t == proc.image_token_id]
    assert pos[3] + 1 < pos[4]  # the two images' tokens are separate runs (end + start tokens between)
    assert text.count(IMAGE_PAD) == 2
    with pytest.raises(VLError, match="prompt has 2 <\\|image_pad\\|> placeholders but 1 images"):
        proc.prompt_ids(text, [_png(28, 28)])


def _rows(proc):
    specs = [("What is 2 + 3?", []), ("Sum of the digits?", [_png(28, 28, 10), _png(112, 56, 200)]),
             ("Which digit?", [_png(56, 56, 90)])]
    ids = [proc.prompt_ids(proc.render_prompt(q, len(imgs)), imgs) for q, imgs in specs]
    return ids, [imgs for _, imgs in specs]


def test_mixed_batch_bookkeeping_and_row_independence(proc, tiny_vl):
    from rft_core.models.vl import load_vl_model

    ids, images = _rows(proc)
    pad = proc.tokenizer.pad_token_id
    L = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])
    batch = proc.batch_inputs(images, input_ids)
    # row 0: none; row 1: 16 + 32 patches; row 2: 16 patches -> 64 rows in row order
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8], [1, 4, 4]]
    assert batch["pixel_values"].shape[0] == 64
    assert batch["mm_token_type_ids"].sum(1).tolist() == [0, 12, 4]
    model = load_vl_model(tiny_vl)
    with torch.no_grad():
        together = model(input_ids=input_ids, attention_mask=mask, **batch).logits
        for r in range(3):
            alone_ids = torch.tensor([ids[r]])
            alone = model(input_ids=alone_ids, attention_mask=torch.ones_like(alone_ids),
                          **proc.batch_inputs([images[r]], alone_ids)).logits[0]
            assert torch.allclose(together[r, L - len(ids[r]):], alone, atol=1e-5), r
    # wrong bookkeeping (images of another row) is caught
    with pytest.raises(VLError, match="batch row 1: 12 image tokens in the ids but its 1 image\\(s\\) need 4"):
        proc.batch_inputs([[], images[2], images[1]], input_ids)


def test_prompt_shard_holds_images_bit_exact(tiny_vl, tiny_model, tmp_path):
    from rft_core import stages
    from rft_core.config import load_config
    from rft_core.stages.contracts import PromptsInput
    from rft_core.data.prompts import DatasetError, build_prompts, load_task
    from schemas import read_shard

    cfg = load_config(None, {"data.task": "vl_digits", "data.size": 50, "data.prompts_per_iteration": 12,
                             "data.task_config": {"images_per_prompt": 2, "text_only_fraction": 0.3}})
    ref = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_vl, iteration=1, out=str(tmp_path / "prompts")))
    rows = read_shard(ref).to_pylist()
    ds = load_task("vl_digits", size=50, seed=cfg.data.seed, task_config=dict(cfg.data.task_config))
    proc = VLProcessor(tiny_vl)
    kinds = set()
    for row in rows:
        entry = ds[int(row["prompt_id"].rsplit("-", 1)[1])]
        assert row["images"] == entry["images"]  # bytes stored bit-exact
        # 28x28 digits -> 4 tokens each
        assert row["prompt_token_ids"].count(proc.image_token_id) == 4 * len(entry["images"])
        kinds.add(len(row["images"]))
    assert kinds == {0, 2}  # text-only and two-image prompts in one shard
    with pytest.raises(DatasetError, match="vl_digits row 0 has 2 image\\(s\\) but the policy is a text-only model"):
        from rft_core.models.loading import load_tokenizer

        build_prompts([(0, ds[0] if ds[0]["images"] else ds[1])], load_tokenizer(tiny_model), data_source="vl_digits",
                      system_prompt="", max_prompt_tokens=256)


def test_vl_rollout_logprobs_match_the_actor_pass_on_a_mixed_batch(tiny_vl):
    """The engine's log-probs of sampled tokens (generate with pixel_values) equal a teacher-forced
    forward with the same images: images, grids and M-RoPE positions line up per row, in a batch
    that mixes text-only, one-image and two-image prompts."""
    from rft_core.engines.hf import HFEngine
    from rft_core.models.logprobs import batched_response_logprobs
    from rft_core.models.vl import load_vl_model

    proc = VLProcessor(tiny_vl)
    ids, images = _rows(proc)
    model = load_vl_model(tiny_vl)
    engine = HFEngine(model, proc.tokenizer)
    gens = engine.generate(ids, n_samples_per_prompt=2, max_new_tokens=6, temperature=1.0, batch_size=4, seed=3,
                           images=images, processor=proc)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(3) for k in range(2)]
    prompts = [ids[g.prompt_index] for g in gens]
    responses = [g.response_token_ids for g in gens]
    lps = batched_response_logprobs(model, prompts, responses, pad_token_id=proc.tokenizer.pad_token_id, micro_batch_size=3,
                                    images=[images[g.prompt_index] for g in gens], processor=proc)
    for g, lp in zip(gens, lps):
        assert len(lp) == len(g.logprobs) > 0
        assert np.allclose(lp, g.logprobs, atol=1e-4), (g.prompt_index, lp, g.logprobs)
    with pytest.raises(ValueError, match="images need a processor and one list per prompt: 2 lists for 3 prompts"):
        engine.generate(ids, n_samples_per_prompt=1, max_new_tokens=2, images=images[:2], processor=proc)
