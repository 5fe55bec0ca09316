"""Sample packing with vision-language inputs: one packed row of text / image / video /
image + two videos samples gives the padded batch's log-probs, entropies and gradients (tiny
random Qwen2-VL, and a tiny Qwen2.5-VL whose M-RoPE spaces video frames by
``second_per_grid_ts``), its M-RoPE positions are each sequence's own, and attention never
crosses sequences; the VL critic packs the same way."""
from __future__ import annotations

import pytest
import torch

from rft_core.models.critic import batched_response_values, load_critic
from rft_core.models.logprobs import (
    batched_response_logprobs,
    build_packed_batch,
    mrope_packed_position_ids,
    response_logprobs,
    with_vision,
)
from rft_core.models.vl import VLProcessor, build_tiny_qwen2_vl, load_vl_model
from tests.rft_core.models.test_vl_video import _mixed_rows, _tiny_qwen25_vl


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlp") / "tiny-vl")


def _rows(proc):
    seqs, images, videos = _mixed_rows(proc)
    prompts, responses = [s[:-3] for s in seqs], [s[-3:] for s in seqs]
    responses[1] = responses[1][:1]  # responses of other lengths
    return prompts, responses, images, videos


def _packed_equals_padded(path):
    proc = VLProcessor(path)
    model = load_vl_model(path)
    prompts, responses, images, videos = _rows(proc)
    kw = dict(pad_token_id=proc.tokenizer.pad_token_id, micro_batch_size=4, temperature=0.7, with_entropy=True,
              images=images, videos=videos, processor=proc)
    lp_pad, ent_pad = batched_response_logprobs(model, prompts, responses, **kw)
    lp_pack, ent_pack = batched_response_logprobs(model, prompts, responses, packing=True, **kw)
    for a, b, ea, eb, r in zip(lp_pad, lp_pack, ent_pad, ent_pack, responses):
        assert len(b) == len(r) and b == pytest.approx(a, abs=1e-5) and eb == pytest.approx(ea, rel=1e-5, abs=1e-5)
    return model, proc, prompts, responses, images, videos


def test_packed_vl_logprobs_equal_padded_and_positions_are_per_sequence(tiny_vl):
    model, proc, prompts, responses, images, videos = _packed_equals_padded(tiny_vl)
    batch = with_vision(build_packed_batch(prompts, responses), proc, images, videos)
    pos = mrope_packed_position_ids(model, batch)
    N = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    assert pos.shape == (4, 1, N) and torch.equal(pos[0], batch.position_ids)
    assert batch.media_counts == [(0, 0), (1, 0), (0, 1), (1, 2)]
    start = 0
    for p, r, im, vi in zip(prompts, responses, images, videos):  # each sequence's positions as if alone
        seq = torch.tensor([p + r])
        alone = proc.batch_inputs([im], seq, [vi])
        want, _ = model.model.get_rope_index(seq, mm_token_type_ids=alone["mm_token_type_ids"],
                                             image_grid_thw=alone.get("image_grid_thw"),
                                             video_grid_thw=alone.get("video_grid_thw"))
        assert torch.equal(pos[1:, :, start:start + seq.shape[1]], want), len(im)
        start += seq.shape[1]
    # the video row's positions jump where its clip is: not the text arange
    assert not torch.equal(pos[1, 0], pos[0, 0])
    # attention stays inside each sequence: the last sample packed behind the others gets its log-probs alone
    with torch.no_grad():
        together = response_logprobs(model, batch)[0][3]
        alone = response_logprobs(model, with_vision(build_packed_batch(prompts[3:], responses[3:]), proc, images[3:],
                                                     videos[3:]))[0][0]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_packed_vl_gradients_equal_padded(tiny_vl):
    proc = VLProcessor(tiny_vl)
    prompts, responses, images, videos = _rows(proc)
    grads = []
    for packing in (False, True):
        model = load_vl_model(tiny_vl, trainable=True)
        from rft_core.models.logprobs import build_token_batch

        b = (build_packed_batch(prompts, responses) if packing
             else build_token_batch(prompts, responses, pad_token_id=proc.tokenizer.pad_token_id))
        lp, _ = response_logprobs(model, with_vision(b, proc, images, videos))
        lp[b.action_mask].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 1e-3  # the vision tower and the language model both get gradient
    torch.testing.assert_close(grads[1], grads[0], atol=5e-5, rtol=1e-4)  # 1 of 1.66M at 2.1e-5 (float32 sums)


def test_packed_qwen25_vl_uses_the_time_spacing(tiny_vl, tmp_path):
    path = _tiny_qwen25_vl(tiny_vl, tmp_path / "tiny-qwen25-vl")
    model, proc, prompts, responses, images, videos = _packed_equals_padded(path)
    batch = with_vision(build_packed_batch(prompts, responses), proc, images, videos)
    assert batch.model_inputs["second_per_grid_ts"].tolist() == [1.0, 1.0, 0.5]  # packed = padded above with them
    base = mrope_packed_position_ids(model, batch)
    batch.model_inputs["second_per_grid_ts"] = batch.model_inputs["second_per_grid_ts"] * 3
    assert not torch.equal(mrope_packed_position_ids(model, batch)[1], base[1])  # temporal rows move


def test_packed_vl_critic_values_equal_padded(tiny_vl):
    proc = VLProcessor(tiny_vl)
    prompts, responses, images, videos = _rows(proc)
    critic = load_critic(tiny_vl)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(2))
    kw = dict(pad_token_id=proc.tokenizer.pad_token_id, micro_batch_size=4, processor=proc, images=images, videos=videos)
    padded = batched_response_values(critic, prompts, responses, **kw)
    packed = batched_response_values(critic, prompts, responses, packing=True, **kw)
    for a, b in zip(padded, packed):
        assert b == pytest.approx(a, abs=1e-5)
    with pytest.raises(ValueError, match="has no get_rope_index"):
        mrope_packed_position_ids(torch.nn.Linear(2, 2), with_vision(build_packed_batch(prompts, responses), proc,
                                                                     images, videos))
