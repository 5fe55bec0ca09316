"""Critic: value head loading, alignment of values with log-probs, and the critic update."""
from __future__ import annotations

import pytest
import torch

from rft_core.config import CriticConfig
from rft_core.models.critic import batched_response_values, load_critic, response_values
from rft_core.models.logprobs import build_token_batch
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.strategy import SingleProcess, make_optimizer


def test_fresh_critic_starts_at_zero_and_round_trips(tiny_model, tmp_path):
    critic = load_critic(tiny_model)
    vals = batched_response_values(critic, [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=2)
    assert [len(v) for v in vals] == [2, 3] and all(x == 0.0 for v in vals for x in v)
    with torch.no_grad():
        critic.score.weight.normal_()
    critic.save_pretrained(tmp_path / "c")
    again = load_critic(str(tmp_path / "c"))  # a critic checkpoint keeps its head
    assert torch.equal(again.score.weight, critic.score.weight)


def test_values_are_taken_before_each_token_and_ignore_padding(tiny_model):
    critic = load_critic(tiny_model)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    padded = batched_response_values(critic, [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=2)
    for p, r, v in zip([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], padded):
        with torch.no_grad():
            alone = critic(input_ids=torch.tensor([p + r])).logits[0, :, 0]
        # V(s_t) for response token t is the head's output at the column before it
        assert v == pytest.approx(alone[len(p) - 1: len(p) + len(r) - 1].tolist(), abs=1e-5)


def test_critic_update_fits_returns(tiny_model):
    critic = load_critic(tiny_model, trainable=True)
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[1, 2], [3, 4, 9], [14]]
    old = batched_response_values(critic, prompts, responses, pad_token_id=2)
    returns = [[1.0] * len(r) for r in responses]
    data = CriticData(prompts, responses, old, returns)
    opt = make_optimizer(critic, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    steps = critic_update(SingleProcess(critic, opt, max_grad_norm=1.0), data,
                          CriticConfig(value_clip=None, epochs=30, micro_batch_size=2), pad_token_id=2)
    assert steps[0].value_loss == pytest.approx(0.5)  # V = 0, R = 1: 0.5 (0 - 1)^2 on every token
    assert steps[-1].value_loss < 0.05 and steps[0].num_tokens == 6
    b = build_token_batch(prompts, responses, pad_token_id=2)
    with torch.no_grad():
        v = response_values(critic, b)[b.action_mask]
    assert (v - 1.0).abs().max() < 0.35
    # at the first step V == V_old token for token: the stored values and the training forward are aligned. A
    # random head (values of about +-1, varying along the sequence), so that a forward one column off would put
    # most tokens outside value_clip; the padded and the packed forward alike
    critic2 = load_critic(tiny_model, trainable=True)
    with torch.no_grad():
        critic2.score.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    old2 = batched_response_values(critic2, prompts, responses, pad_token_id=2)
    shifted = [abs(a - b) > 0.2 for row in old2 for a, b in zip(row[1:], row[:-1])]
    assert sum(shifted) >= len(shifted) / 2  # one column off would clip these
    for packing in (False, True):
        trained = load_critic(tiny_model, trainable=True)
        trained.load_state_dict(critic2.state_dict())
        steps = critic_update(SingleProcess(trained, make_optimizer(trained, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0),
                                            max_grad_norm=1.0), CriticData(prompts, responses, old2, returns),
                              CriticConfig(value_clip=0.2, epochs=1, packing=packing), pad_token_id=2)
        assert steps[0].value_clip_frac == 0.0 and steps[0].value_loss > 0.01, packing


def test_packed_rows_of_several_sequences_give_the_padded_values_and_update(tiny_model):
    """A packed row holds several sequences whose position ids restart; transformers reads them as
    separate sequences only without a cache, so the critic's forward passes ``use_cache=False``
    (before 2026-12-01 it did not: each sequence attended to the ones before it in its row, values
    off by up to 3.9 on this model, and ``critic.packing: true`` trained on them). Values and one
    float64 SGD step of the critic (random head, so the backbone moves too): packed = padded."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32], [41, 42, 43, 44], [51, 52, 53]]
    responses = [[101, 102, 103, 104], [201, 202], [301, 302, 303, 304, 305], [401, 402, 403], [501, 502, 503, 504]]
    out = {}
    for packing in (True, False):
        critic = load_critic(tiny_model, trainable=True).to(torch.float64)
        with torch.no_grad():
            critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        values = batched_response_values(critic, prompts, responses, pad_token_id=2, packing=packing, micro_batch_size=5)
        base = torch.cat([p.detach().flatten() for p in critic.parameters()])
        data = CriticData(prompts, responses, values, [[1.0] * len(r) for r in responses])
        critic_update(SingleProcess(critic, torch.optim.SGD(critic.parameters(), lr=1.0), max_grad_norm=1e9), data,
                      CriticConfig(value_clip=None, micro_batch_size=5, packing=packing), pad_token_id=2)
        out[packing] = values, torch.cat([p.detach().flatten() for p in critic.parameters()]) - base
    assert max(abs(v) for row in out[False][0] for v in row) > 0.1
    assert all(a == pytest.approx(b, abs=1e-9) for a, b in zip(out[True][0], out[False][0]))
    head = critic.score.weight.numel() + (critic.score.bias.numel() if critic.score.bias is not None else 0)
    assert out[False][1][:-head].abs().max() > 1e-3  # the backbone moved, not only the head
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=1e-10)


def test_critic_stages_with_packing_get_a_new_config_hash_and_without_keep_theirs():
    """Critic stages committed with ``critic.packing`` before the use_cache fix trained on values
    whose packed sequences saw each other: their hash changes (a resume recomputes them instead of
    reusing them); without packing nothing changed, and neither does the hash."""
    from rft_core.stages.contracts import CriticValuesInput
    from rft_core.stages.critic import _critic_commit
    from schemas import ShardRef

    ref = ShardRef(uri="file:///r", stage="rollout", num_rows=1, config_hash="0" * 16, manifest_sha256="0" * 64)
    for packing in (False, True):
        inp = CriticValuesInput(rollout=ref, model="m", critic=CriticConfig(packing=packing), out="file:///o")
        assert (_critic_commit(inp).config_hash == inp.config_hash()) is (not packing)
