"""A stand-in for ``sglang.Engine`` (SGLang 0.5.23, the release constraints-gpu.txt pins,
``python/sglang/srt/entrypoints/engine.py``), for a machine without a GPU.

Copied behaviour, refusals included:

- **Engine arguments**: ``Engine(**kwargs)`` builds ``ServerArgs(**kwargs)``, a msgspec struct
  (``python/sglang/srt/server_args.py``, its fields in ``arg_groups/fields/*.py``); an unknown
  keyword is refused (msgspec: ``TypeError: Unexpected keyword argument ...``). ``SERVER_ARGS`` lists the
  fields modelled (``tests/standins/test_upstream.py`` checks each is one of 0.5.23's).
- ``generate(prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
  lora_path=None, stream=False)``: one request (``input_ids`` a list of ints) answers a dict, a
  batch a list of dicts: ``output_ids`` and ``meta_info`` {``finish_reason``: {"type": "stop",
  "matched": id} | {"type": "length", "length": n}, ``output_token_logprobs``: [(logprob,
  token_id, None), ...]}. A keyword outside its signature is a ``TypeError`` (the stand-in takes
  the parameters it models, each one of 0.5.23's). A sampling-parameter key that
  ``SamplingParams`` (``sampling/sampling_params.py``, a msgspec struct) does not have is refused
  (``TypeError: Unexpected keyword argument ...``), out-of-range values by ``verify``
  (``ValueError``); a ``lora_path`` on an engine without ``enable_lora``, or naming an adapter
  that is not loaded, is refused (``ValueError``, ``managers/tokenizer_manager.py``,
  ``lora/lora_registry.py``).
- **Seeds** (``sampling/sampling_batch_info.py``): with ``enable_deterministic_inference`` a
  request is sampled with its ``sampling_seed``, an unseeded one with 42 (two unseeded requests
  come out the same); without it the seed is not used and every request draws its own random
  stream (not reproducible).
- **The weight-update session** (``managers/scheduler_components/weight_updater.py``):
  ``begin_weight_update()`` / ``end_weight_update()`` answer (success, message);
  ``update_weights_from_tensor`` outside a session answers (False, "update_weights_from_tensor must
  run between begin_weight_update() and end_weight_update()"); a second ``begin`` answers (False,
  "a weight-update session is already open; ..."), an ``end`` without ``begin`` (False, "no
  weight-update session is open; ..."). ``update_weights_from_disk`` needs no session (it checks
  none). ``OlderEngine`` models the releases before the session (no such methods: 0.5.3 ..
  0.5.20).
- **Loading** (``model_executor/model_runner_components/weight_updater.py`` and
  ``models/qwen2.py``): each tensor-parallel scheduler loads its shard of the fused model
  (``tests/standins/engine_model.py``): by default through ``_legacy_load_weights`` (an unknown
  name is logged and skipped), with ``SGLANG_ENABLE_WEIGHT_LOADER_V2`` set at start through
  ``_load_weights_v2`` (an unknown name raises); nothing checks that every parameter was loaded,
  and a tensor of another shape (or, in the newer loader, an unknown name) fails inside the
  scheduler, whose event loop then dies ("Scheduler hit an exception", SIGQUIT to the engine's
  process, whose handler kills the process tree): ``SchedulerCrash`` here, and every later call
  fails.
- **Cache flush** (``Scheduler.flush_cache``): refused while requests are running or queued
  (``is_fully_idle`` false): ``flush_cache()`` answers ``success=False``, and an update with
  ``flush_cache=True`` answers (False, "Weights were updated, but the cache was not flushed
  because requests are still running or queued. Retract or finish them, then call
  /flush_cache."). ``running`` counts in-flight requests (a test sets it).
- **LoRA adapters** (``managers/tokenizer_control_mixin.py`` ``load_lora_adapter``,
  ``lora/lora_manager.py`` ``_load_lora_adapter`` / ``validate_new_adapter``,
  ``lora/lora_config.py``): answers ``LoRAUpdateOutput(success, error_message)``; failure without
  ``enable_lora``, for a path that is no adapter folder, a name already loaded, or a rank above
  ``max_lora_rank``. Unloading an unknown name fails likewise. A request naming a loaded adapter
  (``generate``'s ``lora_path``, one name per request; None: the base) samples from the base
  weights with that adapter applied (here: merged by peft into a copy of the HF model, as the
  vLLM stand-in serves a ``LoRARequest``).
- ``update_weights_from_disk(model_path, load_format=None)`` answers (success, message,
  num_paused_requests); memory release / resume.

``install(monkeypatch)`` puts ``Engine`` where ``import sglang`` finds it.

Not modelled: the scheduler processes (shards live in this process), CUDA IPC of the tensors
(``MultiprocessingSerializer``), the forward pass (generation runs through the HF engine on an
HF model holding what the shards hold; its dtype is the HF model's), LoRA kernels (an adapter is
merged into a copy of that model).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.standins.engine_model import EngineModel, load_hf_into
from tests.standins.vllm import checkpoint_tensors

log = logging.getLogger("tests.standins.sglang")

NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
               "Retract or finish them, then call /flush_cache.")
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# The ServerArgs fields (python/sglang/srt/arg_groups/fields/*.py, 0.5.23) this stand-in takes, with their defaults
SERVER_ARGS = {"model_path": None, "tp_size": 1, "mem_fraction_static": None, "dtype": "auto",
               "skip_tokenizer_init": False, "enable_memory_saver": False, "enable_deterministic_inference": False,
               "context_length": None, "enable_lora": None, "max_lora_rank": None, "lora_target_modules": None,
               "log_level": "info", "random_seed": None}
# SamplingParams fields (python/sglang/srt/sampling/sampling_params.py, 0.5.23) modelled, with their defaults
SAMPLING_FIELDS = {"max_new_tokens": 128, "stop": None, "stop_token_ids": None, "temperature": 1.0, "top_p": 1.0,
                   "top_k": -1, "min_p": 0.0, "min_new_tokens": 0, "n": 1, "ignore_eos": False,
                   "skip_special_tokens": True, "no_stop_trim": False, "sampling_seed": None}
UNSEEDED = 42  # sampling_batch_info.py: an unseeded request's seed under deterministic inference
DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16}


class SchedulerCrash(BaseException):  # noqa: N818  the engine's process tree is killed, not an error to handle
    """A scheduler process died on an exception; SGLang's SIGQUIT handler kills the engine's process."""


def check_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams(**params)`` and its ``verify`` (the modelled fields): the fields with defaults.

    Raises:
        TypeError: an unknown key. ValueError: a value ``verify`` refuses.
    """
    for name in params:
        if name not in SAMPLING_FIELDS:
            raise TypeError(f"Unexpected keyword argument {name!r}")
    sp = {**SAMPLING_FIELDS, **params}
    seed = sp["sampling_seed"]
    checks = [(sp["temperature"] >= 0.0, f"temperature must be a non-negative finite number, got {sp['temperature']}."),
              (0.0 < sp["top_p"] <= 1.0, f"top_p must be in (0, 1], got {sp['top_p']}."),
              (sp["n"] >= 1, f"n must be at least 1, got {sp['n']}."),
              (sp["max_new_tokens"] is None or sp["max_new_tokens"] >= 0,
               f"max_new_tokens must be at least 0, got {sp['max_new_tokens']}."),
              (seed is None or (isinstance(seed, int) and -(2**63) <= seed <= 2**63 - 1),
               f"sampling_seed must be an integer in [-2**63, 2**63 - 1], got {seed}.")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return sp


class Engine:
    """``sglang.Engine`` (see the module docstring). Every call is recorded in ``events``, the
    server arguments in ``server_args``. Set by tests: ``eos_early`` (as the vLLM stand-in's),
    ``fail_update`` (``update_weights_from_disk`` answers failure), ``running`` (requests in
    flight)."""

    def __init__(self, **kwargs: Any) -> None:
        from rft_core.engines.hf import HFEngine

        for name in kwargs:
            if name not in SERVER_ARGS:
                raise TypeError(f"Unexpected keyword argument {name!r}")  # msgspec's refusal (ServerArgs)
        self.server_args = {**SERVER_ARGS, **kwargs}
        model_path = self.server_args["model_path"]
        if model_path is None:
            raise TypeError("Missing required argument 'model_path'")
        hf, tok = self._hf_model(model_path)
        flavour = "sglang_v2" if os.environ.get("SGLANG_ENABLE_WEIGHT_LOADER_V2", "").lower() in ("1", "true") \
            else "sglang"
        self.shards = [EngineModel(hf.config, tp_rank=r, tp_size=self.server_args["tp_size"], dtype=self._dtype(hf),
                                   flavour=flavour) for r in range(self.server_args["tp_size"])]
        for s in self.shards:
            s.load_weights(self._weights(model_path))
        self.hf = HFEngine(hf, tok)
        self.eos_early: int | None = None
        self.fail_update = False
        self.events: list[tuple] = []
        self.calls: list = []
        self.adapters: dict[str, str] = {}
        self.running = 0
        self._session: bool | None = None
        self.dead: str | None = None
        self._random = random.Random()  # seeded from the OS: an unseeded stream is not reproducible

    # -- what the stand-in loads (tests/rft_core/engines/fakes.py overrides these) ----------------------
    def _hf_model(self, model_path: str):
        from rft_core.models.loading import load_causal_lm, load_tokenizer

        return load_causal_lm(model_path).eval(), load_tokenizer(model_path)

    def _dtype(self, hf: torch.nn.Module) -> torch.dtype:
        """``--dtype``: a name; ``auto`` is float16 for a float32 or float16 checkpoint, else its dtype."""
        dtype = self.server_args["dtype"]
        if dtype == "auto":
            got = getattr(hf.config, "torch_dtype", None) or torch.float32
            got = DTYPES.get(got, got) if isinstance(got, str) else got
            return torch.float16 if got in (torch.float32, torch.float16) else got
        if dtype not in DTYPES:
            raise ValueError(f"Unknown dtype: {dtype!r}")
        return DTYPES[dtype]

    def _weights(self, model_path: str):
        return checkpoint_tensors(model_path)

    # -----------------------------------------------------------------------------------------------------
    def _alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"SGLang engine is dead: {self.dead}")

    def _seed(self, sp: dict[str, Any]) -> int:
        if self.server_args["enable_deterministic_inference"]:
            return UNSEEDED if sp["sampling_seed"] is None else sp["sampling_seed"]
        return self._random.getrandbits(31)

    def _check_lora(self, names: list) -> None:
        if any(names) and not self.server_args["enable_lora"]:
            raise ValueError(f"LoRA adapter '{next(n for n in names if n)}' was requested, but LoRA is not enabled. "
                             "Please launch the server with --enable-lora flag and preload adapters using --lora-paths "
                             "or /load_lora_adapter endpoint.")
        for name in names:
            if name is not None and name not in self.adapters:
                raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                 f"Loaded adapters: {self.adapters.keys()}.")

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, lora_path=None,
                 stream=False):
        self._alive()
        single = bool(input_ids) and isinstance(input_ids[0], int)
        input_ids = [input_ids] if single else list(input_ids)
        raw = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(input_ids)
        params = [check_sampling_params(p) for p in raw]
        names = lora_path if isinstance(lora_path, list) else [lora_path] * len(input_ids)
        self._check_lora(names)
        assert return_logprob is True and len(input_ids) == len(params) and not stream
        self.calls.append((input_ids, raw, lora_path))
        self.events.append(("generate", len(input_ids)))
        load_hf_into(self.hf.model, self.shards)
        engines = {name: self._lora_engine(name) for name in set(names) if name is not None}
        outs = [self._one(i, ids, sp, self.hf if name is None else engines[name])
                for i, (ids, sp, name) in enumerate(zip(input_ids, params, names))]
        return outs[0] if single else outs

    def _lora_engine(self, name: str):
        """An HF engine of the base weights with the adapter loaded as ``name`` merged in."""
        from peft import PeftModel

        from rft_core.engines.hf import HFEngine

        return HFEngine(PeftModel.from_pretrained(copy.deepcopy(self.hf.model), self.adapters[name])
                        .merge_and_unload().eval(), self.hf.tokenizer)

    def _one(self, i: int, ids: list[int], sp: dict[str, Any], engine) -> dict:
        """One request's answer (the module docstring's dict), sampled by ``engine``."""
        assert sp["n"] == 1 and sp["no_stop_trim"] is True and sp["stop_token_ids"] == sorted(self.hf.eos_ids)
        greedy = sp["temperature"] == 0
        g = engine.generate([ids], n_samples_per_prompt=1, max_new_tokens=sp["max_new_tokens"],
                             temperature=1.0 if greedy else sp["temperature"], top_p=sp["top_p"], seed=self._seed(sp),
                             batch_size=1, greedy=greedy)[0]
        tokens, lps, finish = list(g.response_token_ids), list(g.logprobs), g.finish_reason
        if i == 0 and self.eos_early is not None and len(tokens) >= 3:
            tokens, finish = tokens[:2] + [self.eos_early] + tokens[3:], "length"
        reason = {"type": "stop", "matched": tokens[-1]} if finish == "stop" else {"type": "length", "length": len(tokens)}
        return {"output_ids": tokens, "meta_info": {
            "id": str(i), "finish_reason": reason, "prompt_tokens": len(ids), "completion_tokens": len(tokens),
            "output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, lps)]}}

    # -- weights ----------------------------------------------------------------------------------
    def _flush(self) -> bool:
        return self.running == 0

    def begin_weight_update(self, selector: str = "all"):
        self._alive()
        self.events.append(("begin_weight_update",))
        if self._session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self._session = True
        return True, "Success"

    def end_weight_update(self):
        self._alive()
        self.events.append(("end_weight_update",))
        if not self._session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session = None
        return True, "Success"

    def _in_session(self) -> bool:
        return bool(self._session)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive()
        self.events.append(("update_weights_from_tensor", len(named_tensors), flush_cache))
        if not self._in_session():
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
    def _adapter_error(self, lora_name: str, lora_path: str) -> str | None:
        """Why ``load_lora_adapter`` fails (None: it loads)."""
        if not self.server_args["enable_lora"]:
            return LORA_DISABLED
        config = Path(lora_path) / "adapter_config.json"
        if not config.is_file():
            return f"[Errno 2] No such file or directory: '{config}'"
        if lora_name in self.adapters:
            return f"Failed to load LoRA adapter {lora_name} because it is already loaded"
        rank, limit = json.loads(config.read_text())["r"], self.server_args["max_lora_rank"]
        if limit is not None and rank > limit:
            return (f"LoRA adapter {lora_name} with rank {rank} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        return None

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        self.events.append(("load_lora_adapter", lora_name, lora_path))
        error = self._adapter_error(lora_name, lora_path)
        if error is None:
            self.adapters[lora_name] = lora_path
        return SimpleNamespace(success=error is None, error_message=error, loaded_adapters=dict(self.adapters))

    def unload_lora_adapter(self, lora_name):
        self.events.append(("unload_lora_adapter", lora_name))
        if lora_name not in self.adapters:
            return SimpleNamespace(success=False, error_message=f"LoRA adapter {lora_name} is not loaded",
                                   loaded_adapters=dict(self.adapters))
        del self.adapters[lora_name]
        return SimpleNamespace(success=True, error_message=None, loaded_adapters=dict(self.adapters))

    def release_memory_occupation(self, tags=None):
        self.events.append(("release_memory_occupation",))
        for shard in self.shards:  # released weights are not kept (the project reloads them)
            for _, p in shard.named_parameters():
                p.data.fill_(float("nan"))

    def resume_memory_occupation(self, tags=None):
        self.events.append(("resume_memory_occupation",))

    def shutdown(self):
        self.events.append(("shutdown",))


class OlderEngine(Engine):
    """SGLang 0.5.3 .. 0.5.20: no weight-update session (``begin_weight_update`` /
    ``end_weight_update`` do not exist; updates need none)."""

    def __getattribute__(self, name: str):
        if name in ("begin_weight_update", "end_weight_update"):
            raise AttributeError(f"'Engine' object has no attribute {name!r}")
        return super().__getattribute__(name)

    def _in_session(self) -> bool:
        return True


def install(monkeypatch) -> types.ModuleType:
    """Make ``import sglang`` (``sglang.Engine``) find this stand-in for the rest of the test; returns the module."""
    module = types.ModuleType("sglang")
    module.Engine = Engine
    monkeypatch.setitem(sys.modules, "sglang", module)
    return module
