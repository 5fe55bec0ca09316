"""Micro-batches cut by tokens (``update.max_tokens_per_micro_batch``, ``critic.``, ``logprobs.``;
verl's ``use_dynamic_bsz``): the partition (hand-computed and its invariants), the update and the
critic update equal to the micro-batches of a fixed count up to the summation order (float64,
weights that moved), bit for bit where the partition is the same, the passes' values unchanged,
and the refusals (a padded row, a sample beyond the budget)."""
from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from rft_core.config import CriticConfig, LogprobConfig, UpdateConfig
from rft_core.models.critic import batched_response_values, load_critic
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.loop import (MicroBatching, epoch_micro_batches, packed_lengths, pass_micro_batches,
                                    rank_micro_batches, token_budget_micro_batches)
from rft_core.training.strategy import SingleProcess
from rft_core.training.update import UpdateData, _PPOLoss, ppo_update
from tests.update_settings import update_settings

# 7 samples of 5..13 tokens (prompt + response): 61 tokens
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32], [41, 42, 43, 44], [51, 52, 53], [61], [71, 72, 73, 74, 75]]
RESPONSES = [[101, 102, 103, 104], [201, 202], [301, 302, 303, 304, 305, 306, 307, 308], [401, 402, 403],
             [501, 502, 503, 504, 505, 506, 507], [601, 602, 603, 604], [701, 702, 703, 704, 705, 706, 707, 708]]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5]


def test_the_partition_by_tokens_hand_computed():
    """lengths 5, 3, 8, 2, 7, 1 (26 tokens), budget 10: k = 3; longest first 8 -> a, 7 -> b, 5 -> c,
    3 -> c (8), 2 -> b (9), 1 -> a (9; a and c tie at 8, the lower index wins): {2, 5}, {4, 3}, {0, 1},
    ordered by their first sample's place and each in the mini-batch's order."""
    lengths = [5, 3, 8, 2, 7, 1]
    assert token_budget_micro_batches([0, 1, 2, 3, 4, 5], lengths, 10) == [[0, 1], [2, 5], [3, 4]]
    # a shuffled mini-batch keeps its order: [2, 0, 5, 1] (17 tokens) -> k = 2: 8 -> a, 5 -> b, 3 -> b, 1 -> a
    assert token_budget_micro_batches([2, 0, 5, 1], lengths, 10) == [[2, 5], [0, 1]]
    # budget 8: k = 4; 8 -> a, 7 -> b, 5 -> c, 3 -> d, 2 -> d (5), 1 -> c (6; c and d tie at 5)
    assert token_budget_micro_batches([0, 1, 2, 3, 4, 5], lengths, 8) == [[0, 5], [1, 3], [2], [4]]
    # 3, 3, 2, 2, 2 with budget 6: LPT at k = 2 gives 3+2+2 = 7 > 6 (the optimum 3+3 | 2+2+2 is not LPT's), so
    # k = 3: 3 -> a, 3 -> b, 2 -> c, 2 -> c (4), 2 -> a (5; a and b tie at 3)
    assert token_budget_micro_batches([0, 1, 2, 3, 4], [3, 3, 2, 2, 2], 6) == [[0, 4], [1], [2, 3]]
    assert token_budget_micro_batches([], lengths, 8) == []
    with pytest.raises(ValueError, match=r"sample 2 has 8 tokens \(prompt and response\), more than "
                                         r"update.max_tokens_per_micro_batch=7 \(1 such samples\)"):
        token_budget_micro_batches([0, 1, 2], lengths, 7, key="update.max_tokens_per_micro_batch")


def test_the_partition_by_tokens_invariants():
    """Random mini-batches: every sample in exactly one micro-batch, none above the budget, each in
    the mini-batch's order, no fewer than ceil(total / budget) and, on these, no more than 2 beyond
    first-fit decreasing's count (a reference bin packing, ``_first_fit_decreasing``), and the same
    cut for the same order."""
    rng = random.Random(0)
    grew = 0
    for _ in range(300):
        n = rng.randint(1, 40)
        lengths = [rng.randint(1, 50) for _ in range(n)]
        budget = rng.randint(max(lengths), 200)
        mini = rng.sample(range(n), n)
        cut = token_budget_micro_batches(mini, lengths, budget)
        assert sorted(i for c in cut for i in c) == sorted(mini)
        assert all(sum(lengths[i] for i in c) <= budget for c in cut)
        place = {i: p for p, i in enumerate(mini)}
        assert all([place[i] for i in c] == sorted(place[i] for i in c) for c in cut)
        assert [place[c[0]] for c in cut] == sorted(place[c[0]] for c in cut)
        k = math.ceil(sum(lengths) / budget)
        assert k <= len(cut) <= _first_fit_decreasing(lengths, budget) + 2
        grew += len(cut) > k
    assert grew > 0  # the k + 1 branch ran


