"""The vision-language critic (``VLValueModel``: the Qwen2-VL backbone + a linear value head) on
the tiny random Qwen2-VL: a zero head from a policy, save / load (also from a gathered state
dict), values taken before each token and per row as alone on a mixed text / image / video batch,
an exact first update step, and packed micro-batches training alike."""
from __future__ import annotations

import json

import pytest
import torch

from rft_core.config import CriticConfig
from rft_core.models.critic import VALUE_HEAD_FILE, VLValueModel, batched_response_values, load_critic
from rft_core.models.vl import VLProcessor, build_tiny_qwen2_vl, is_vl_model
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.strategy import SingleProcess
from tests.rft_core.models.test_vl_video import _mixed_rows


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlc") / "tiny-vl")
    proc = VLProcessor(path)
    seqs, images, videos = _mixed_rows(proc)
    return path, proc, [s[:-3] for s in seqs], [s[-3:] for s in seqs], images, videos


def _head_values(critic, proc, prompt, response, images, videos):
    """V(s_t) of one row alone: w . h + b at the column before each response token."""
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        h = critic.model(input_ids=seq, attention_mask=torch.ones_like(seq),
                         **proc.batch_inputs([images], seq, [videos])).last_hidden_state[0]
        v = h @ critic.score.weight[0] + critic.score.bias[0]
    return v[len(prompt) - 1: len(prompt) + len(response) - 1].tolist()


def test_fresh_vl_critic_is_zero_and_round_trips(vl, tmp_path):
    path, proc, prompts, responses, images, videos = vl
    critic = load_critic(path)
    assert isinstance(critic, VLValueModel) and type(critic.model).__name__ == "Qwen2VLModel"
    vals = batched_response_values(critic, prompts, responses, pad_token_id=proc.tokenizer.pad_token_id,
                                   processor=proc, images=images, videos=videos)
    assert [len(v) for v in vals] == [3, 3, 3, 3] and all(x == 0.0 for v in vals for x in v)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.score.bias.fill_(0.25)
    critic.save_pretrained(tmp_path / "c")
    proc.save_pretrained(tmp_path / "c")
    assert (tmp_path / "c" / VALUE_HEAD_FILE).is_file() and is_vl_model(str(tmp_path / "c"))
    assert "vision_config" in json.loads((tmp_path / "c" / "config.json").read_text())
    again = load_critic(str(tmp_path / "c"))  # a critic checkpoint keeps its head
    assert torch.equal(again.score.weight, critic.score.weight) and again.score.bias.item() == 0.25
    for name, p in critic.model.named_parameters():
        assert torch.equal(p, dict(again.model.named_parameters())[name]), name
    # from a full state dict (what DeepSpeed gathers): the saved head is that dict's
    state = {k: (torch.ones_like(v) if k == "score.weight" else v) for k, v in critic.state_dict().items()}
    critic.save_pretrained(tmp_path / "d", state_dict=state)
    assert torch.equal(load_critic(str(tmp_path / "d")).score.weight, torch.ones(1, 32))


def test_values_before_each_token_and_each_row_as_alone(vl):
    path, proc, prompts, responses, images, videos = vl
    critic = load_critic(path)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(1))
    vals = batched_response_values(critic, prompts, responses, pad_token_id=proc.tokenizer.pad_token_id,
                                   micro_batch_size=4, processor=proc, images=images, videos=videos)
    for r in range(4):
        assert vals[r] == pytest.approx(_head_values(critic, proc, prompts[r], responses[r], images[r], videos[r]),
                                        abs=1e-5), r


def test_vl_critic_update_first_step_and_fit(vl):
    path, proc, prompts, responses, images, videos = vl
    critic = load_critic(path, trainable=True)
    data = CriticData(prompts, responses, [[0.0] * 3 for _ in prompts], [[1.0] * 3 for _ in prompts], images=images,
                      videos=videos)
    # plain SGD, one step on V = 0, R = 1, token-mean over 12 tokens: loss 0.5 * (0 - 1)^2 = 0.5,
    # dL/db = mean(V - R) = -1, so the bias moves by exactly +lr (the head's weight starts at 0)
    opt = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.1)
    steps = critic_update(SingleProcess(critic, opt, max_grad_norm=1e9), data,
                          CriticConfig(value_clip=None, epochs=1, micro_batch_size=3),
                          pad_token_id=proc.tokenizer.pad_token_id, processor=proc)
    assert steps[0].value_loss == pytest.approx(0.5) and steps[0].num_tokens == 12
    assert critic.score.bias.item() == pytest.approx(0.1, abs=1e-6)
    opt2 = torch.optim.Adam([p for p in critic.parameters() if p.requires_grad], lr=1e-2)
    steps = critic_update(SingleProcess(critic, opt2, max_grad_norm=1.0), data,
                          CriticConfig(value_clip=None, epochs=30, micro_batch_size=2),
                          pad_token_id=proc.tokenizer.pad_token_id, processor=proc)
    assert steps[-1].value_loss < 0.05
    # packed micro-batches train the same: one SGD step from the same start moves every weight alike
    moved = []
    for packing in (False, True):
        c = load_critic(path, trainable=True)
        sgd = torch.optim.SGD([p for p in c.parameters() if p.requires_grad], lr=0.1)
        with torch.no_grad():
            c.score.weight.normal_(generator=torch.Generator().manual_seed(3))
        critic_update(SingleProcess(c, sgd, max_grad_norm=1e9), data,
                      CriticConfig(value_clip=None, epochs=1, micro_batch_size=3, packing=packing),
                      pad_token_id=proc.tokenizer.pad_token_id, processor=proc)
        moved.append(torch.cat([p.detach().flatten() for p in c.parameters()]))
    torch.testing.assert_close(moved[1], moved[0], atol=1e-6, rtol=1e-5)
