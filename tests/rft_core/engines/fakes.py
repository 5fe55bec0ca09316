"""``vllm.LLM`` and ``sglang.Engine`` for the engine adapter tests (no GPU here): the strict
stand-ins of ``tests/standins`` (vLLM 0.33.0, SGLang 0.5.23: what they copy, refusals included, is
in their docstrings), started from an HF model in memory instead of a checkpoint folder. Their
engine arguments are checked as the stand-ins check them; the shards hold the model's weights in
the model's dtype."""
from __future__ import annotations

from rft_core.engines.vllm import WORKER_EXTENSION
from rft_core.weightsync.plan import state_tensors
from tests.standins import sglang as sglang_standin
from tests.standins import vllm as vllm_standin

SamplingParams = vllm_standin.SamplingParams  # vllm.SamplingParams (strict: unknown fields refused)


def _path(model) -> str:
    return getattr(model.config, "_name_or_path", "") or "unused"


class HFBackedLLM(vllm_standin.LLM):
    """``tests.standins.vllm.LLM`` holding ``model``'s weights in ``model``'s dtype (the project's
    ``WeightReloadExtension`` mixed in unless ``engine_args`` name another); generation runs on
    ``model`` itself. ``engine_args``: ``vllm.LLM``'s keyword arguments, checked as the stand-in checks them."""

    def __init__(self, hf_model, tok, *, eos_early=None, **engine_args):
        self._model, self._tok = hf_model, tok
        engine_args.setdefault("worker_extension_cls", WORKER_EXTENSION)
        super().__init__(engine_args.pop("model", _path(hf_model)), **engine_args)
        self.eos_early = eos_early

    def _hf_model(self, model, tokenizer):
        return self._model, self._tok

    def _dtype(self, dtype, hf):
        return hf.dtype

    def _weights(self, model):
        return list(state_tensors(self._model).items())


class HFBackedSGLang(sglang_standin.Engine):
    """``tests.standins.sglang.Engine`` with its schedulers holding ``model``'s weights in
    ``model``'s dtype; generation runs on ``model`` itself. ``server_args``: ``sglang.Engine``'s
    keyword arguments, checked as the stand-in checks them (``enable_deterministic_inference`` on
    unless given)."""

    def __init__(self, hf_model, tok, *, eos_early=None, fail_update=False, **server_args):
        self._model, self._tok = hf_model, tok
        server_args.setdefault("model_path", _path(hf_model))
        server_args.setdefault("enable_deterministic_inference", True)
        super().__init__(**server_args)
        self.eos_early, self.fail_update = eos_early, fail_update

    def _hf_model(self, model_path):
        return self._model, self._tok

    def _dtype(self, hf):
        return hf.dtype

    def _weights(self, model_path):
        return list(state_tensors(self._model).items())


class OlderHFBackedSGLang(HFBackedSGLang, sglang_standin.OlderEngine):
    """``HFBackedSGLang`` of a release before the weight-update session (0.5.3 .. 0.5.20)."""


def lora_adapter(model_path: str, out, seed: int, *, rank: int = 2) -> str:
    """A peft LoRA adapter folder (rank ``rank`` on every linear layer, random ``seed``) on the base
    ``model_path``, with the base's tokenizer: what a LoRA policy checkpoint holds. Its B matrices
    are random too (peft starts them at 0), as after training: the adapter changes the outputs."""
    import torch

    from rft_core.models.loading import load_causal_lm, load_tokenizer
    from rft_core.models.lora import apply_lora

    torch.manual_seed(seed)
    model = apply_lora(load_causal_lm(model_path, trainable=True), rank=rank, alpha=4.0, dropout=0.0,
                       target_modules="all-linear", base_path=model_path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(out)
    load_tokenizer(model_path).save_pretrained(out)
    return str(out)
