"""Token batch layout, chunked log-probs vs a float64 reference, rollout engine EOS handling and
seeding, and the PPO update (micro-batch invariance, direction of the change, and each loss term
of issue 16 as an exact parameter step: entropy-filter normalisers, truncated IS weights, overlong
filtering, Dr. GRPO's constant, CPGD's drift, dropout off)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rft_core.config import KLConfig
from rft_core.engines.hf import HFEngine
from rft_core.models.loading import ModelLoadError, load_causal_lm, load_tokenizer, resolve_model_path
from rft_core.models.logprobs import batched_response_logprobs, build_token_batch, response_logprobs
from rft_core.training.strategy import SingleProcess, make_optimizer
from rft_core.training.update import UpdateData, ppo_update
from tests.update_settings import update_settings


def test_token_batch_layout():
    b = build_token_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.action_mask.tolist() == [[True, True, False], [True, True, True]]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        build_token_batch([[1], [2]], [[3]], pad_token_id=0)


def test_logprobs_match_float64_unpadded_reference(tiny_model):
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 5)]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 1, 7, 4, 2)]
    got = batched_response_logprobs(model, prompts, responses, pad_token_id=2, micro_batch_size=2, temperature=0.7)
    ref_model = load_causal_lm(tiny_model).to(torch.float64)
    for p, r, lp in zip(prompts, responses, got):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = ref_model(input_ids=ids).logits[0].to(torch.float64) / 0.7
        want = [torch.log_softmax(logits[len(p) + j - 1], -1)[t].item() for j, t in enumerate(r)]
        assert len(lp) == len(r)
        assert lp == pytest.approx(want, abs=2e-5)


def test_entropy_matches_definition(tiny_model):
    model = load_causal_lm(tiny_model)
    b = build_token_batch([[10, 11, 12]], [[13, 14]], pad_token_id=2)
    with torch.no_grad():
        _, ent = response_logprobs(model, b, with_entropy=True)
        logits = model(input_ids=b.input_ids).logits[0, 2:4].double()
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent[0].double(), -(p * p.log()).sum(-1), atol=1e-4, rtol=0)


class _FakeLM:
    """generate() returns fixed continuations; logits make token t have probability 1/2."""

    def __init__(self, continuations, vocab=8):
        self.generation_config = SimpleNamespace(eos_token_id=2)
        self.cont = torch.tensor(continuations)
        self.vocab = vocab

    def generate(self, input_ids, attention_mask, **kw):
        B, T = input_ids.shape[0], self.cont.shape[1]
        assert kw["temperature"] == 1.0 and kw["max_new_tokens"] == T
        logits = []
        for j in range(T):
            lg = torch.zeros(B, self.vocab)
            lg[torch.arange(B), self.cont[:B, j]] = torch.log(torch.tensor(float(self.vocab - 1)))
            logits.append(lg)  # p(chosen) = (V-1) / (2(V-1)) = 1/2
        return SimpleNamespace(sequences=torch.cat([input_ids, self.cont[:B]], 1), logits=tuple(logits))

    def forward(self, input_ids, attention_mask=None, past_key_values=None, **kw):
        """A transformers 5.17 causal LM's signature (the engine reads its KV-cache keyword from
        it); the fake has no forward pass, so the tests below decode through ``generate``."""
        raise NotImplementedError("the fake LM has no forward pass")


def test_engine_cuts_at_first_eos_and_reports_finish_reason():
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    lm = _FakeLM([[5, 2, 0, 0], [5, 6, 7, 4], [2, 0, 0, 0]])
    gens = HFEngine(lm, tok).generate([[9, 9], [9]], n_samples_per_prompt=1, max_new_tokens=4, batch_size=8,
                                      sort_by_length=False, share_prefill=False)  # the fake has no forward pass
    assert [g.response_token_ids for g in gens] == [[5, 2], [5, 6, 7, 4]]
    assert [g.finish_reason for g in gens] == ["stop", "length"]
    for g in gens:
        assert g.logprobs == pytest.approx([-0.6931472] * len(g.response_token_ids), abs=1e-6)



def test_a_leased_tokenizer_is_its_blocks_alone_and_reused_by_the_next_block_on_any_thread(tiny_model, monkeypatch):
    """issue 44: the stages that read a tokenizer for a block (prompts, pad ids) loaded one every
    iteration, their Prefect tasks running on new threads; a lease reuses one from a pool."""
    import collections
    import threading

    from transformers import AutoTokenizer

    from rft_core.models import pretrained
    from rft_core.models.loading import leased_tokenizer, pad_token_id

    monkeypatch.setattr(pretrained, "_LEASABLE", collections.OrderedDict())
    monkeypatch.setattr(pretrained, "_TOKENIZERS", collections.OrderedDict())  # none loaded before on this thread
    loads = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    with leased_tokenizer(tiny_model) as first, leased_tokenizer(tiny_model) as second:
        assert first is not second and len(loads) == 2  # two blocks at once: two tokenizers
    lease, taken = leased_tokenizer(tiny_model), []
    thread = threading.Thread(target=lambda: taken.append(lease.__enter__()))  # a block still open on another thread
    thread.start()
    thread.join()
    assert taken[0] in (first, second) and len(loads) == 2  # another thread's block: from the pool, no load
    with leased_tokenizer(tiny_model) as third:  # the one still out is not handed out
        assert third is not taken[0] and third in (first, second) and len(loads) == 2
    lease.__exit__(None, None, None)
    own = load_tokenizer(tiny_model)  # load_tokenizer's per-thread tokenizers are never leased
    assert load_tokenizer(tiny_model) is own and len(loads) == 3  # once per thread
    ended = []
    for _ in range(2):  # two threads one after the other (the second may reuse the first one's ident)
        thread = threading.Thread(target=lambda: ended.append((threading.get_ident(), load_tokenizer(tiny_model))))
        thread.start()
        thread.join()
    assert ended[0][1] is not ended[1][1] and own not in (ended[0][1], ended[1][1]) and len(loads) == 5
    with leased_tokenizer(tiny_model) as fourth:
        assert fourth is not own
    assert pad_token_id(tiny_model) == own.pad_token_id == first.pad_token_id is not None
    free = {k: list(v) for k, v in pretrained._LEASABLE.items()}
    with pytest.raises(ModelLoadError, match="missing.* does not exist or is not a folder"):
        with leased_tokenizer(str(tiny_model) + "/missing"):
            pass
    assert {k: list(v) for k, v in pretrained._LEASABLE.items()} == free  # nothing leased, nothing added


def test_engine_groups_and_seed_reproducibility(tiny_model):
    tok = load_tokenizer(tiny_model)
    eng = HFEngine(load_causal_lm(tiny_model), tok)
    prompts = [[1, 20, 30], [1, 40]]
    a = eng.generate(prompts, n_samples_per_prompt=3, max_new_tokens=5, batch_size=4, seed=11)
    b = eng.generate(prompts, n_samples_per_prompt=3, max_new_tokens=5, batch_size=4, seed=11)
    assert [(g.prompt_index, g.sample_index) for g in a] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [g.response_token_ids for g in a] == [g.response_token_ids for g in b]
    # the engine's own log-probs equal a fresh forward pass (same positions despite left padding)
    lps = batched_response_logprobs(eng.model, [prompts[g.prompt_index] for g in a], [g.response_token_ids for g in a],
                                    pad_token_id=tok.pad_token_id)
    for g, lp in zip(a, lps):
        assert g.logprobs == pytest.approx(lp, abs=1e-4)


def _update_data(tiny_model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]
    old = batched_response_logprobs(load_causal_lm(tiny_model), prompts, responses, pad_token_id=2)
    adv = [[a] * len(r) for a, r in zip([1.0, -1.0, 0.5, -0.5], responses)]
    return UpdateData(prompts, responses, old, adv)


def test_update_micro_batch_invariance(tiny_model):
    data = _update_data(tiny_model)
    params = []
    for mb in (1, 4):
        model = load_causal_lm(tiny_model, trainable=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = ppo_update(SingleProcess(model, opt, max_grad_norm=1e9), data, update_settings(micro_batch_size=mb), pad_token_id=2)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert len(steps) == 1 and steps[0].num_tokens == 14
    base = torch.cat([p.detach().flatten() for p in load_causal_lm(tiny_model).parameters()])
    step = (params[0] - base).abs().max().item()
    assert step > 1e-3  # the update is large compared with the float32 tolerance below
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=0)


def test_update_moves_logprobs_in_advantage_direction(tiny_model):
    data = _update_data(tiny_model)
    model = load_causal_lm(tiny_model, trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = ppo_update(SingleProcess(model, opt, max_grad_norm=1.0), data, update_settings(micro_batch_size=2, epochs=2, train_batch_size=2), pad_token_id=2)
    assert len(steps) == 4 and {s.epoch for s in steps} == {0, 1}
    new = batched_response_logprobs(model, data.prompts, data.responses, pad_token_id=2)
    delta = [sum(n) - sum(o) for n, o in zip(new, data.old_logprobs)]
    assert delta[0] > 0 and delta[1] < 0  # A=+1 made more likely, A=-1 less likely


def test_update_rejects_empty_data(tiny_model):
    model = load_causal_lm(tiny_model, trainable=True)
    with pytest.raises(ValueError, match="no samples"):
        ppo_update(SingleProcess(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0), UpdateData([], [], [], []), update_settings(), pad_token_id=2)


def test_unreadable_model_path_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_causal_lm(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot load model from"):
        load_causal_lm(str(tmp_path / "broken"))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _sgd_delta(tiny_model, data, *, lr=0.5, model=None, correction=None, **kw):
    """The parameter change of one plain-SGD update (no gradient clipping: linear in the loss)."""
    model = model or load_causal_lm(tiny_model, trainable=True)
    base = _flat(model)
    steps = ppo_update(SingleProcess(model, torch.optim.SGD(model.parameters(), lr=lr), max_grad_norm=1e9), data,
                       update_settings(**kw), pad_token_id=2, correction=correction)
    return _flat(model) - base, steps


def _replace(data, **fields):
    import dataclasses

    return dataclasses.replace(data, **fields)


def test_update_entropy_filter_normalisers(tiny_model):
    data = _update_data(tiny_model)
    # token 0 of each response has the highest entropy, so top_fraction 4/14 keeps exactly those 4 tokens
    ents = [[10.0 + i] + [0.0] * (len(r) - 1) for i, r in enumerate(data.responses)]
    filtered = _replace(data, entropies=ents)
    # "kept": the same update as training on the first token of each response alone
    kept, steps = _sgd_delta(tiny_model, filtered, entropy_top_fraction=4 / 14, entropy_filter_norm="kept", micro_batch_size=2)
    assert steps[0].num_tokens == 4
    first_only = UpdateData(data.prompts, [r[:1] for r in data.responses], [o[:1] for o in data.old_logprobs],
                            [a[:1] for a in data.advantages])
    ref, _ = _sgd_delta(tiny_model, first_only, micro_batch_size=2)
    torch.testing.assert_close(kept, ref, atol=1e-6, rtol=0)
    assert kept.abs().max() > 1e-3
    # "all" (default): the normaliser counts all 14 tokens, so the step is rho = 4/14 of the kept-count one
    full, steps = _sgd_delta(tiny_model, filtered, entropy_top_fraction=4 / 14, micro_batch_size=2)
    assert steps[0].num_tokens == 4  # tokens in the policy term
    torch.testing.assert_close(full, kept * (4 / 14), atol=1e-6, rtol=0)
    # ... and the KL term applies to every token: the same as no filter with the other advantages zeroed
    ref_lp = [[o - 0.3 * (t % 3) for t, o in enumerate(row)] for row in data.old_logprobs]
    zeroed = _replace(data, advantages=[[a[0]] + [0.0] * (len(a) - 1) for a in data.advantages], ref_logprobs=ref_lp)
    with_kl, steps = _sgd_delta(tiny_model, _replace(filtered, ref_logprobs=ref_lp), entropy_top_fraction=4 / 14,
                                kl=KLConfig(kl_coef=0.5, estimator="k2"), micro_batch_size=3)
    expected, _ = _sgd_delta(tiny_model, zeroed, kl=KLConfig(kl_coef=0.5, estimator="k2"), micro_batch_size=3)
    torch.testing.assert_close(with_kl, expected, atol=1e-6, rtol=0)
    assert (with_kl - full).abs().max() > 1e-3 and steps[0].kl_loss > 0  # the KL term did act
    with pytest.raises(ValueError, match="needs data.entropies"):
        _sgd_delta(tiny_model, data, entropy_top_fraction=0.5)
    with pytest.raises(ValueError, match="entropy_filter_norm"):
        _sgd_delta(tiny_model, filtered, entropy_top_fraction=0.5, entropy_filter_norm="some")


# rollout-correction ratios rho_t = pi_old / pi_rollout by token position (cycled); cap 2
_RHO = [0.5, 1.0, 1.5, 3.0, 2.5]


def _with_rollout_logprobs(data):
    rho = [[_RHO[t % len(_RHO)] for t in range(len(r))] for r in data.responses]
    rollout = [[o - math.log(p) for o, p in zip(olds, ps)] for olds, ps in zip(data.old_logprobs, rho)]
    return _replace(data, rollout_logprobs=rollout), rho


def test_update_applies_truncated_importance_weights(tiny_model):
    from rft_core.training.update import rollout_correction_weights

    data, rho = _with_rollout_logprobs(_update_data(tiny_model))
    corr = rollout_correction_weights(data, mode="tis", cap=2.0)
    hand = [[min(p, 2.0) for p in row] for row in rho]  # w = min(rho, cap)
    for w, h in zip(corr.weights, hand):
        torch.testing.assert_close(w, torch.tensor(h), atol=1e-5, rtol=0)
    n_capped = sum(p > 2.0 for row in rho for p in row)
    assert corr.metrics["rollout_is_capped_frac"] == pytest.approx(n_capped / 14)
    assert corr.metrics["rollout_is_weight_mean"] == pytest.approx(sum(map(sum, hand)) / 14, abs=1e-5)
    assert corr.metrics["rollout_is_token_masked_frac"] == 0.0
    # the weights multiply each token's policy loss: the same step as advantages w * A without correction
    got, steps = _sgd_delta(tiny_model, data, correction=corr, micro_batch_size=3)
    weighted = _replace(data, advantages=[[w * a for w, a in zip(ws, row)] for ws, row in zip(hand, data.advantages)])
    expected, _ = _sgd_delta(tiny_model, weighted, micro_batch_size=3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert steps[0].num_tokens == 14 and (got - _sgd_delta(tiny_model, data)[0]).abs().max() > 1e-3
    # icepop: tokens with rho outside [low, cap] leave the policy term but stay in the normaliser
    corr = rollout_correction_weights(data, mode="icepop", cap=2.0, low=0.75)
    got, steps = _sgd_delta(tiny_model, data, correction=corr, micro_batch_size=3)
    masked = [[(p if 0.75 <= p <= 2.0 else 0.0) * a for p, a in zip(ps, row)] for ps, row in zip(rho, data.advantages)]
    expected, _ = _sgd_delta(tiny_model, _replace(data, advantages=masked), micro_batch_size=3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    kept = sum(0.75 <= p <= 2.0 for row in rho for p in row)
    assert steps[0].num_tokens == kept < 14
    with pytest.raises(ValueError, match="needs data.rollout_logprobs"):
        rollout_correction_weights(_update_data(tiny_model))


def test_update_leaves_overlong_filtered_samples_out_entirely(tiny_model):
    data = _update_data(tiny_model)
    ref_lp = [[o - 0.2 for o in row] for row in data.old_logprobs]
    data = _replace(data, ref_logprobs=ref_lp)
    sub = UpdateData(*[[getattr(data, f)[i] for i in (0, 2)] for f in ("prompts", "responses", "old_logprobs", "advantages",
                                                                        "ref_logprobs")])
    for agg in ("token-mean", "seq-mean-token-mean"):
        got, steps = _sgd_delta(tiny_model, _replace(data, excluded=[False, True, False, True]), loss_agg=agg,
                                kl=KLConfig(kl_coef=0.3, estimator="k2"), micro_batch_size=3)
        expected, _ = _sgd_delta(tiny_model, sub, loss_agg=agg, kl=KLConfig(kl_coef=0.3, estimator="k2"), micro_batch_size=3)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        assert steps[0].num_tokens == 4 + 5


def test_seq_mean_token_sum_norm_uses_the_given_token_budget(tiny_model):
    data = _update_data(tiny_model)
    token_mean, _ = _sgd_delta(tiny_model, data)
    sum_norm, _ = _sgd_delta(tiny_model, data, loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=10)
    # sum / (B * K) instead of sum / N: N = 14 tokens, B = 4 sequences, K = 10
    torch.testing.assert_close(sum_norm, token_mean * 14 / 40, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="needs update.loss_norm_tokens"):
        _sgd_delta(tiny_model, data, loss_agg="seq-mean-token-sum-norm")


def test_cpgd_drift_term_has_the_gradient_of_kl_to_the_old_policy(tiny_model):
    data = _update_data(tiny_model)
    zero_adv = [[0.0] * len(a) for a in data.advantages]
    # at pi = pi_old the drift is 0 with zero gradient: nothing moves
    still, _ = _sgd_delta(tiny_model, _replace(data, advantages=zero_adv), policy_loss="cpgd", cpgd_drift_coef=2.0)
    assert still.abs().max() < 1e-6
    # an old policy off by delta_t: d_t = r - 1 - log r, r = exp(-delta_t), grad = coef * (r - 1) grad log pi,
    # the same as a PPO step at ratio 1 with advantages -coef * (r - 1)
    delta = [[0.05 * (1 if (i + t) % 2 else -1) for t in range(len(r))] for i, r in enumerate(data.responses)]
    moved = _replace(data, advantages=zero_adv, old_logprobs=[[o + d for o, d in zip(os_, ds)]
                                                              for os_, ds in zip(data.old_logprobs, delta)])
    got, steps = _sgd_delta(tiny_model, moved, policy_loss="cpgd", cpgd_drift_coef=2.0, micro_batch_size=3)
    adv = [[-2.0 * (math.exp(-d) - 1.0) for d in ds] for ds in delta]
    expected, _ = _sgd_delta(tiny_model, _replace(data, advantages=adv), micro_batch_size=3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    hand = sum(math.exp(-d) - 1 + d for ds in delta for d in ds) / 14  # token-mean of d_t
    assert steps[0].cpgd_drift == pytest.approx(hand, rel=1e-3) and got.abs().max() > 1e-4


def _dropout_model(tiny_model):
    model = load_causal_lm(tiny_model, trainable=True)
    attn = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attn
    for m in attn:
        m.attention_dropout = 0.5
    return model


def test_update_runs_with_dropout_off_unless_asked(tiny_model):
    from rft_core.training.update import dropout_disabled

    data = _update_data(tiny_model)
    runs = {}
    for dropout in (False, True):
        for seed in (0, 1):
            torch.manual_seed(seed)  # the global generator's state before the update plays no part (update_rng)
            runs[dropout, seed], _ = _sgd_delta(tiny_model, data, model=_dropout_model(tiny_model), dropout=dropout)
    assert torch.equal(runs[False, 0], runs[False, 1])  # no randomness left in the update
    plain, _ = _sgd_delta(tiny_model, data)
    torch.testing.assert_close(runs[False, 0], plain, atol=1e-7, rtol=0)  # = the model without dropout
    assert (runs[True, 0] - plain).abs().max() > 1e-4  # dropout on when asked for
    assert torch.equal(runs[True, 0], runs[True, 1])  # its masks drawn from the update's own seed
    reseeded, _ = _sgd_delta(tiny_model, data, model=_dropout_model(tiny_model), dropout=True, seed=1)
    assert (runs[True, 0] - reseeded).abs().max() > 1e-4  # another update seed, other masks
    # settings restored afterwards; LoRA's own dropout and nn.Dropout modules
    model = _dropout_model(tiny_model)
    seq = torch.nn.Sequential(torch.nn.Dropout(0.3), torch.nn.Linear(2, 2))
    seq.lora_dropout = torch.nn.ModuleDict({"default": torch.nn.Dropout(0.1)})
    seq.attn_pdrop = 0.2
    with dropout_disabled(model) as n, dropout_disabled(seq) as m:
        assert n == 2 and all(x.attention_dropout == 0.0 for x in model.modules() if hasattr(x, "attention_dropout"))
        assert m == 2 and seq[0].p == 0.0 and seq.attn_pdrop == 0.0 and seq.lora_dropout["default"].p == 0.1
    assert all(x.attention_dropout == 0.5 for x in model.modules() if hasattr(x, "attention_dropout"))
    assert seq[0].p == 0.3 and seq.attn_pdrop == 0.2


def test_entropy_bonus_raises_entropy(tiny_model):
    data = _update_data(tiny_model)
    zero_adv = UpdateData(data.prompts, data.responses, data.old_logprobs, [[0.0] * len(a) for a in data.advantages])
    model = load_causal_lm(tiny_model, trainable=True)
    b = build_token_batch(data.prompts, data.responses, pad_token_id=2)
    with torch.no_grad():
        before = response_logprobs(model, b, with_entropy=True)[1][b.action_mask].mean()
    ppo_update(SingleProcess(model, torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=1.0), zero_adv, update_settings(entropy_coef=1.0, epochs=3), pad_token_id=2)
    with torch.no_grad():
        after = response_logprobs(model, b, with_entropy=True)[1][b.action_mask].mean()
    assert after > before


def test_fire_sampling_changes_only_the_first_token(tiny_model):
    tok = load_tokenizer(tiny_model)
    eng = HFEngine(load_causal_lm(tiny_model), tok)
    kw = dict(n_samples_per_prompt=8, max_new_tokens=4, batch_size=8, seed=3, temperature=1e-4)
    plain = eng.generate([[1, 20, 30]], **kw)
    # near-greedy everywhere: all 8 samples are the same sequence
    assert len({tuple(g.response_token_ids) for g in plain}) == 1
    fire = eng.generate([[1, 20, 30]], first_token_temperature=1e4, **kw)
    firsts = [g.response_token_ids[0] for g in fire]
    assert len(set(firsts)) >= 6  # a flat first-token distribution over ~49k tokens
    # after the first token, decoding is near-greedy again: the same first token -> the same continuation
    greedy_after = {}
    for g in fire:
        assert greedy_after.setdefault(g.response_token_ids[0], g.response_token_ids) == g.response_token_ids
    # the reported log-probs are the behaviour policy's: the first token's under the flat FIRE
    # distribution it was drawn from (temperature 1e4: about -log V), the later ones the policy's at
    # `temperature` (what the actor stage recomputes)
    responses = [g.response_token_ids for g in fire]
    first = batched_response_logprobs(eng.model, [[1, 20, 30]] * 8, [r[:1] for r in responses],
                                      pad_token_id=tok.pad_token_id, temperature=1e4)
    lps = batched_response_logprobs(eng.model, [[1, 20, 30]] * 8, responses, pad_token_id=tok.pad_token_id,
                                    temperature=1e-4)
    V = eng.model.config.vocab_size
    for g, f, lp in zip(fire, first, lps):
        assert g.logprobs[0] == pytest.approx(f[0], abs=1e-4) and abs(g.logprobs[0] + math.log(V)) < 0.01
        assert lp[0] < -100  # under the near-greedy policy the FIRE token is very unlikely
        assert g.logprobs[1:] == pytest.approx(lp[1:], rel=1e-3, abs=0.05)


def test_checkpoint_restores_optimizer_state_with_configured_lr(tiny_model, tmp_path):
    from rft_core.training.checkpoint import load_optimizer_state, save_checkpoint

    data = _update_data(tiny_model)
    model = load_causal_lm(tiny_model, trainable=True)
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    ppo_update(SingleProcess(model, opt, max_grad_norm=1.0), data, update_settings(), pad_token_id=2)
    save_checkpoint(model, load_tokenizer(tiny_model), opt, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".pt") == ["optimizer.pt"]

    fresh = make_optimizer(load_causal_lm(str(tmp_path / "ckpt"), trainable=True), lr=5e-4, betas=(0.9, 0.99), weight_decay=0.0)
    assert load_optimizer_state(fresh, tmp_path / "ckpt", lr=5e-4)
    saved, loaded = opt.state_dict(), fresh.state_dict()
    assert loaded["param_groups"][0]["lr"] == 5e-4  # the configured lr, not the saved 1e-3
    for k, st in saved["state"].items():  # Adam moments and step counts carried over exactly
        assert torch.equal(st["exp_avg"], loaded["state"][k]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], loaded["state"][k]["exp_avg_sq"])
        assert float(st["step"]) == float(loaded["state"][k]["step"]) == 1.0
    assert not load_optimizer_state(fresh, None) and not load_optimizer_state(fresh, tmp_path)
