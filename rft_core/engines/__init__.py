"""Rollout engines: batched generation behind one interface (``hf``: ``HFEngine``; ``vllm``:
``VLLMEngine``; ``sglang``: ``SGLangEngine``), and what the two GPU inference engines share:
the dtype they run a policy in, one random stream per sample, and a process-level cache that
keeps one engine alive across iterations (weights reloaded in place, not the engine rebuilt).

Nothing here imports vllm or sglang; their modules import them lazily.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, ClassVar

import torch

from rft_core.models.pretrained import resolve_model_path
from rft_core.models.vl import is_vl_model

log = logging.getLogger("rft_core.engines")

# Seed widths: vLLM seeds a torch.Generator per request (64-bit seeds); SGLang 0.5.3 stores
# ``sampling_seed`` in an int32 tensor (``sglang/srt/sampling/sampling_batch_info.py``).
VLLM_SEED_BITS = 62
SGLANG_SEED_BITS = 31


def engine_dtype(policy_dtype: str, *, bf16_supported: bool | None = None) -> str:
    """The dtype a GPU inference engine (vLLM, SGLang) runs a policy configured as ``policy_dtype``.

    bfloat16 and float16 are kept. float32 (the CPU default, and the dtype of the converted
    default model) and ``auto`` become bfloat16 when the GPU supports it, else float16, with a
    log line: vLLM's and SGLang's ``auto`` read the checkpoint's ``torch_dtype`` and turn float32
    into float16 (vLLM ``LLM`` docstring, ``vllm/entrypoints/llm.py``; SGLang ``--dtype``), and
    vLLM's LoRA dtype is auto/float16/bfloat16 only (``LoRADType``, ``vllm/config/lora.py``; auto
    is the model's). The engine's log-probs then come from a 16-bit model while the actor stage
    recomputes ``old_logprobs`` in the policy dtype (its default).

    Args:
        bf16_supported: None asks ``torch.cuda.is_bf16_supported()`` (False without CUDA).
    Raises:
        ValueError: an unknown dtype name.
    """
    if policy_dtype in ("bfloat16", "float16"):
        return policy_dtype
    if policy_dtype not in ("float32", "auto"):
        raise ValueError(f"unknown policy dtype {policy_dtype!r}; valid names: float32, bfloat16, float16, auto")
    if bf16_supported is None:
        bf16_supported = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    chosen = "bfloat16" if bf16_supported else "float16"
    log.info("policy dtype %s: the rollout engine runs in %s (%s)", policy_dtype, chosen,
             "the GPU supports bfloat16" if bf16_supported else "no bfloat16 support on this device")
    return chosen


@functools.lru_cache(maxsize=8)
def hf_layout(model_path: str) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """(name, shape, floating) of every tensor an HF model of ``model_path``'s architecture holds,
    as a weight sync moves them (``rft_core.weightsync.plan.state_tensors``: parameters and
    persistent buffers, a tied weight once under its first name), in name order. The model is
    built from the folder's (or hub id's) config on the meta device (``from_config`` under
    ``torch.device("meta")``: no weights read, no memory), with the class ``load_causal_lm`` uses
    (``AutoModelForImageTextToText`` for a vision-language folder, else ``AutoModelForCausalLM``).

    Raises:
        OSError, ValueError: transformers cannot read the config (a missing folder, a hub id
            that is not cached while offline, an unknown architecture).
    """
    # lazy: transformers' model classes are slow to import and load only when a layout is asked for
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if is_vl_model(model_path) else AutoModelForCausalLM
    config = AutoConfig.from_pretrained(resolve_model_path(model_path))
    with torch.device("meta"):
        model = cls.from_config(config)
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, tuple(t.shape), t.is_floating_point()))
    return tuple(sorted(out))


def layout_refusal(plan, layout, *, dtype: str, what: str) -> str | None:
    """Why a sync plan does not fit an engine's model, or None when it does: the plan
    (``rft_core.weightsync.plan.SyncPlan``) must carry exactly the tensors of ``layout``
    (``hf_layout``), each in its shape, floating ones in ``dtype`` (the engine's). vLLM and SGLang
    load whatever names they are given without checking that every weight came (SGLang skips an
    unknown name with a warning, and a tensor of another shape kills its scheduler): this is the
    check that an incomplete or mis-shaped sync is refused before any tensor reaches the engine.
    ``what`` names the engine's model in the message."""
    want = {name: (shape, floating) for name, shape, floating in layout}
    got = {e.name: e for e in plan.entries}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        return (f"the sync does not fit {what}: {len(missing)} tensor(s) missing {missing[:5]}, {len(extra)} unexpected "
                f"{extra[:5]}")
    for name, (shape, floating) in want.items():
        e = got[name]
        if e.shape != shape:
            return f"the sync does not fit {what}: {name!r} has shape {e.shape}, the engine's model {shape}"
        if floating and e.dtype != dtype:
            return f"the sync does not fit {what}: {name!r} comes in {e.dtype}, the engine runs in {dtype}"
    return None


class SyncedWeights:
    """What the GPU engines (``VLLMEngine``, ``SGLangEngine``) share as receivers of an in-memory
    weight sync (``rft_core.weightsync.engine``): the dtype of the plan, the check that a plan
    fits the engine's model, and how their weights are held as invalid. The engine sets
    ``_policy_dtype``, ``_model_path`` (the checkpoint it was built from: its architecture),
    ``weights_path`` (the checkpoint to serve), ``_loaded_path`` (the checkpoint its weights hold)
    and ``weights_version`` (the synced version they hold). ``sync_transport`` names the
    engine's transport (``rft_core.weightsync.choose.choose_transport``). ``dead``: why the
    engine's processes can no longer serve (``died``), or None."""

    sync_transport: ClassVar[str]
    dead: str | None = None
    _policy_dtype: str
    _model_path: str
    weights_path: str | None
    _loaded_path: str | None
    weights_version: str | None

    @property
    def sync_dtype(self) -> str:
        """The dtype of the engine's weights (``engine_dtype`` of the policy dtype): the plan's."""
        return engine_dtype(self._policy_dtype)

    def plan_refusal(self, plan) -> str | None:
        """Why ``plan`` does not fit this engine's model (``layout_refusal`` against the
        ``hf_layout`` of the checkpoint the engine was built from), or None."""
        try:
            layout = hf_layout(self._model_path)
        except (OSError, ValueError) as exc:
            return f"cannot check the sync against the engine's model {self._model_path}: {type(exc).__name__}: {exc}"
        return layout_refusal(plan, layout, dtype=self.sync_dtype, what=f"the {type(self).__name__}'s model "
                                                                        f"({self._model_path})")

    def invalidate_weights(self) -> None:
        """Hold the GPU weights as invalid: nothing is served until a sync or ``load_policy``."""
        self.weights_path = self._loaded_path = self.weights_version = None

    def died(self, reason: str) -> None:
        """The engine's executor failed or left a call pending (a worker process died, a call
        timed out while its reply may still come): record ``reason`` in ``dead``, hold the
        weights as invalid and close the engine at once (its GPU memory back;
        ``ENGINE_CACHE.discard``), so that the next rollout builds a new one instead of reusing
        this one (every later call would fail, or read the late reply as its own)."""
        log.error("the %s died (%s): closed; the next rollout builds a new one", type(self).__name__, reason)
        self.dead = reason
        self.invalidate_weights()
        ENGINE_CACHE.discard(self)


def seed_base(seed: int, *, bits: int) -> int:
    """A ``bits``-bit integer derived from the rollout seed by BLAKE2b, so that neighbouring
    rollout seeds (seed, seed + 1) start their per-sample seed ranges far apart."""
    digest = hashlib.blake2b(str(int(seed)).encode(), digest_size=8, person=b"rft-rollout").digest()
    return int.from_bytes(digest, "big") % (1 << bits)


def sample_seed(seed: int, prompt_index: int, sample_index: int, n_samples_per_prompt: int, *, bits: int) -> int:
    """The seed of sample k of prompt p in a rollout seeded ``seed``:
    (seed_base(seed) + p * n + k) mod 2**bits.

    Within one rollout the map (p, k) -> seed is injective (p * n + k < 2**bits), so no two
    samples share a random stream; it does not depend on which other prompts share a batch or a
    shard. vLLM derives a request's n samples as ``seed + k`` (``ParentRequest``,
    ``vllm/v1/engine/parallel_sampling.py``), so its request seed is ``sample_seed(seed, p, 0, n)``
    and its samples get that + k: distinct for distinct (p, k) too (two of them could only meet
    if p * n + k differed by 2**bits), and below 2**63 with bits=62.

    Raises:
        ValueError: k outside 0..n-1, a negative p, or p * n + k >= 2**bits.
    """
    n = int(n_samples_per_prompt)
    if not 0 <= sample_index < n or prompt_index < 0:
        raise ValueError(f"sample_seed: sample {sample_index} of prompt {prompt_index} with {n} samples per prompt")
    offset = prompt_index * n + sample_index
    if offset >= 1 << bits:
        raise ValueError(f"sample_seed: {offset + 1} samples do not fit in {bits}-bit seeds")
    return (seed_base(seed, bits=bits) + offset) % (1 << bits)


def checkpoint_key(model_path: str, lora_path: str | None, *, lora: bool = False) -> tuple:
    """What must stay the same for a cached engine to serve a new checkpoint in place: the base
    model for a LoRA checkpoint or a LoRA engine (``lora``: built with LoRA on ``model_path``,
    which no adapter replaces); for a full checkpoint its architecture (``config.json`` without
    its ``_name_or_path``, ``transformers_version`` and dtype entries), or the path itself for a
    hub id (no local config.json)."""
    if lora_path is not None or lora:
        return ("lora", model_path)
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return ("path", model_path)
    cfg = json.loads(config.read_text())
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    return ("config", json.dumps(cfg, sort_keys=True))


class EngineCache:
    """One live GPU engine per process, reused while its key matches.

    A long-lived process (a Ray actor, a ``python -m rft_core.stages`` server, the in-process
    task runner) would otherwise build a new engine every iteration (load, compile, CUDA-graph
    capture). A different key closes the cached engine (its ``close()``) before the new one is
    built: one GPU holds one engine. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._key: Hashable | None = None
        self._engine: Any = None

    def get(self, key: Hashable, build: Callable[[], Any]) -> tuple[Any, bool]:
        """(engine, reused): the cached engine when ``key`` matches, else ``build()`` (after
        closing the cached one). ``build`` failing leaves the cache empty."""
        with self._lock:
            if self._engine is not None and self._key == key:
                return self._engine, True
            self.release()
            engine = build()
            self._key, self._engine = key, engine
            return engine, False

    def peek(self) -> Any:
        """The cached engine or None."""
        return self._engine

    def discard(self, engine: Any) -> None:
        """Close ``engine`` (a dead one: ``SyncedWeights.died``) and, when it is the cached one,
        empty the cache. A failure of its ``close`` is logged, not raised (its processes may be
        gone already)."""
        with self._lock:
            if self._engine is engine:
                self._key, self._engine = None, None
        try:
            engine.close()
        except Exception:  # noqa: BLE001  a dead engine's shutdown may fail half-way; it is dropped either way
            log.exception("closing the dead %s failed", type(engine).__name__)

    def release(self, kind: type | None = None) -> bool:
        """Close and forget the cached engine (only if it is a ``kind`` when given); True if one
        was closed."""
        with self._lock:
            engine = self._engine
            if engine is None or (kind is not None and not isinstance(engine, kind)):
                return False
            self._key, self._engine = None, None
            engine.close()
            return True


ENGINE_CACHE = EngineCache()


def cached_engine(engine_cls: type, model_path: str, *, eos_ids: set[int], lora_path: str | None, reload: bool = True,
                  **settings: Any) -> Any:
    """The process's cached ``engine_cls`` (a GPU engine: ``VLLMEngine``, ``SGLangEngine``)
    serving ``model_path`` (+ ``lora_path``): reused, with ``load_policy`` pointing it at the new
    checkpoint, while the engine settings (its keyword arguments) and ``checkpoint_key`` match;
    otherwise the cached engine is closed and a new one built. Use it where an engine is made
    per rollout (``make_engine``), so a long-lived process keeps one engine across iterations.
    ``reload=False``: a reused engine keeps the weights it holds (the caller gives it its
    weights: a resident rollout worker's in-memory sync)."""
    key = (engine_cls.__name__, checkpoint_key(model_path, lora_path, lora=settings.get("enable_lora", False)),
           tuple(sorted(settings.items())))
    engine, reused = ENGINE_CACHE.get(key, lambda: engine_cls(model_path, eos_ids=eos_ids, lora_path=lora_path,
                                                              **settings))
    if reused:
        engine.eos_ids = set(eos_ids)
        if reload:
            engine.load_policy(model_path, lora_path)
    return engine


def release_engine() -> bool:
    """Close the process's cached GPU engine (vLLM or SGLang) and free its GPU memory; True if
    there was one. Call it when the process stops doing rollouts (or before a stage that needs
    the whole GPU when the engine does not sleep)."""
    return ENGINE_CACHE.release()
