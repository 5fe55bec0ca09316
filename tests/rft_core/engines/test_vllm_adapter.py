"""The vLLM engine adapter against the engine interface, with the HF engine standing in for
``vllm.LLM`` (no GPU here): request building, per-prompt seeds, output conversion (EOS cut,
finish reasons, log-probs), shards, FIRE refusal, and the rollout stage with engine=vllm."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from rft_core.config import load_config
from rft_core.engines.hf import HFEngine
from rft_core.engines.vllm import VLLMEngine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs

PROMPTS = [[1, 20, 30, 31, 32], [1, 40], [7], [1, 50, 51]]


class SamplingParams(SimpleNamespace):
    """vllm.SamplingParams' keyword arguments, recorded."""


class HFBackedLLM:
    """``vllm.LLM.generate`` semantics on the HF engine: one request per prompt with n samples
    from its own seed; CompletionOutputs carry the sampled token ids (EOS included), one
    {token: Logprob} per token and finish_reason "stop"/"length"."""

    def __init__(self, model, tok, *, eos_early=None):
        self.hf = HFEngine(model, tok)
        self.calls = []
        self.eos_early = eos_early  # force this token at step 2 of sample 0 to exercise the EOS cut

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        self.calls.append((requests, params, lora_request))
        outs = []
        for req, sp in zip(requests, params):
            assert sp.logprobs == 0 and sp.detokenize is False and sorted(self.hf.eos_ids) == sp.stop_token_ids
            gens = self.hf.generate([req["prompt_token_ids"]], n_samples_per_prompt=sp.n, max_new_tokens=sp.max_tokens,
                                    temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, batch_size=sp.n)
            completions = []
            for g in gens:
                tokens, lps, finish = list(g.response_token_ids), list(g.logprobs), g.finish_reason
                if self.eos_early is not None and g.sample_index == 0 and len(tokens) >= 3:
                    tokens, lps, finish = tokens[:2] + [self.eos_early] + tokens[3:], lps, "length"
                completions.append(SimpleNamespace(
                    token_ids=tokens, finish_reason=finish, stop_reason=None,
                    logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, lps)]))
            outs.append(SimpleNamespace(outputs=completions))
        return outs


@pytest.fixture(scope="module")
def parts(tiny_model):
    return load_causal_lm(tiny_model), load_tokenizer(tiny_model)


def _engine(parts, **kw):
    model, tok = parts
    llm = HFBackedLLM(model, tok, **kw)
    return VLLMEngine("unused", eos_ids=HFEngine(model, tok).eos_ids, llm=llm, sampling_params=SamplingParams), llm


def test_outputs_follow_the_engine_contract(parts):
    eng, llm = _engine(parts)
    gens = eng.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=5, temperature=0.8, batch_size=6, seed=10)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(4) for k in range(3)]
    # 2 prompts per call (batch_size 6 // n 3), sorted by length; seeds are per prompt
    assert [[r["prompt_token_ids"] for r in reqs] for reqs, _, _ in llm.calls] == [[[7], [1, 40]], [[1, 50, 51], [1, 20, 30, 31, 32]]]
    assert [sp.seed for _, params, _ in llm.calls for sp in params] == [12, 11, 13, 10]
    assert all(sp.n == 3 and sp.max_tokens == 5 and sp.temperature == 0.8 for _, ps, _ in llm.calls for sp in ps)
    model, tok = parts
    want = batched_response_logprobs(model, [PROMPTS[g.prompt_index] for g in gens], [g.response_token_ids for g in gens],
                                     pad_token_id=tok.pad_token_id, temperature=0.8)
    for g, lp in zip(gens, want):
        assert g.finish_reason in ("stop", "length") and len(g.logprobs) == len(g.response_token_ids)
        assert g.logprobs == pytest.approx(lp, abs=1e-4)


