"""The stand-ins refuse what the releases they copy refuse (issue 45, item 5): vLLM 0.33.0 and
SGLang 0.5.23 as constraints-gpu.txt pins them. Each test drives a stand-in the way upstream
would be driven wrongly and asserts upstream's refusal (its exception type and message, or its
failure answer), so that the project's code passes the engine tests only where the real library
would let it through. ``tests/standins/test_upstream.py`` reads the upstream wheels to check that
the names and messages copied here are upstream's."""
from __future__ import annotations

import pytest
import torch

from rft_core.engines.vllm import WORKER_EXTENSION, WeightReloadExtension
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.weightsync.plan import state_tensors
from tests.rft_core.engines.fakes import lora_adapter
from tests.standins import sglang as sglang_standin
from tests.standins import vllm as vllm_standin
from tests.standins.vllm import LLM, EngineDeadError, LoRARequest, SamplingParams, VLLMValidationError

PROMPT = {"prompt_token_ids": [1, 20, 30]}


@pytest.fixture(scope="module")
def eos(tiny_model) -> list[int]:
    """The stop tokens the project asks for (the HF engine's EOS ids of the model)."""
    from rft_core.engines.hf import HFEngine

    return sorted(HFEngine(load_causal_lm(tiny_model), load_tokenizer(tiny_model)).eos_ids)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> tuple[str, str]:
    """Two LoRA adapters (rank 2) of the tiny model, with random B matrices: they change its outputs."""
    d = tmp_path_factory.mktemp("adapters")
    return lora_adapter(tiny_model, d / "a1", 1), lora_adapter(tiny_model, d / "a2", 2)


def _params(eos, **kw) -> SamplingParams:
    """The project's request (``VLLMEngine.generate``): log-prob of each sampled token, no detokenizing."""
    return SamplingParams(**{"n": 1, "max_tokens": 4, "seed": 7, "logprobs": 0, "detokenize": False,
                             "stop_token_ids": eos, **kw})


# -- vLLM ----------------------------------------------------------------------------------------------