def _first_fit_decreasing(lengths: list[int], budget: int) -> int:
    """Bins of first-fit decreasing (Johnson 1973; at most 11/9 of the optimum + 6/9)."""
    bins: list[int] = []
    for x in sorted(lengths, reverse=True):
        b = next((b for b, used in enumerate(bins) if used + x <= budget), None)
        if b is None:
            bins.append(x)
        else:
            bins[b] += x
    return len(bins)


def test_micro_batching_by_count_and_by_tokens_and_every_rank_runs_as_many_passes():
    assert MicroBatching(3).cut([5, 1, 4, 0, 2]) == [[5, 1, 4], [0, 2]]
    lengths = packed_lengths(PROMPTS, RESPONSES)
    assert lengths == [7, 8, 10, 7, 10, 5, 13]
    by_tokens = MicroBatching(3, 20, lengths)
    # 60 tokens: k = 3 fails (13+7 | 10+8 | 10+7+5 = 22 > 20); k = 4: 13 | 10+7 | 10+5 | 8+7
    assert by_tokens.cut(list(range(7))) == [[0, 1], [2, 3], [4, 5], [6]]
    first = epoch_micro_batches(7, train_batch_size=None, micro_batching=by_tokens, seed=4)
    assert sorted(i for c in first for i in c) == list(range(7)) and all(sum(lengths[i] for i in c) <= 20 for c in first)
    ranks = [rank_micro_batches(first, rank=r, world_size=2) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == math.ceil(len(first) / 2)
    assert sorted(i for r in ranks for c, w in r if w == 1.0 for i in c) == list(range(7))
    with pytest.raises(ValueError, match="max_tokens needs the samples' lengths"):
        MicroBatching(3, 20)
    with pytest.raises(ValueError, match="must be >= 1"):
        MicroBatching(0)


def test_an_iteration_with_no_sample_has_no_rows():
    """A partial rollout's iteration in which no group finished gives the passes no rows (below
    float32 they take the update's, ``first_epoch_rows``), by count or by tokens; it used to raise
    ``range() arg 3 must not be zero`` (count) and "max_tokens needs the samples' lengths" (tokens)."""
    from rft_core.config import UpdateGrouping
    from rft_core.training.update import first_epoch_rows

    assert epoch_micro_batches(0, train_batch_size=None, micro_batching=MicroBatching(4), seed=0) == []
    for budget in (None, 64):
        grouping = UpdateGrouping(micro_batch_size=4, policy_version=3, max_tokens_per_micro_batch=budget)
        assert first_epoch_rows(grouping, [], []) == []
    assert pass_micro_batches([], [], 64, key="critic.max_tokens_per_micro_batch") == []


def test_a_token_budget_needs_packed_rows():
    for section, model in (("update", UpdateConfig), ("critic", CriticConfig), ("logprobs", LogprobConfig)):
        with pytest.raises(ValidationError, match=rf"{section}.max_tokens_per_micro_batch=64 counts the tokens of a "
                                                  rf"packed row .* it needs {section}.packing=true"):
            model(max_tokens_per_micro_batch=64, packing=False)
        assert model(max_tokens_per_micro_batch=64, packing=True).max_tokens_per_micro_batch == 64


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _sgd_step(tiny_model, dtype: torch.dtype, rows: list[list[int]] | None = None, **update) -> torch.Tensor:
    """The parameter change of one plain SGD step (lr 1, no clipping) of the packed update on the
    samples above, old log-probs those of the model itself; ``rows`` collects its micro-batches."""
    model = load_causal_lm(tiny_model, trainable=True).to(dtype)
    old = batched_response_logprobs(model, PROMPTS, RESPONSES, pad_token_id=2, packing=True)
    data = UpdateData(PROMPTS, RESPONSES, old, [[a] * len(r) for a, r in zip(ADVANTAGES, RESPONSES)])
    base = _flat(model)
    real = _PPOLoss.micro_step

    def micro_step(self, idx, norm):
        if rows is not None:
            rows.append(list(idx))
        return real(self, idx, norm)

    _PPOLoss.micro_step = micro_step
    try:
        steps = ppo_update(SingleProcess(model, torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=1e9), data,
                           update_settings(packing=True, **update), pad_token_id=2)
    finally:
        _PPOLoss.micro_step = real
    assert len(steps) == 1 and steps[0].num_tokens == sum(len(r) for r in RESPONSES)
    return _flat(model) - base


def test_the_update_by_tokens_is_the_update_by_count_up_to_the_summation_order(tiny_model):
    """Exact gradient accumulation (every micro-batch normalised by its mini-batch's totals) makes
    the step independent of how the mini-batch is cut, up to the order of the float sums: in float64
    the token-cut step equals the count-cut one to 1e-12 of a step of ~1; with the same partition
    (a budget that holds the whole mini-batch, one micro-batch of 7) it is the same bit for bit."""
    rows: list[list[int]] = []
    by_tokens = _sgd_step(tiny_model, torch.float64, rows, max_tokens_per_micro_batch=20)
    lengths = packed_lengths(PROMPTS, RESPONSES)
    assert len(rows) == 4 and all(sum(lengths[i] for i in r) <= 20 for r in rows)
    count_rows: list[list[int]] = []
    by_count = _sgd_step(tiny_model, torch.float64, count_rows, micro_batch_size=2)
    assert sorted(map(sorted, rows)) != sorted(map(sorted, count_rows))  # other rows: the comparison is not trivial
    assert by_count.abs().max() > 1e-2  # the weights moved: the comparison sees a real step
    torch.testing.assert_close(by_tokens, by_count, rtol=0, atol=1e-12)
    rows.clear()
    whole = _sgd_step(tiny_model, torch.float32, rows, max_tokens_per_micro_batch=60, micro_batch_size=1)
    assert len(rows) == 1 and len(rows[0]) == 7
    assert torch.equal(whole, _sgd_step(tiny_model, torch.float32, micro_batch_size=7))


def test_the_update_refuses_a_sample_beyond_the_budget_before_any_step(tiny_model):
    model = load_causal_lm(tiny_model, trainable=True)
    base = _flat(model)
    data = UpdateData(PROMPTS, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], [[1.0] * len(r) for r in RESPONSES])
    with pytest.raises(ValueError, match="sample 6 has 13 tokens .* more than update.max_tokens_per_micro_batch=12"):
        ppo_update(SingleProcess(model, torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=1e9), data,
                   update_settings(packing=True, max_tokens_per_micro_batch=12), pad_token_id=2)
    assert torch.equal(_flat(model), base)