def test_response_is_cut_after_the_first_eos(parts):
    eos = next(iter(HFEngine(*parts).eos_ids))
    eng, _ = _engine(parts, eos_early=eos)
    gens = eng.generate(PROMPTS[:1], n_samples_per_prompt=2, max_new_tokens=5, seed=0)
    assert gens[0].response_token_ids[-1] == eos and len(gens[0].response_token_ids) == 3
    assert len(gens[0].logprobs) == 3 and gens[0].finish_reason == "stop"


def test_shards_union_equals_the_whole_and_fire_is_refused(parts):
    eng, _ = _engine(parts)
    kw = dict(n_samples_per_prompt=2, max_new_tokens=4, batch_size=2, seed=5)
    whole = eng.generate(PROMPTS, **kw)
    n_batches = len(eng.batches(PROMPTS, 2, 2))
    halves = [eng.generate(PROMPTS, only_batches={b for b in range(n_batches) if b % 2 == i}, **kw) for i in range(2)]
    key = lambda g: (g.prompt_index, g.sample_index)  # noqa: E731
    assert sorted(halves[0] + halves[1], key=key) == whole
    with pytest.raises(NotImplementedError, match="FIRE"):
        eng.generate(PROMPTS, first_token_temperature=2.0, **kw)


def test_rollout_stage_with_engine_vllm(parts, tiny_model, tmp_path, monkeypatch):
    from rft_core.engines import vllm as vllm_module
    from rft_core.stages import prompts as prompts_stage
    from rft_core.stages import rollout as rollout_stage
    from schemas import read_shard

    model, tok = parts
    built = {}

    def fake_build_llm(**kwargs):
        built.update(kwargs)
        return HFBackedLLM(model, tok)

    monkeypatch.setattr(vllm_module, "build_llm", fake_build_llm)
    monkeypatch.setattr(vllm_module, "vllm_sampling_params", lambda: SamplingParams)
    cfg = load_config(None, {"policy.path": tiny_model, "data.prompts_per_iteration": 2, "data.size": 20,
                             "rollout.engine": "vllm", "rollout.n_samples_per_prompt": 2, "rollout.max_new_tokens": 4,
                             "rollout.vllm": {"gpu_memory_utilization": 0.3}})
    p = prompts_stage.run(cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "prompts"))
    ref = rollout_stage.run(p, tiny_model, cfg.rollout, iteration=1, out=str(tmp_path / "rollout"))
    t = read_shard(ref).to_pydict()
    assert built["model"] == tiny_model and built["gpu_memory_utilization"] == 0.3
    assert built["logprobs_mode"] == "processed_logprobs" and "enable_lora" not in built
    assert t["sample_id"] == [f"{pid}#{k}" for pid in read_shard(p).column("prompt_id").to_pylist() for k in range(2)]
    assert all(len(lp) == len(r) > 0 for lp, r in zip(t["rollout_logprobs"], t["response_token_ids"]))


def test_lora_policy_is_served_as_a_vllm_lora_request(parts, tiny_model, tmp_path, monkeypatch):
    from rft_core.engines import vllm as vllm_module
    from rft_core.models.lora import apply_lora
    from rft_core.stages.rollout import make_engine

    model, tok = parts
    adapter = tmp_path / "policy"
    apply_lora(load_causal_lm(tiny_model, trainable=True), rank=2, alpha=4.0, dropout=0.0, target_modules="all-linear",
               base_path=tiny_model).save_pretrained(adapter)
    tok.save_pretrained(adapter)
    built = {}
    monkeypatch.setattr(vllm_module, "build_llm", lambda **kw: built.update(kw) or HFBackedLLM(model, tok))
    monkeypatch.setattr(vllm_module, "vllm_sampling_params", lambda: SamplingParams)
    monkeypatch.setattr(vllm_module, "lora_request", lambda path: ("lora", path))
    cfg = load_config(None, {"rollout.engine": "vllm"}).rollout
    engine, _ = make_engine(cfg, str(adapter), dtype="bfloat16")
    assert built["model"] == tiny_model and built["enable_lora"] is True and built["dtype"] == "bfloat16"
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert engine.llm.calls[0][2] == ("lora", str(adapter))
