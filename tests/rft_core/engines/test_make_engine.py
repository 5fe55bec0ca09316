"""``make_engine`` (the rollout stage's engine choice): ``rollout.engine`` hf / vllm / sglang, the
GPU engines taken from the process's engine cache (one engine reused across iterations, the new
checkpoint loaded in place), the policy dtype handed on unchanged; and the rollout stage running
two iterations in one process on one cached engine. vLLM and SGLang are the HF-backed stand-ins
of ``fakes.py`` (no GPU here)."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from rft_core.config import load_config
from rft_core.config.scale import SGLangConfig
from rft_core.engines import ENGINE_CACHE
from rft_core.engines import sglang as sglang_module
from rft_core.engines import vllm as vllm_module
from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import SGLangEngine
from rft_core.engines.vllm import VLLMEngine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.stages.contracts import RolloutInput
from rft_core.stages.rollout import make_engine
from rft_core.stages.runner import run_stage
from schemas import read_shard, write_shard
from schemas.columns import PROMPTS
from tests.rft_core.engines.fakes import HFBackedLLM, HFBackedSGLang, SamplingParams

PROMPT_IDS = [[1, 20, 30, 31, 32], [1, 40]]


@pytest.fixture
def built(tiny_model, monkeypatch):
    """vllm.LLM and sglang.Engine replaced by recorders building HF-backed stand-ins on a fresh
    copy of the tiny model: (engine kind, kwargs) per engine built."""
    base, tok = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    log: list[tuple[str, dict]] = []

    def fresh():
        model = type(base)(base.config)
        model.load_state_dict(base.state_dict())
        return model.eval()

    def build_llm(**kwargs):
        log.append(("vllm", kwargs))
        return HFBackedLLM(fresh(), tok, **kwargs)

    def build_sglang(**kwargs):
        log.append(("sglang", kwargs))
        return HFBackedSGLang(fresh(), tok, **kwargs)

    monkeypatch.setattr(vllm_module, "build_llm", build_llm)
    monkeypatch.setattr(vllm_module, "vllm_sampling_params", lambda: SamplingParams)
    monkeypatch.setattr(sglang_module, "build_engine", build_sglang)
    return log


def _checkpoint(tiny_model, out, seed):
    """A full checkpoint of the same model with other weights (the next iteration's policy)."""
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    load_tokenizer(tiny_model).save_pretrained(out)
    return str(out)


def test_hf_engine_gets_the_policy_dtype(tiny_model):
    cfg = load_config(None, {}).rollout
    engine, tok = make_engine(cfg, tiny_model, dtype="bfloat16")
    assert isinstance(engine, HFEngine) and next(engine.model.parameters()).dtype == torch.bfloat16
    assert ENGINE_CACHE.peek() is None  # the HF engine is not cached
    assert tok.pad_token_id is not None


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_gpu_engines_are_cached_and_reload_the_next_checkpoint(kind, tiny_model, tmp_path, built):
    overrides = {"rollout.engine": kind}
    if kind == "sglang":
        overrides["rollout.sglang"] = {"mem_fraction_static": 0.3, "tensor_parallel_size": 2}
    cfg = load_config(None, overrides).rollout
    first, _ = make_engine(cfg, tiny_model, dtype="float32")
    assert isinstance(first, VLLMEngine if kind == "vllm" else SGLangEngine) and ENGINE_CACHE.peek() is first
    kwargs = built[-1][1]
    if kind == "sglang":
        assert kwargs["mem_fraction_static"] == 0.3 and kwargs["tp_size"] == 2
        assert kwargs["enable_deterministic_inference"] is True and kwargs["skip_tokenizer_init"] is True
    # float32 handed on unchanged and mapped by the engine: float16 without bfloat16 support (this CPU)
    assert kwargs["dtype"] == "float16"
    first.generate(PROMPT_IDS, n_samples_per_prompt=2, max_new_tokens=2)
    nxt = _checkpoint(tiny_model, tmp_path / "iter2", seed=1)
    again, _ = make_engine(cfg, nxt, dtype="float32")
    assert again is first and len(built) == 1  # reused, not rebuilt
    again.generate(PROMPT_IDS, n_samples_per_prompt=2, max_new_tokens=2)
    fake = again.llm if kind == "vllm" else again.engine
    reload = ("collective_rpc", "rft_reload_weights", (nxt,)) if kind == "vllm" else ("update_weights_from_disk", nxt)
    assert reload in fake.events
    # another policy dtype is another engine setting: the cached engine is closed, a new one built
    other, _ = make_engine(cfg, nxt, dtype="bfloat16")
    assert other is not first and len(built) == 2 and built[-1][1]["dtype"] == "bfloat16"
    assert fake.events[-1] == ("shutdown",)


def test_switching_engine_kind_closes_the_cached_engine(tiny_model, built):
    vcfg = load_config(None, {"rollout.engine": "vllm"}).rollout
    scfg = vcfg.model_copy(update={"engine": "sglang", "sglang": SGLangConfig(deterministic=False)})
    v, _ = make_engine(vcfg, tiny_model, dtype="bfloat16")
    s, _ = make_engine(scfg, tiny_model, dtype="bfloat16")
    assert isinstance(s, SGLangEngine) and ENGINE_CACHE.peek() is s and v.llm is None  # one GPU holds one engine
    assert [k for k, _ in built] == ["vllm", "sglang"] and built[-1][1]["enable_deterministic_inference"] is False


def test_unknown_engine_is_a_config_error():
    with pytest.raises(ValueError, match="rollout.engine"):
        load_config(None, {"rollout.engine": "trt"})


def test_rollout_stage_reuses_one_engine_across_iterations(tiny_model, tmp_path, built):
    """Two iterations of the rollout program in one process (the in-process task runner): one
    vLLM engine, the second iteration's samples and log-probs from the second checkpoint."""
    tok = load_tokenizer(tiny_model)
    n = len(PROMPT_IDS)
    prompts = write_shard(pa.table({
        "prompt_id": [f"q{i}" for i in range(n)], "data_source": ["test"] * n, "question": ["?"] * n,
        "prompt_text": tok.batch_decode(PROMPT_IDS), "prompt_token_ids": PROMPT_IDS, "answer": ["1"] * n,
        "metadata_json": ["{}"] * n, "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)]},
        schema=PROMPTS.arrow),
        str(tmp_path / "prompts"), schema=PROMPTS, config_hash="p")
    cfg = load_config(None, {"rollout.engine": "vllm", "rollout.n_samples_per_prompt": 2,
                             "rollout.max_new_tokens": 3}).rollout
    policies = [tiny_model, _checkpoint(tiny_model, tmp_path / "iter2", seed=2)]
    for it, policy in enumerate(policies, start=1):
        run_stage(RolloutInput(prompts=prompts, policy=policy, rollout=cfg, iteration=it, out=str(tmp_path / f"r{it}")))
    assert len(built) == 1
    engine = ENGINE_CACHE.peek()
    assert ("collective_rpc", "rft_reload_weights", (policies[1],)) in engine.llm.events
    rows = read_shard(f"{tmp_path}/r2", stage="rollout").to_pydict()
    new = load_causal_lm(policies[1])
    from rft_core.models.logprobs import batched_response_logprobs

    want = batched_response_logprobs(new, rows["prompt_token_ids"], rows["response_token_ids"], pad_token_id=tok.pad_token_id)
    for got, lp in zip(rows["rollout_logprobs"], want):
        assert got == pytest.approx(lp, abs=1e-4)
