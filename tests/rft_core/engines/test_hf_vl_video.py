"""The HF engine on a mixed vision-language batch (text only / image / video / image + two videos)
with the tiny random Qwen2-VL: the rollout log-probs equal the actor pass
(``batched_response_logprobs``, padded and packed) sample by sample; greedy decoding (the eval stage's path) picks
each row's argmax and scores it at temperature 1; media without a processor are refused."""
from __future__ import annotations

import pytest
import torch

from rft_core.engines.hf import HFEngine
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.models.vl import VLProcessor, build_tiny_qwen2_vl, load_vl_model
from rft_core.stages.evaluate import greedy_generate
from tests.rft_core.models.test_vl_video import _mixed_rows


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vl") / "tiny-vl")
    proc = VLProcessor(path)
    seqs, images, videos = _mixed_rows(proc)
    return load_vl_model(path), proc, [s[:-3] for s in seqs], images, videos


def test_rollout_logprobs_equal_the_actor_pass_on_a_mixed_batch(vl):
    model, proc, prompts, images, videos = vl
    engine = HFEngine(model, proc.tokenizer)
    gens = engine.generate(prompts, n_samples_per_prompt=2, max_new_tokens=5, temperature=0.7, batch_size=8, seed=3,
                           images=images, videos=videos, processor=proc)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(4) for k in range(2)]
    assert len(engine.batches(prompts, 2, 8)) == 1  # all four kinds of rows in one generate call
    responses = [g.response_token_ids for g in gens]
    idx = [g.prompt_index for g in gens]
    want = batched_response_logprobs(model, [prompts[i] for i in idx], responses, pad_token_id=engine.pad_token_id,
                                     temperature=0.7, micro_batch_size=3, images=[images[i] for i in idx],
                                     videos=[videos[i] for i in idx], processor=proc)
    for g, lp in zip(gens, want):
        assert len(g.logprobs) == len(g.response_token_ids) > 0
        assert g.logprobs == pytest.approx(lp, abs=1e-4), (g.prompt_index, g.sample_index)
    # each row sees its own media: a batch of the video row alone gives the same log-probs
    alone = batched_response_logprobs(model, [prompts[2]], [responses[4]], pad_token_id=engine.pad_token_id,
                                      temperature=0.7, images=[images[2]], videos=[videos[2]], processor=proc)
    assert alone[0] == pytest.approx(gens[4].logprobs, abs=1e-4)
    # the actor pass packed (one row per micro-batch, per-sequence M-RoPE positions) agrees too
    packed = batched_response_logprobs(model, [prompts[i] for i in idx], responses, pad_token_id=engine.pad_token_id,
                                       temperature=0.7, micro_batch_size=8, packing=True,
                                       images=[images[i] for i in idx], videos=[videos[i] for i in idx], processor=proc)
    for g, lp in zip(gens, packed):
        assert g.logprobs == pytest.approx(lp, abs=1e-4), (g.prompt_index, g.sample_index)


def test_greedy_decoding_with_images_and_videos(vl):
    model, proc, prompts, images, videos = vl
    gens = greedy_generate(model, proc.tokenizer, prompts, max_new_tokens=4, batch_size=3, images=images,
                           videos=videos, processor=proc)  # two batches in input order: rows 0-2, then row 3
    assert [g.prompt_index for g in gens] == [0, 1, 2, 3]
    for g, p, im, vi in zip(gens, prompts, images, videos):
        seq = torch.tensor([p + g.response_token_ids])
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=torch.ones_like(seq),
                           **proc.batch_inputs([im], seq, [vi])).logits[0, len(p) - 1:-1].float()
        for j, t in enumerate(g.response_token_ids):  # each token is its row's argmax (up to float ties)
            assert logits[j, t] >= logits[j].max() - 1e-4
        assert g.logprobs == pytest.approx(logits.log_softmax(-1)[range(len(g.response_token_ids)),
                                                                 g.response_token_ids].tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="videos need a processor and one list per prompt: 3 lists for 4 prompts"):
        HFEngine(model, proc.tokenizer).generate(prompts, n_samples_per_prompt=1, max_new_tokens=2, videos=videos[:3],
                                                 processor=proc)
