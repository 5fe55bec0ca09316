"""``vllm.LLM`` and ``sglang.Engine`` for the engine adapter tests (no GPU here): the strict
stand-ins of ``tests/standins`` (vLLM 0.33.0, SGLang 0.5.23: what they copy is in their
docstrings), started from an HF model in memory instead of a checkpoint folder."""
from __future__ import annotations

from types import SimpleNamespace

from rft_core.engines.vllm import WeightReloadExtension
from rft_core.weightsync.plan import state_tensors
from tests.standins import sglang as sglang_standin
from tests.standins import vllm as vllm_standin


class SamplingParams(SimpleNamespace):
    """vllm.SamplingParams' keyword arguments, recorded."""


def _path(model) -> str:
    return getattr(model.config, "_name_or_path", "") or "unused"


class HFBackedLLM(vllm_standin.LLM):
    """``tests.standins.vllm.LLM`` with one worker (the project's ``WeightReloadExtension`` mixed
    in) holding ``model``'s weights in ``model``'s dtype; generation runs on ``model`` itself."""

    def __init__(self, model, tok, *, eos_early=None, tensor_parallel_size: int = 1):
        super().__init__(_path(model), tok, tensor_parallel_size=tensor_parallel_size, dtype=model.dtype,
                         extension=WeightReloadExtension, hf=model, eos_early=eos_early, load=False)
        weights = list(state_tensors(model).items())
        for w in self.workers:
            w.model_runner.model.load_weights(weights)


class HFBackedSGLang(sglang_standin.Engine):
    """``tests.standins.sglang.Engine`` with its schedulers holding ``model``'s weights in
    ``model``'s dtype; generation runs on ``model`` itself."""

    def __init__(self, model, tok, *, eos_early=None, fail_update=False, session: bool = True, tp_size: int = 1):
        super().__init__(_path(model), tok, tp_size=tp_size, dtype=model.dtype, session=session, hf=model,
                         eos_early=eos_early, fail_update=fail_update, load=False)
        weights = list(state_tensors(model).items())
        for shard in self.shards:
            shard.load_weights(weights)