def test_vllm_sampling_params_refuse_unknown_fields_and_out_of_range_values():
    with pytest.raises(TypeError, match="Unexpected keyword argument 'max_new_tokens'"):  # SGLang's name
        SamplingParams(max_new_tokens=4)
    with pytest.raises(VLLMValidationError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(VLLMValidationError, match=r"temperature must be in \[0, 2\], got 2.5"):
        SamplingParams(temperature=2.5)
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy sampling, got 2"):
        SamplingParams(temperature=0.0, n=2)
    assert SamplingParams(seed=-1).seed is None and SamplingParams(temperature=0.0, top_p=0.5).top_p == 1.0


def test_vllm_llm_refuses_unknown_engine_arguments_and_values_outside_their_types(tiny_model):
    with pytest.raises(TypeError, match="EngineArgs.__init__\\(\\) got an unexpected keyword argument 'tp_size'"):
        LLM(tiny_model, tp_size=2)  # SGLang's name for tensor_parallel_size
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(tiny_model, logprobs_mode="processed")
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(tiny_model, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="Unknown dtype: 'fp16'"):
        LLM(tiny_model, dtype="fp16")


def test_vllm_worker_extension_must_not_shadow_a_worker_attribute(tiny_model):
    """``WorkerWrapperBase.init_worker``: every attribute of the extension is checked against the worker class."""
    import sys
    import types

    module = types.ModuleType("rft_standin_conflicting_extension")

    class Conflicting(WeightReloadExtension):
        def sleep(self, level: int = 1) -> None:  # the worker's own method
            raise AssertionError("never mixed in")

    module.Conflicting = Conflicting
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(AssertionError, match="already has an attribute sleep, which conflicts with the worker "
                                                 "extension class"):
            LLM(tiny_model, worker_extension_cls=f"{module.__name__}.Conflicting")
    finally:
        del sys.modules[module.__name__]
    llm = LLM(tiny_model, worker_extension_cls=WORKER_EXTENSION)  # the project's extension mixes in
    assert all(hasattr(w, "rft_receive_weights") for w in llm.workers)


@pytest.fixture(scope="module")
def lora_llm(tiny_model):
    """One vLLM stand-in with LoRA enabled (rank up to 8), shared by the tests that do not kill it."""
    return LLM(tiny_model, dtype="float32", enable_lora=True, max_lora_rank=8, worker_extension_cls=WORKER_EXTENSION)


def test_vllm_generate_refuses_params_of_another_length(lora_llm, eos):
    with pytest.raises(VLLMValidationError, match=r"The lengths of prompts \(2\) and params \(1\) must be the same."):
        lora_llm.generate([PROMPT, PROMPT], [_params(eos)], use_tqdm=False)
    with pytest.raises(VLLMValidationError, match=r"lengths of prompts \(2\) and lora_request \(1\) must be the same"):
        lora_llm.generate([PROMPT, PROMPT], _params(eos), use_tqdm=False, lora_request=[None])
    outs = lora_llm.generate([PROMPT, PROMPT], _params(eos), use_tqdm=False)  # one params for every prompt
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_vllm_lora_request_needs_lora_enabled(tiny_model, adapters, eos):
    adapter = adapters[0]
    plain = LLM(tiny_model, dtype="float32")
    with pytest.raises(VLLMValidationError, match="Got lora_request .* but LoRA is not enabled!"):
        plain.generate([PROMPT], _params(eos), lora_request=LoRARequest("a", 1, adapter))
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("a", 0, adapter)


def test_vllm_lora_request_is_applied_and_cached_by_its_id(lora_llm, tiny_model, adapters, tmp_path, eos):
    """The adapter's samples come from the base with the adapter merged (their log-probs are the merged
    model's), not from the base; a second request under the same id with another folder gets the
    adapter first loaded under that id (vLLM's cache)."""
    from rft_core.models.lora import merge_adapter

    a1, a2 = adapters
    params = _params(eos, max_tokens=6, temperature=1.0)
    base = lora_llm.generate([PROMPT], params)[0].outputs[0]
    got = lora_llm.generate([PROMPT], params, lora_request=LoRARequest("p1", 1, a1))[0].outputs[0]
    merged = load_causal_lm(merge_adapter(a1, tmp_path / "merged"))
    tok = load_tokenizer(tiny_model)
    want = batched_response_logprobs(merged, [PROMPT["prompt_token_ids"]], [list(got.token_ids)],
                                     pad_token_id=tok.pad_token_id)[0]
    assert [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(want, abs=1e-4)
    assert (base.token_ids, [s[t].logprob for s, t in zip(base.logprobs, base.token_ids)]) != \
        (got.token_ids, [s[t].logprob for s, t in zip(got.logprobs, got.token_ids)])
    again = lora_llm.generate([PROMPT], params, lora_request=LoRARequest("p1-again", 1, a2))[0].outputs[0]
    assert again.token_ids == got.token_ids  # id 1 still serves a1


def test_vllm_lora_adapter_that_cannot_load_kills_the_engine(tiny_model, adapters, tmp_path, eos):
    llm = LLM(tiny_model, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(EngineDeadError) as dead:
        llm.generate([PROMPT], _params(eos), lora_request=LoRARequest("gone", 1, str(tmp_path / "no-adapter")))
    assert "No adapter found for" in str(dead.value.__cause__)
    with pytest.raises(EngineDeadError):  # every later call fails
        llm.generate([PROMPT], _params(eos))
    big = LLM(tiny_model, dtype="float32", enable_lora=True, max_lora_rank=1)
    with pytest.raises(EngineDeadError) as dead:
        big.generate([PROMPT], _params(eos), lora_request=LoRARequest("r2", 1, adapters[0]))
    assert "LoRA rank 2 is greater than max_lora_rank 1." in str(dead.value.__cause__)


def test_vllm_weights_written_while_asleep_are_an_illegal_access(tiny_model):
    """Sleeping unmaps the weights' GPU memory: writing them is a sticky CUDA error on that worker."""
    llm = LLM(tiny_model, dtype="float32", enable_sleep_mode=True, worker_extension_cls=WORKER_EXTENSION)
    llm.sleep(level=1)
    answers = llm.collective_rpc("rft_reload_weights", args=(tiny_model,))
    assert [a["ok"] for a in answers] == [False]
    assert "CUDA error: an illegal memory access was encountered" in answers[0]["error"]
    with pytest.raises(RuntimeError, match="illegal memory access"):  # sticky: the worker can do nothing more
        llm.wake_up()
    fresh = LLM(tiny_model, dtype="float32", enable_sleep_mode=True, worker_extension_cls=WORKER_EXTENSION)
    fresh.sleep(level=1)
    fresh.wake_up(tags=["weights"])  # the project wakes the weights first: the write lands
    assert fresh.collective_rpc("rft_reload_weights", args=(tiny_model,)) == [{"ok": True}]


def test_vllm_collective_rpc_waits_forever_without_a_timeout_and_fails_when_a_worker_dies(tiny_model):
    import threading

    llm = LLM(tiny_model, dtype="float32", tensor_parallel_size=2)
    llm.workers[1].hang = threading.Event()
    with pytest.raises(TimeoutError, match="RPC call to sleep timed out."):
        llm.collective_rpc("sleep", timeout=0.5)
    llm.workers[1].hang.set()
    other = LLM(tiny_model, dtype="float32", tensor_parallel_size=2)
    other.workers[0].die = True
    with pytest.raises(EngineDeadError):
        other.collective_rpc("sleep", timeout=30)
    with pytest.raises(EngineDeadError):
        other.generate([PROMPT], SamplingParams(max_tokens=2))


# -- SGLang ---------------------------------------------------------------------------------------------


def _sgl_params(eos, **kw) -> dict:
    """The project's request (``SGLangEngine._sampling_params``)."""
    return {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": eos, "no_stop_trim": True,
            "n": 1, **kw}


@pytest.fixture(scope="module")
def sgl(tiny_model):
    return sglang_standin.Engine(model_path=tiny_model, dtype="float32", enable_deterministic_inference=True)


def test_sglang_engine_refuses_unknown_server_arguments(tiny_model):
    with pytest.raises(TypeError, match="Unexpected keyword argument 'tensor_parallel_size'"):
        sglang_standin.Engine(model_path=tiny_model, tensor_parallel_size=2)  # vLLM's name for tp_size


def test_sglang_generate_refuses_unknown_keywords_and_sampling_parameters(sgl, eos):
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        sgl.generate(input_ids=[[1, 20]], sampling_params=[_sgl_params(eos)], return_logprob=True, seed=3)
    with pytest.raises(TypeError, match="Unexpected keyword argument 'max_tokens'"):  # vLLM's name
        sgl.generate(input_ids=[[1, 20]], sampling_params=[_sgl_params(eos, max_tokens=4)], return_logprob=True)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        sgl.generate(input_ids=[[1, 20]], sampling_params=[_sgl_params(eos, top_p=0.0)], return_logprob=True)
    one = sgl.generate(input_ids=[1, 20], sampling_params=_sgl_params(eos, sampling_seed=1), return_logprob=True)
    assert isinstance(one, dict) and one["output_ids"]  # one request: one dict


def test_sglang_unseeded_requests_follow_deterministic_inference(tiny_model, sgl, eos):
    """With ``enable_deterministic_inference`` an unseeded request gets seed 42 (two come out the same);
    without it the seed plays no part and every request draws its own stream."""
    def outputs(engine, params):
        return [o["output_ids"] for o in engine.generate(input_ids=[[1, 20]] * 3, sampling_params=[params] * 3,
                                                         return_logprob=True)]

    unseeded = outputs(sgl, _sgl_params(eos, max_new_tokens=6))
    assert len({tuple(o) for o in unseeded}) == 1
    assert outputs(sgl, _sgl_params(eos, max_new_tokens=6, sampling_seed=42)) == unseeded
    free = sglang_standin.Engine(model_path=tiny_model, dtype="float32")
    drawn = outputs(free, _sgl_params(eos, max_new_tokens=6, sampling_seed=42))
    assert len({tuple(o) for o in drawn}) > 1  # the seed is not used without deterministic inference


def test_sglang_lora_adapters_fail_to_load_as_upstream_answers(tiny_model, adapters, tmp_path, eos):
    plain = sglang_standin.Engine(model_path=tiny_model, dtype="float32")
    adapter = adapters[0]
    answer = plain.load_lora_adapter("a", adapter)
    assert not answer.success and answer.error_message == sglang_standin.LORA_DISABLED
    with pytest.raises(ValueError, match="LoRA adapter 'a' was requested, but LoRA is not enabled"):
        plain.generate(input_ids=[[1, 20]], sampling_params=[_sgl_params(eos)], return_logprob=True, lora_path=["a"])
    lora = sglang_standin.Engine(model_path=tiny_model, dtype="float32", enable_lora=True, max_lora_rank=8,
                                 lora_target_modules=["all"])
    missing = lora.load_lora_adapter("gone", str(tmp_path / "no-adapter"))
    assert not missing.success and "No such file or directory" in missing.error_message
    with pytest.raises(ValueError, match="The following requested LoRA adapters are not loaded: gone"):
        lora.generate(input_ids=[[1, 20]], sampling_params=[_sgl_params(eos)], return_logprob=True, lora_path=["gone"])
    assert lora.load_lora_adapter("a", adapter).success
    again = lora.load_lora_adapter("a", adapter)
    assert not again.success and "because it is already loaded" in again.error_message
    small = sglang_standin.Engine(model_path=tiny_model, dtype="float32", enable_lora=True, max_lora_rank=1)
    too_big = small.load_lora_adapter("a", adapter)
    assert not too_big.success and "with rank 2 is incompatible" in too_big.error_message
    assert not lora.unload_lora_adapter("never").success


def test_sglang_newer_loader_raises_on_an_unknown_name_inside_the_scheduler(tiny_model, monkeypatch):
    """``SGLANG_ENABLE_WEIGHT_LOADER_V2``: ``_load_weights_v2``'s ``AutoWeightsLoader`` raises on a name the
    model does not have (the default loader skips it), inside the scheduler, which dies."""
    weights = state_tensors(load_causal_lm(tiny_model))
    extra = [("model.layers.0.self_attn.rotary.weight", torch.ones(4))]
    legacy = sglang_standin.Engine(model_path=tiny_model, dtype="float32")
    assert legacy.begin_weight_update() == (True, "Success")
    assert legacy.update_weights_from_tensor(extra, flush_cache=False) == (True, "Success")
    monkeypatch.setenv("SGLANG_ENABLE_WEIGHT_LOADER_V2", "1")
    v2 = sglang_standin.Engine(model_path=tiny_model, dtype="float32")
    assert v2.begin_weight_update() == (True, "Success")
    assert v2.update_weights_from_tensor(list(weights.items()), flush_cache=False) == (True, "Success")
    with pytest.raises(sglang_standin.SchedulerCrash, match="No module or parameter named "
                                                            "'model.layers.0.self_attn.rotary'"):
        v2.update_weights_from_tensor(extra, flush_cache=False)


def test_sglang_update_from_disk_needs_no_session_but_from_tensor_does(sgl, tiny_model):
    assert sgl.update_weights_from_disk(tiny_model)[0] is True  # weight_updater.py checks no session here
    assert sgl.update_weights_from_tensor([("model.norm.weight", torch.ones(32))]) == (
        False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")


def test_install_makes_import_find_the_standins(monkeypatch):
    vllm_standin.install(monkeypatch)
    sglang_standin.install(monkeypatch)
    import sglang
    import vllm
    from vllm.lora.request import LoRARequest as Imported

    assert vllm.LLM is LLM and vllm.SamplingParams is SamplingParams and Imported is LoRARequest
    assert sglang.Engine is sglang_standin.Engine