def test_the_critic_update_by_tokens_is_the_update_by_count_up_to_the_summation_order(tiny_model):
    deltas = {}
    for name, cfg in (("tokens", CriticConfig(packing=True, max_tokens_per_micro_batch=20, value_clip=None)),
                      ("count", CriticConfig(packing=True, micro_batch_size=2, value_clip=None))):
        critic = load_critic(tiny_model, trainable=True).to(torch.float64)
        with torch.no_grad():  # a random head: the backbone moves too
            critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        old = batched_response_values(critic, PROMPTS, RESPONSES, pad_token_id=2, packing=True)
        data = CriticData(PROMPTS, RESPONSES, old, [[a] * len(r) for a, r in zip(ADVANTAGES, RESPONSES)])
        base = _flat(critic)
        steps = critic_update(SingleProcess(critic, torch.optim.SGD(critic.parameters(), lr=1.0), max_grad_norm=1e9),
                              data, cfg, pad_token_id=2)
        deltas[name] = (_flat(critic) - base, steps[0].value_loss)
    assert deltas["count"][0][:-33].abs().max() > 1e-3  # the backbone moved (the head: the last 32 + 1 values)
    torch.testing.assert_close(deltas["tokens"][0], deltas["count"][0], rtol=0, atol=1e-12)
    assert deltas["tokens"][1] == pytest.approx(deltas["count"][1], rel=1e-6)  # the values are float32 (response_values)


def test_the_passes_by_tokens_give_the_values_of_the_passes_by_count(tiny_model):
    """The log-prob and value passes in packed rows of at most 20 tokens give what one row of all 7
    sequences gives (packed = packed, to float32 rounding), each row within the budget."""
    lengths = packed_lengths(PROMPTS, RESPONSES)
    groups = pass_micro_batches(PROMPTS, RESPONSES, 20, key="logprobs.max_tokens_per_micro_batch")
    assert len(groups) == 4 and all(sum(lengths[i] for i in g) <= 20 for g in groups)
    model = load_causal_lm(tiny_model)
    a = batched_response_logprobs(model, PROMPTS, RESPONSES, pad_token_id=2, packing=True, groups=groups)
    b = batched_response_logprobs(model, PROMPTS, RESPONSES, pad_token_id=2, packing=True, micro_batch_size=8)
    assert all(x == pytest.approx(y, abs=1e-5) for x, y in zip(a, b)) and sum(map(len, a)) == 36
    critic = load_critic(tiny_model)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    v = batched_response_values(critic, PROMPTS, RESPONSES, pad_token_id=2, packing=True, groups=groups)
    w = batched_response_values(critic, PROMPTS, RESPONSES, pad_token_id=2, packing=True, micro_batch_size=8)
    assert any(abs(x) > 1e-3 for row in v for x in row)
    assert all(x == pytest.approx(y, abs=1e-5) for x, y in zip(v, w))
    with pytest.raises(ValueError, match="each of the 7 samples exactly once"):
        batched_response_values(critic, PROMPTS, RESPONSES, pad_token_id=2, packing=True, groups=groups[1:])
