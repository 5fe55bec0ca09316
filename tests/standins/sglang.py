"""A stand-in for ``sglang.Engine`` (SGLang 0.5.23, the release ``sglang>=0.5.3`` installs today,
``python/sglang/srt/entrypoints/engine.py``), for a machine without a GPU.

Copied behaviour:

- ``generate(input_ids=[...], sampling_params=[...], return_logprob=True, lora_path=[...])``
  answers one dict per request: ``output_ids`` and ``meta_info`` {``finish_reason``:
  {"type": "stop", "matched": id} | {"type": "length", "length": n}, ``output_token_logprobs``:
  [(logprob, token_id, None), ...]}; ``sampling_params["sampling_seed"]`` seeds a request.
- **The weight-update session** (``managers/scheduler_components/weight_updater.py``):
  ``begin_weight_update()`` / ``end_weight_update()`` answer (success, message);
  ``update_weights_from_tensor`` outside a session answers (False, "update_weights_from_tensor must
  run between begin_weight_update() and end_weight_update()"); a second ``begin`` answers (False,
  "a weight-update session is already open; ..."), an ``end`` without ``begin`` (False, "no
  weight-update session is open; ..."). ``session=False`` models the releases before the session
  (no such methods: 0.5.3 .. 0.5.20).
- **Loading** (``model_executor/model_runner_components/weight_updater.py`` and
  ``models/qwen2.py`` ``_legacy_load_weights``): each tensor-parallel scheduler loads its shard of
  the fused model (``tests/standins/engine_model.py``, flavour ``sglang``): an unknown name is
  logged and skipped, nothing checks that every parameter was loaded, and a tensor of another
  shape fails the weight loader's assertion inside the scheduler, whose event loop then dies
  ("Scheduler hit an exception", SIGQUIT to the engine's process, whose handler kills the
  process tree): ``SchedulerCrash`` here, and every later call fails.
- **Cache flush** (``Scheduler.flush_cache``): refused while requests are running or queued
  (``is_fully_idle`` false): ``flush_cache()`` answers ``success=False``, and an update with
  ``flush_cache=True`` answers (False, "Weights were updated, but the cache was not flushed
  because requests are still running or queued. Retract or finish them, then call
  /flush_cache."). ``running`` counts in-flight requests (a test sets it).
- ``update_weights_from_disk(model_path, load_format=None)`` answers (success, message,
  num_paused_requests) and needs no session; LoRA adapters load by name; memory release / resume.

Not modelled: the scheduler processes (shards live in this process), CUDA IPC of the tensors
(``MultiprocessingSerializer``), the forward pass (generation runs through the HF engine on an
HF model holding what the shards hold), LoRA in generation.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from tests.standins.engine_model import EngineModel, load_hf_into
from tests.standins.vllm import checkpoint_tensors

log = logging.getLogger("tests.standins.sglang")

NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
               "Retract or finish them, then call /flush_cache.")


class SchedulerCrash(BaseException):  # noqa: N818  the engine's process tree is killed, not an error to handle
    """A scheduler process died on an exception; SGLang's SIGQUIT handler kills the engine's process."""


class Engine:
    """``sglang.Engine`` (see the module docstring). Every call is recorded in ``events``.

    Args:
        model_path: the checkpoint the schedulers load at start.
        tok: the tokenizer (the HF engine generates with it).
        tp_size, dtype: the schedulers and their shards.
        session: whether this release has the weight-update session (0.5.21+).
        hf: the HF model generation runs on; None loads one from ``model_path``.
        eos_early, fail_update: as the vLLM stand-in's ``eos_early``; ``fail_update`` makes
            ``update_weights_from_disk`` answer failure.
    """

    def __init__(self, model_path: str, tok, *, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                 session: bool = True, hf: torch.nn.Module | None = None, eos_early: int | None = None,
                 fail_update: bool = False, load: bool = True) -> None:
        from rft_core.engines.hf import HFEngine
        from rft_core.models.loading import load_causal_lm

        hf = hf if hf is not None else load_causal_lm(model_path).eval()
        self.shards = [EngineModel(hf.config, tp_rank=r, tp_size=tp_size, dtype=dtype, flavour="sglang")
                       for r in range(tp_size)]
        if load:
            for s in self.shards:
                s.load_weights(checkpoint_tensors(model_path))
        self.hf = HFEngine(hf, tok)
        self.eos_early, self.fail_update = eos_early, fail_update
        self.events: list[tuple] = []
        self.calls: list = []
        self.adapters: dict[str, str] = {}
        self.running = 0
        self._session: bool | None = None
        self.dead: str | None = None
        if session:
            self.begin_weight_update = self._begin
            self.end_weight_update = self._end

    def _alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"SGLang engine is dead: {self.dead}")

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, lora_path=None, **kw):
        self._alive()
        assert return_logprob is True and len(input_ids) == len(sampling_params)
        self.calls.append((input_ids, sampling_params, lora_path))
        self.events.append(("generate", len(input_ids)))
        if lora_path is None:
            load_hf_into(self.hf.model, self.shards)
        outs = []
        for i, (ids, sp) in enumerate(zip(input_ids, sampling_params)):
            assert sp["n"] == 1 and sp["no_stop_trim"] is True and sp["stop_token_ids"] == sorted(self.hf.eos_ids)
            if lora_path is not None:
                assert lora_path[i] in self.adapters
            greedy = sp["temperature"] == 0
            g = self.hf.generate([ids], n_samples_per_prompt=1, max_new_tokens=sp["max_new_tokens"],
                                 temperature=1.0 if greedy else sp["temperature"], top_p=sp["top_p"],
                                 seed=sp.get("sampling_seed", 0), batch_size=1, greedy=greedy)[0]
            tokens, lps, finish = list(g.response_token_ids), list(g.logprobs), g.finish_reason
            if i == 0 and self.eos_early is not None and len(tokens) >= 3:
                tokens, finish = tokens[:2] + [self.eos_early] + tokens[3:], "length"
            reason = {"type": "stop", "matched": tokens[-1]} if finish == "stop" else {"type": "length", "length": len(tokens)}
            outs.append({"output_ids": tokens, "meta_info": {
                "id": str(i), "finish_reason": reason, "prompt_tokens": len(ids), "completion_tokens": len(tokens),
                "output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, lps)]}})
        return outs

    # -- weights ----------------------------------------------------------------------------------
    def _flush(self) -> bool:
        return self.running == 0

    def _begin(self, selector: str = "all"):
        self._alive()
        self.events.append(("begin_weight_update",))
        if self._session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = True
        return True, "Success"

    def _end(self):
        self._alive()
        self.events.append(("end_weight_update",))
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = None
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive()
        self.events.append(("update_weights_from_tensor", len(named_tensors), flush_cache))
        if hasattr(self, "begin_weight_update") and not self._session:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and "
                           "end_weight_update()")
        assert load_format is None, "only the default loader is modelled"
        try:
            for shard in self.shards:
                shard.load_weights([(n, t.clone()) for n, t in named_tensors])
        except Exception as exc:  # noqa: BLE001  the scheduler's event loop dies on it
            self.dead = f"Scheduler hit an exception: {type(exc).__name__}: {exc}"
            raise SchedulerCrash(self.dead) from exc
        if flush_cache and not self._flush():
            return False, NOT_FLUSHED
        return True, "Success"

    def update_weights_from_disk(self, model_path, load_format=None):
        self._alive()
        self.events.append(("update_weights_from_disk", model_path))
        if self.fail_update:
            return False, f"cannot load {model_path}", 0
        for shard in self.shards:
            shard.load_weights(checkpoint_tensors(model_path))
        if not self._flush():
            return False, NOT_FLUSHED, 0
        return True, "Succeeded to update model weights.", 0

    def flush_cache(self):
        self.events.append(("flush_cache",))
        return SimpleNamespace(success=self._flush(), message="" if self._flush() else "pending requests")

    # -- LoRA, memory, lifetime ---------------------------------------------------------------------
    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        self.events.append(("load_lora_adapter", lora_name, lora_path))
        self.adapters[lora_name] = lora_path
        return SimpleNamespace(success=True, error_message=None)

    def unload_lora_adapter(self, lora_name):
        self.events.append(("unload_lora_adapter", lora_name))
        del self.adapters[lora_name]
        return SimpleNamespace(success=True, error_message=None)

    def release_memory_occupation(self, tags=None):
        self.events.append(("release_memory_occupation",))
        for shard in self.shards:  # released weights are not kept (the project reloads them)
            for _, p in shard.named_parameters():
                p.data.fill_(float("nan"))

    def resume_memory_occupation(self, tags=None):
        self.events.append(("resume_memory_occupation",))

    def shutdown(self):
        self.events.append(("shutdown",))
