"""SGLang rollout engine (``rollout.engine=sglang``): the interface and outputs of ``HFEngine`` and
``VLLMEngine`` (token ids, rollout log-probs, finish reasons) on SGLang's offline engine. GPU only,
in the project's environment or one of its own like vLLM (``runners.rollout: {mode: subprocess,
python: ...}``); sglang is imported lazily. Needs SGLang >= 0.5.3 (``sampling_seed`` and ``enable_deterministic_inference``).

Written against ``sglang.Engine`` (``python/sglang/srt/entrypoints/engine.py``):
``Engine(model_path=..., tp_size=..., mem_fraction_static=..., dtype=..., skip_tokenizer_init=True,
...)`` and ``Engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...],
return_logprob=True, lora_path=[...])``, which answers one dict per request:
``{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop", "matched": id} |
{"type": "length", "length": n} | {"type": "abort", "message": ...}, "output_token_logprobs":
[(logprob, token_id, None), ...], ...}}`` (``TokenizerManager.detokenize_logprob_tokens``,
``python/sglang/srt/managers/tokenizer_manager.py``; finish reasons: ``FINISH_MATCHED_TOKEN`` /
``FINISH_LENGTH`` / ``FINISH_ABORT.to_json`` in ``managers/schedule_batch.py``).

- Log-probs: SGLang's sampler returns log softmax(logits / temperature) of the sampled token,
  before top-k/top-p renormalisation (``Sampler.forward``, ``python/sglang/srt/layers/sampler.py``):
  the actor stage's quantity (and the HF and vLLM engines' at top_p = 1; under top-p they
  renormalise over the nucleus, docs/algorithms.md). The environment switch
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (``RETURN_ORIGINAL_LOGPROB`` in 0.5.3) makes them
  pre-temperature: the engine refuses to start with it set.
- Seeds: one request per sample (n = 1), each with its own ``sampling_seed``
  (``rft_core.engines.sample_seed``, 31 bits: SGLang 0.5.3 keeps seeds in an int32 tensor).
  SGLang honours per-request seeds only with ``enable_deterministic_inference`` (the seed tensor
  is built only then, ``sampling/sampling_batch_info.py``; it also switches sampling to the
  pytorch backend and batch-invariant kernels, slower: the SGLang deterministic-inference docs
  quote a 34% overhead with CUDA graphs). ``deterministic=False`` sends no seeds, with a warning:
  samples are then not reproducible. A request with ``n > 1`` would give its n samples one seed,
  hence identical samples in deterministic mode: never sent.
- LoRA: the engine is built with ``enable_lora`` (``lora_target_modules=["all"]``) and each
  adapter folder is loaded under a new name (``load_lora_adapter``; the previous one unloaded).
- Reuse across iterations (``get_sglang_engine``): a new full checkpoint is loaded in place
  (``update_weights_from_disk``, then ``flush_cache``). With ``enable_memory_saver`` the engine
  releases its GPU memory after each ``generate`` (``release_memory_occupation``) and takes it
  back before the next (``resume_memory_occupation``); released weights are not kept, so they are
  reloaded from disk (and a LoRA adapter re-loaded) after a release.
- FIRE sampling is refused, as with vLLM.
- In-memory weight sync (a resident rollout worker, ``rft_core.weightsync.engine``, transport ``sglang``):
  ``SGLangEngine.receive_weights`` receives the trainer's buckets in this process and hands each
  to ``Engine.update_weights_from_tensor`` inside SGLang's weight-update session where the
  release has one (0.5.21+), after the project's own check that the sync carries every tensor of
  the engine's model in its shape (SGLang checks neither; see its docstring, and for why not
  SGLang's own ``update_weights_from_distributed`` group).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
from typing import Any

from rft_core.engines import ENGINE_CACHE, SGLANG_SEED_BITS, SyncedWeights, cached_engine, engine_dtype, sample_seed
from rft_core.engines.hf import Generation
from rft_core.weightsync.base import OWN_WAIT_SHARE, Meet
from rft_core.weightsync.collective import receive_buckets
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError, sync_device

log = logging.getLogger("rft_core.engines.sglang")

ORIGINAL_LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")


def build_engine(**kwargs: Any):
    """``sglang.Engine(**kwargs)`` (the one place SGLang's engine is built; tests replace it)."""
    import sglang

    return sglang.Engine(**kwargs)


def _refuse_original_logprobs() -> None:
    for name in ORIGINAL_LOGPROB_ENV:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            raise ValueError(f"environment variable {name}={os.environ[name]} makes SGLang return log-probs before "
                             "temperature; the rollout needs log-probs after temperature: unset it")


def _check_ok(result: Any, what: str) -> None:
    """Raise if an SGLang control call (``update_weights_from_disk``, ``load_lora_adapter``, ...)
    reports a failure: 0.5.x answers (success, message, ...) tuples, others objects or dicts
    with ``success`` and ``message``/``error_message``."""
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        ok, message = result[0], (result[1] if len(result) > 1 else "")
    elif isinstance(result, dict) and "success" in result:
        ok, message = result["success"], result.get("message") or result.get("error_message", "")
    elif hasattr(result, "success"):
        ok, message = result.success, getattr(result, "message", None) or getattr(result, "error_message", "")
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


class SGLangEngine(SyncedWeights):
    """Rollouts with ``sglang.Engine``.

    Args:
        model_path: a local HF folder (or hub id) of the policy, or of a LoRA adapter's base
            when ``lora_path`` is given.
        eos_ids: token ids that end a response.
        lora_path: a peft adapter folder to apply.
        enable_lora: build a LoRA engine without an adapter to serve yet (a resident LoRA run:
            it serves the base, its initial policy, until ``load_policy`` gives it an adapter
            landed from a sync); implied by ``lora_path``.
        tensor_parallel_size: SGLang ``tp_size``.
        mem_fraction_static: SGLang's fraction of GPU memory for weights and KV cache.
        dtype: the policy dtype; the engine runs in ``engine_dtype(dtype)``.
        max_model_len: SGLang ``context_length`` (None: the model's).
        enable_memory_saver: release the GPU memory after every ``generate``.
        deterministic: ``enable_deterministic_inference`` and per-sample ``sampling_seed``.
        engine: an object with ``sglang.Engine``'s ``generate`` (tests pass a stand-in); None
            builds ``sglang.Engine`` from the other arguments.
    Raises:
        ValueError: ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set.
    """

    sync_transport = "sglang"  # rft_core.weightsync.engine.SGLangTransport

    def __init__(self, model_path: str, *, eos_ids: set[int], lora_path: str | None = None, tensor_parallel_size: int = 1,
                 mem_fraction_static: float = 0.5, dtype: str = "auto", max_model_len: int | None = None,
                 enable_memory_saver: bool = False, max_lora_rank: int = 64, deterministic: bool = True,
                 enable_lora: bool = False, engine: Any = None) -> None:
        _refuse_original_logprobs()
        self.eos_ids = set(eos_ids)
        self.deterministic = deterministic
        self.release_after_generate = enable_memory_saver
        self._policy_dtype = dtype
        self._model_path = model_path  # its architecture: what a sync must fit (plan_refusal)
        if engine is None:
            kwargs: dict[str, Any] = {
                "model_path": model_path, "tp_size": tensor_parallel_size, "mem_fraction_static": mem_fraction_static,
                "dtype": engine_dtype(dtype), "skip_tokenizer_init": True, "enable_memory_saver": enable_memory_saver,
                "enable_deterministic_inference": deterministic}
            if max_model_len is not None:
                kwargs["context_length"] = max_model_len
            if lora_path is not None or enable_lora:
                kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, lora_target_modules=["all"])
            engine = build_engine(**kwargs)
        self.engine = engine
        if not deterministic:
            log.warning("SGLang without enable_deterministic_inference ignores per-request seeds: rollout samples "
                        "are not reproducible")
        self.weights_path: str | None = model_path  # the checkpoint to serve; None: synced or invalid
        self._loaded_path: str | None = model_path  # the checkpoint the GPU weights hold
        self.weights_version: str | None = None  # the synced version the GPU weights hold (receive_weights)
        self._released = False
        self._lora = lora_path is not None or enable_lora  # a LoRA engine: it serves adapters on its base
        self._lora_path = lora_path  # the adapter to serve (None on a LoRA engine: its base alone)
        self._lora_loaded: str | None = None  # the adapter folder loaded now
        self._lora_name: str | None = None
        self._lora_names = itertools.count(1)

    def load_policy(self, model_path: str, lora_path: str | None = None, *, version: str | None = None) -> None:
        """Serve another checkpoint of the same model from the next ``generate`` on (weights from
        disk in place; a LoRA adapter under a new name; on a LoRA engine, its base itself without
        an adapter for ``lora_path`` None: a LoRA run's initial policy).

        Args:
            version: what the adapter folder holds when it was landed by a sync (a resident
                rollout worker's key of the policy version: ``weights_version``), else None.
        Raises:
            ValueError: LoRA/full mismatch with how the engine was built (another full checkpoint
                than its base on a LoRA engine), or another LoRA base.
        """
        if (lora_path is not None and not self._lora) or (lora_path is None and self._lora and model_path != self.weights_path):
            raise ValueError(f"the cached SGLang engine was built {'with' if self._lora else 'without'} LoRA; "
                             f"cannot serve {lora_path or model_path} on it (release it first)")
        if lora_path is not None and model_path != self.weights_path:
            raise ValueError(f"LoRA adapter {lora_path} has base {model_path}, the engine serves {self.weights_path}")
        self.weights_path, self.weights_version = model_path, version if self._lora else None
        self._lora_path = lora_path

    def _resume(self) -> None:
        if self._released:
            self.engine.resume_memory_occupation()
            self._released = False

    def _ensure_ready(self) -> None:
        """Take the GPU memory back if released, reload weights that are not ``weights_path``'s
        (or keep the synced ones), and load the adapter to serve.

        Raises:
            WeightSyncError: the weights are invalid (a failed sync, synced weights released):
                nothing is served until a sync or ``load_policy`` succeeds.
        """
        self._resume()
        if self.weights_path is None:
            if self.weights_version is None:
                raise WeightSyncError("the SGLang engine's weights are invalid (a weight sync failed, or its synced "
                                      "weights were released): sync them again or load a checkpoint")
        elif self._loaded_path != self.weights_path:
            log.info("SGLang: reloading weights in place from %s", self.weights_path)
            self._loaded_path = None  # a failed load leaves the weights partly written
            _check_ok(self.engine.update_weights_from_disk(self.weights_path), f"update_weights_from_disk({self.weights_path})")
            _check_ok(self.engine.flush_cache(), "flush_cache")
            self._loaded_path = self.weights_path
        if self._lora and self._lora_loaded != self._lora_path:
            if self._lora_name is not None:
                _check_ok(self.engine.unload_lora_adapter(self._lora_name), f"unload_lora_adapter({self._lora_name})")
                self._lora_name = self._lora_loaded = None
            if self._lora_path is not None:
                name = f"policy-{next(self._lora_names)}"
                _check_ok(self.engine.load_lora_adapter(name, self._lora_path), f"load_lora_adapter({self._lora_path})")
                self._lora_name, self._lora_loaded = name, self._lora_path

    @property
    def sync_world_size(self) -> int:
        """The size of a weight-sync group into this engine: the sender and this process (2).

        Raises:
            ValueError: a LoRA engine (it serves adapters; a sync moves full weights).
        """
        if self._lora:
            raise ValueError("an SGLang engine built with LoRA serves adapters; an in-memory weight sync needs an "
                             "engine built on the full model (lora_path=None)")
        return 2

    def receive_weights(self, plan: "SyncPlan | str", meet: Meet, *, timeout_s: float) -> SyncReport:
        """Receive the trainer's weights in memory: take released GPU memory back, receive the
        buckets in this process (``rft_core.weightsync.collective.receive_buckets``, rank 1 of 2, on this
        process's current CUDA device with NCCL, on the CPU with gloo) and hand each bucket's
        (HF name, tensor) list to ``Engine.update_weights_from_tensor(named_tensors,
        load_format=None, flush_cache=True)`` (``python/sglang/srt/entrypoints/engine.py``: the
        tensors go to every tensor-parallel scheduler process by ``MultiprocessingSerializer``,
        CUDA IPC for GPU tensors, and each loads them with its model's ``load_weights``, which
        keeps its shard), ``flush_cache`` on the last bucket only; every answer is checked
        (``_check_ok``). Records ``meet.version`` as what the GPU weights hold (``weights_version``).

        The session: SGLang 0.5.21+ answers ``success=False`` to an ``update_weights_from_tensor``
        that does not run between ``Engine.begin_weight_update()`` and ``end_weight_update()``
        (``managers/scheduler_components/weight_updater.py``, 0.5.23; ``end`` finalises the
        loaded weights into the kernels' layout). Where the engine has ``begin_weight_update`` the
        buckets land inside one session, closed also when the sync fails; older releases (no such
        method) get the calls without it. The flush on the last bucket is refused while requests
        run (0.5.23: "the cache was not flushed because requests are still running"): the sync
        then fails and the engine is invalid.

        Completeness: SGLang's ``load_weights`` (``models/qwen2.py``, ``llama.py``) skips an
        unknown name with a warning, never checks that every parameter came, and a tensor of
        another shape fails an assertion inside the scheduler, which kills the engine's processes.
        So before anything reaches SGLang the plan is checked against the engine's model
        (``plan_refusal``: every tensor of its HF layout, none more, each in its shape and the
        engine's dtype); a plan that does not fit fails the transaction's plan check on both sides
        and the engine keeps nothing of it.

        Why not SGLang's ``init_weights_update_group`` + ``update_weights_from_distributed``
        (the scheduler processes joining the trainer's group directly, saving one device copy
        per bucket): the trainer would have to speak SGLang's group protocol (its group naming,
        its per-call names/dtypes/shapes or flattened-bucket layout, which changed between
        releases: one tensor per call in 0.4, lists and ``load_format`` later), the engine would
        give no checksum of what it received, and neither side can be tested without GPUs. The
        tensor path keeps this module's own transaction (plan check, timeouts, checksum of the
        received bytes) at the cost of one bucket of device memory in this process.

        Args:
            plan: the sender's ``SyncPlan`` (or its JSON), in ``sync_dtype``.
            meet: the transaction (``rft_core.weightsync.base.Meet``): ``addr``, ``port``,
                ``backend``, where the sender (rank 0) waits; ``version``, what the weights are
                (the caller's key of the policy version).
            timeout_s: the limit of the transaction; each wait of this receiver gets
                ``OWN_WAIT_SHARE`` of it (``rft_core.weightsync.base``).
        Returns:
            the ``SyncReport`` of the received tensors (its digest unverified: the session
            compares it with the sent one).
        Raises:
            ValueError: a LoRA engine (``sync_world_size``).
            WeightSyncError: the plan does not fit the engine's model, the sync failed, or SGLang
                refused a bucket or the session; the weights are then invalid (``generate``
                refuses until a sync or ``load_policy`` succeeds).
        """
        self.sync_world_size  # noqa: B018  refuses a LoRA engine
        version, backend = meet.version, meet.backend
        plan = SyncPlan.from_json(plan) if isinstance(plan, str) else plan
        refusal = self.plan_refusal(plan)
        self._resume()
        self.invalidate_weights()
        n, landed = len(plan.bucket_sizes), [0]

        def on_bucket(named: list) -> None:
            landed[0] += 1
            _check_ok(self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=landed[0] == n),
                      f"update_weights_from_tensor (bucket {landed[0]}/{n})")

        session = refusal is None and hasattr(self.engine, "begin_weight_update")
        if session:
            try:
                _check_ok(self.engine.begin_weight_update(), "begin_weight_update")
            except RuntimeError as exc:
                refusal = str(exc)  # joined and refused at the plan check: the sender stops at once
                session = False
        try:
            rep = receive_buckets(plan, addr=meet.addr, port=meet.port, rank=1, world_size=2, backend=backend,
                                  timeout_s=timeout_s * OWN_WAIT_SHARE, device=sync_device(backend), on_bucket=on_bucket,
                                  refusal=refusal)
        except BaseException:
            if session:  # closed so that the next sync can open one; the sync's own error is the one raised
                with contextlib.suppress(Exception):
                    self.engine.end_weight_update()
            raise
        if session:
            try:
                _check_ok(self.engine.end_weight_update(), "end_weight_update")
            except RuntimeError as exc:
                raise WeightSyncError(f"SGLang weight sync of {version}: {exc}") from exc
        self.weights_version = version
        return rep

    def batches(self, prompts: list[list[int]], n: int, batch_size: int, **_: Any) -> list[list[tuple[int, int]]]:
        """Whole groups, prompts sorted by length, max(1, batch_size // n) prompts per batch: the
        units rollout shards split; one ``generate`` sends all its batches' samples at once."""
        order = sorted(range(len(prompts)), key=lambda p: len(prompts[p]))
        per = max(1, batch_size // n)
        return [[(p, k) for p in order[i:i + per] for k in range(n)] for i in range(0, len(order), per)]

    def _sampling_params(self, p: int, k: int, n: int, *, seed: int, max_new_tokens: int, temperature: float,
                         top_p: float) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                  "stop_token_ids": sorted(self.eos_ids), "no_stop_trim": True, "n": 1}
        if self.deterministic:
            params["sampling_seed"] = sample_seed(seed, p, k, n, bits=SGLANG_SEED_BITS)
        return params

    def generate(self, prompts: list[list[int]], *, n_samples_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, batch_size: int = 256, seed: int = 0, first_token_temperature: float | None = None,
                 progress=None, only_batches: set[int] | None = None, greedy: bool = False,
                 **_: Any) -> list[Generation]:
        """``HFEngine.generate``'s contract: len(prompts) * n generations (of ``only_batches``),
        grouped by prompt in input order; each response up to and including its first EOS.
        ``greedy``: argmax decoding (SGLang's temperature 0; ``temperature`` and ``top_p`` play no part).

        Raises:
            NotImplementedError: ``first_token_temperature`` (FIRE) was asked for.
            RuntimeError: SGLang aborted a request or answered with missing outputs or log-probs.
        """
        if first_token_temperature is not None:
            raise NotImplementedError("rollout.first_token_temperature (FIRE) is not supported by the SGLang engine; "
                                      "use rollout.engine=hf")
        if greedy:
            temperature, top_p = 0.0, 1.0
        n = n_samples_per_prompt
        batches = self.batches(prompts, n, batch_size)
        keys = [(p, k) for b, batch in enumerate(batches) if only_batches is None or b in only_batches for p, k in batch]
        results: dict[tuple[int, int], Generation] = {}
        if keys:
            self._ensure_ready()
            params = [self._sampling_params(p, k, n, seed=seed, max_new_tokens=max_new_tokens, temperature=temperature,
                                            top_p=top_p) for p, k in keys]
            extra = {"lora_path": [self._lora_name] * len(keys)} if self._lora_name is not None else {}
            outs = self.engine.generate(input_ids=[list(prompts[p]) for p, _ in keys], sampling_params=params,
                                        return_logprob=True, **extra)
            outs = [outs] if isinstance(outs, dict) else list(outs)
            if len(outs) != len(keys):
                raise RuntimeError(f"SGLang returned {len(outs)} outputs for {len(keys)} requests")
            for (p, k), out in zip(keys, outs):
                results[(p, k)] = self._generation(p, k, out)
            if self.release_after_generate:
                self.sleep()
        if progress is not None:
            progress(len(results), len(results))
        return [results[(p, k)] for p in range(len(prompts)) for k in range(n) if (p, k) in results]

    def _generation(self, p: int, k: int, out: dict) -> Generation:
        """One SGLang output dict as a Generation, cut after the first EOS."""
        meta = out.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        if kind == "abort":
            raise RuntimeError(f"SGLang aborted sample {k} of prompt {p}: {reason.get('message')}")
        tokens = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs")
        if entries is None or len(entries) != len(tokens):
            raise RuntimeError(f"SGLang returned {None if entries is None else len(entries)} log-probs for "
                               f"{len(tokens)} tokens (sample {k} of prompt {p}); return_logprob=True expected")
        if any(int(e[1]) != t for e, t in zip(entries, tokens)):
            raise RuntimeError(f"SGLang log-prob entries do not follow the output tokens (sample {k} of prompt {p})")
        lps = [float(e[0]) for e in entries]
        finish = "stop" if kind == "stop" else "length"
        for j, t in enumerate(tokens):
            if t in self.eos_ids:
                tokens, lps, finish = tokens[: j + 1], lps[: j + 1], "stop"
                break
        return Generation(p, k, tokens, lps, finish)

    def sleep(self) -> None:
        """Release the GPU memory of weights and KV cache (``release_memory_occupation``; needs
        ``enable_memory_saver``); the weights are reloaded on the next ``generate`` (synced
        weights are not kept: the engine is invalid until the next sync; a LoRA engine reloads its
        base from disk and its adapter from its folder, so it still holds its version)."""
        if self._released:
            return
        self.engine.release_memory_occupation()
        self._released = True
        self._loaded_path = self._lora_loaded = None
        if not self._lora:
            self.weights_version = None

    def wake_up(self) -> None:
        """Take the GPU memory back and reload what ``sleep`` released."""
        self._ensure_ready()

    def close(self) -> None:
        """Shut the engine's processes down (``Engine.shutdown``), freeing the GPU."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


def get_sglang_engine(model_path: str, *, eos_ids: set[int], lora_path: str | None = None, reload: bool = True,
                      **settings: Any) -> SGLangEngine:
    """The process's cached ``SGLangEngine`` for ``model_path`` (+ ``lora_path``), reused across
    iterations (``rft_core.engines.cached_engine``, ``reload`` as there); ``settings`` are
    ``SGLangEngine``'s keyword arguments."""
    return cached_engine(SGLangEngine, model_path, eos_ids=eos_ids, lora_path=lora_path, reload=reload, **settings)


def release_sglang_engine() -> bool:
    """Close the process's cached SGLang engine, if the cached engine is one; True if closed."""
    return ENGINE_CACHE.release(SGLangEngine)
