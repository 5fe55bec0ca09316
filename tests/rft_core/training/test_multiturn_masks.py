"""Multi-turn responses in the update and the critic update: observation tokens (action_mask
False) carry no gradient, no KL and no entropy term, and only the model's tokens count in the
normaliser. Exact gradients on the tiny model against a float64 reference loop."""
from __future__ import annotations

import pytest
import torch

from rft_core.config import CriticConfig, KLConfig
from rft_core.models.critic import load_critic
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.strategy import SingleProcess
from rft_core.training.update import UpdateData, ppo_update
from tests.update_settings import update_settings

# per sample: the response's model/observation layout (1 = model token, 0 = observation token)
MASKS = [[1, 1, 0, 0, 0, 1, 1], [1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1, 0, 0, 1]]
ADV = [1.0, -1.0, 0.5, -0.5]
N_MODEL = sum(map(sum, MASKS))  # 15 of 21 response tokens


class GradRecorder(SingleProcess):
    """A single-process strategy whose optimizer step records the accumulated gradients and
    leaves the weights as they are (so every step sees the same model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1e9)
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self) -> float:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.optimizer.zero_grad(set_to_none=True)
        return 0.0


def _data(tiny_model: str, **changes) -> UpdateData:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(3, 500, (len(m),), generator=g).tolist() for m in MASKS]
    old = batched_response_logprobs(load_causal_lm(tiny_model), prompts, responses, pad_token_id=2)
    ref = [[o - 0.1 * (t % 3) for t, o in enumerate(row)] for row in old]
    fields = dict(prompts=prompts, responses=responses, old_logprobs=old,
                  advantages=[[a] * len(m) for a, m in zip(ADV, MASKS)], ref_logprobs=ref,
                  entropies=[[1.0] * len(m) for m in MASKS], action_masks=[[bool(x) for x in m] for m in MASKS])
    for name, fn in changes.items():  # fn(value, is_model) for every token of that field
        fields[name] = [[fn(v, bool(k)) for v, k in zip(row, m)] for row, m in zip(fields[name], MASKS)]
    return UpdateData(**fields)


def _grads(tiny_model: str, data: UpdateData, **kwargs):
    strategy = GradRecorder(load_causal_lm(tiny_model, trainable=True))
    steps = ppo_update(strategy, data, update_settings(micro_batch_size=2, **kwargs), pad_token_id=2)
    assert len(strategy.grads) == 1
    return strategy.grads[0], steps


def test_observation_tokens_carry_no_gradient_kl_or_entropy(tiny_model):
    kw = dict(kl=KLConfig(kl_coef=0.2, estimator="k3+"), entropy_coef=0.05)
    base, steps = _grads(tiny_model, _data(tiny_model), **kw)
    # the observation tokens' advantages, old and ref log-probs moved far; the model tokens' kept
    moved = _data(tiny_model, advantages=lambda v, m: v if m else 3.0 * (-1) ** int(v > 0),
                  old_logprobs=lambda v, m: v if m else -4.0, ref_logprobs=lambda v, m: v if m else -6.0)
    grads, steps2 = _grads(tiny_model, moved, **kw)
    assert grads.keys() == base.keys() and len(base) > 0
    for name in base:
        assert torch.equal(grads[name], base[name]), name
    assert steps[0].num_tokens == steps2[0].num_tokens == N_MODEL
    assert steps2[0].kl_loss == steps[0].kl_loss and steps2[0].policy_loss == steps[0].policy_loss
    # ... while moving a model token's advantage does change the gradient (the test can fail)
    other, _ = _grads(tiny_model, _data(tiny_model, advantages=lambda v, m: v + 0.5 if m else v), **kw)
    assert any(not torch.equal(other[n], base[n]) for n in base)


def _reference_grads(tiny_model: str, data: UpdateData, *, kl_coef: float) -> dict[str, torch.Tensor]:
    """float64 loop: L = (1/N_model) sum over model tokens of [-A_t * exp(lp_t - old_t) +
    kl_coef * 0.5 * (lp_t - ref_t)^2] (PPO surrogate unclipped at ratio ~ 1, k2 KL; Schulman et
    al. 2017 eq. 7, Schulman 2020 "Approximating KL divergence")."""
    model = load_causal_lm(tiny_model, trainable=True).double()
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for p, r, old, adv, ref, m in zip(data.prompts, data.responses, data.old_logprobs, data.advantages,
                                      data.ref_logprobs, data.action_masks):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1:len(p) + len(r) - 1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        for t in range(len(r)):
            if m[t]:
                total = total - adv[t] * torch.exp(lp[t] - old[t]) + kl_coef * 0.5 * (lp[t] - ref[t]) ** 2
    (total / N_MODEL).backward()
    return {n: q.grad.float() for n, q in model.named_parameters() if q.grad is not None}


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_gradient_is_the_model_token_loss_over_the_model_token_count(tiny_model, kl_coef):
    data = _data(tiny_model)
    got, steps = _grads(tiny_model, data, kl=KLConfig(kl_coef=kl_coef, estimator="k2"))
    want = _reference_grads(tiny_model, data, kl_coef=kl_coef)
    assert steps[0].num_tokens == N_MODEL
    norm = max(float(w.abs().max()) for w in want.values())
    assert norm > 1e-4  # a gradient worth comparing
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5 * norm, rtol=1e-4, msg=name)
    # counted over all 21 response tokens the gradient would be 15/21 of this: far outside the tolerance


def test_update_data_refuses_lists_of_another_length(tiny_model):
    data = _data(tiny_model)
    with pytest.raises(ValueError, match="sample 2 has 4 response tokens but 3 action_masks entries"):
        UpdateData(data.prompts, data.responses, data.old_logprobs, data.advantages,
                   action_masks=[m if i != 2 else m[:3] for i, m in enumerate(data.action_masks)])
    with pytest.raises(ValueError, match="sample 0 has 7 response tokens but 6 advantages entries"):
        UpdateData(data.prompts, data.responses, data.old_logprobs, [a[:-1] if i == 0 else a for i, a in enumerate(data.advantages)])


def test_critic_trains_only_on_model_tokens(tiny_model):
    data = _data(tiny_model)
    g = torch.Generator().manual_seed(9)
    old_values = [torch.randn(len(m), generator=g).tolist() for m in MASKS]
    returns = [torch.randn(len(m), generator=g).tolist() for m in MASKS]

    def run(rets):
        strategy = GradRecorder(load_critic(tiny_model, trainable=True))
        steps = critic_update(strategy, CriticData(data.prompts, data.responses, old_values, rets,
                                                   action_masks=data.action_masks),
                              CriticConfig(value_clip=None, micro_batch_size=3), pad_token_id=2)
        return strategy.grads[0], steps

    base, steps = run(returns)
    assert steps[0].num_tokens == N_MODEL
    moved, _ = run([[v if k else v + 5.0 for v, k in zip(row, m)] for row, m in zip(returns, MASKS)])
    for name in base:
        assert torch.equal(moved[name], base[name]), name
    changed, _ = run([[v + 1.0 if k else v for v, k in zip(row, m)] for row, m in zip(returns, MASKS)])
    assert any(not torch.equal(changed[n], base[n]) for n in base)
    # the value loss: mean over model tokens of 0.5 (V - R)^2 (clipped_mse without a clip), in float64
    critic = load_critic(tiny_model)
    from rft_core.models.critic import critic_batch, response_values

    with torch.no_grad():
        v = response_values(critic, critic_batch(data.prompts, data.responses, pad_token_id=2, packing=False)).double()
    want = sum(0.5 * (float(v[i, t]) - returns[i][t]) ** 2 for i, m in enumerate(MASKS) for t in range(len(m)) if m[t]) / N_MODEL
    assert steps[0].value_loss == pytest.approx(want, rel=1e-5)
