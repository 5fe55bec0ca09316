"""Local reward model: a tiny random sequence-classification model, batched with padding, gives
the same scores as one text at a time and as a hand-run forward pass; routed by recipe."""
from __future__ import annotations

import pytest
import torch

from rft_core.config import RewardModelSource, load_config
from rft_core.rewards.base import RewardError, RewardSample
from rft_core.rewards.engine import RewardEngine
from rft_core.rewards.model import RewardModelReward, score_texts


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rft_core.models.loading import DEFAULT_MODEL, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("rm") / "rm"
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _s(i, response, label="chat"):
    return RewardSample(sample_id=f"s{i}", prompt_id=f"p{i}", label=label, question="q", prompt_text="User: hi\n",
                        response=response, reference="")


def test_batched_scores_equal_single_and_manual_forward(tiny_rm):
    src = RewardModelReward(RewardModelSource(path=tiny_rm, batch_size=3))
    texts = ["short", "a much longer response with many more tokens in it", "mid length reply", "x", "hello there"]
    batched = [s.score for s in src.score([_s(i, t) for i, t in enumerate(texts)])]
    model, tok = src._load()
    single = [score_texts(model, tok, ["User: hi\n" + t], batch_size=1, max_length=1024, device="cpu")[0] for t in texts]
    assert batched == pytest.approx(single, abs=1e-5)
    ids = tok("User: hi\nx", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        manual = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert batched[3] == pytest.approx(manual, abs=1e-6)
    assert len(set(round(b, 6) for b in batched)) == 5  # a random head still separates the texts


def test_max_length_keeps_the_end(tiny_rm):
    src = RewardModelReward(RewardModelSource(path=tiny_rm))
    model, tok = src._load()
    text = "one two three four five six seven eight nine ten"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cut = score_texts(model, tok, [text], batch_size=1, max_length=4, device="cpu")[0]
    with torch.no_grad():
        tail = model(input_ids=torch.tensor([ids[-4:]])).logits[0, 0].item()
    assert cut == pytest.approx(tail, abs=1e-6)


def test_only_samples_whose_recipe_uses_the_model_are_sent(tiny_rm, monkeypatch):
    seen = []
    orig = RewardModelReward.score

    def spy(self, samples):
        seen.extend(s.sample_id for s in samples)
        return orig(self, samples)

    monkeypatch.setattr(RewardModelReward, "score", spy)
    cfg = load_config(None, {"reward.sources": {"rm": {"type": "reward_model", "path": tiny_rm}, "f": {"type": "format"}},
                             "reward.recipes": {"chat": [{"source": "rm", "weight": 0.5}],
                                                "basic_arithmetic": [{"source": "f"}]}}).reward
    out = RewardEngine(cfg).score([_s(0, "a"), _s(1, "Answer: 3", "basic_arithmetic"), _s(2, "b")]).results
    assert seen == ["s0", "s2"]
    assert out[1].reward == 1.0 and set(out[0].metrics) == {"rm"}
    assert out[0].reward == pytest.approx(0.5 * out[0].metrics["rm"], abs=1e-6)


def test_multi_label_head_is_refused(tiny_rm, tmp_path):
    from transformers import AutoConfig, LlamaForSequenceClassification

    cfg = AutoConfig.from_pretrained(tiny_rm)
    cfg.num_labels = 3
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm3")
    from rft_core.models.loading import load_tokenizer

    load_tokenizer(tiny_rm).save_pretrained(tmp_path / "rm3")
    with pytest.raises(RewardError, match="num_labels=3; a reward model needs num_labels=1"):
        RewardModelReward(RewardModelSource(path=str(tmp_path / "rm3"))).score([_s(0, "x")])
