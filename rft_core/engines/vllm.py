"""vLLM rollout engine: the same interface and outputs as ``HFEngine`` (token ids, rollout
log-probs, finish reasons), on vLLM's batched generation. GPU only; vLLM installs into the
project's environment (one torch and one NCCL for the trainer and the engine, docs/gpu.md), or
into one of its own, reached with ``runners.rollout: {mode: subprocess, python: /path/to/env/bin/python}``
(docs/scale.md). Imported lazily: nothing here imports vllm at module import. Needs vLLM >= 0.10.2
(``logprobs_mode="processed_logprobs"`` includes the temperature from that release on).

Differences from the HF engine, by design:
- One random stream per sample: sample k of prompt p uses seed base(seed) + p * n + k
  (``rft_core.engines.sample_seed``; the request seed is the k = 0 one and vLLM adds k), so no
  two samples of a rollout share a stream and a prompt's samples do not depend on which other
  prompts share its batch or shard.
- All prompts of a call go to one ``LLM.generate`` (vLLM schedules them); ``batch_size`` only
  defines the batches that rollout shards split (``only_batches``).
- Log-probs come from ``logprobs_mode="processed_logprobs"``: log-softmax of the logits after
  temperature and after top-k/top-p masking (vLLM 0.10.2 ``v1/sample/ops/topk_topp_sampler.py``
  ``forward_native``), i.e. over the renormalised nucleus: the same quantity as the HF engine's
  ``StepLogprobs`` (they differ only by the bf16 kernels; docs/algorithms.md "behaviour weight").
- The engine runs in bfloat16 (float16 without bfloat16 support) for a float32 or ``auto``
  policy (``rft_core.engines.engine_dtype``).
- FIRE sampling (``first_token_temperature``) is not supported (vLLM has no per-step
  temperature): a clear error.
- A LoRA policy checkpoint is served through vLLM's LoRA support (``LoRARequest``) on its base
  model; a full checkpoint is loaded as a model.

Reuse across iterations (``get_vllm_engine``): the process keeps one ``LLM``; a new full
checkpoint of the same model is loaded into it in place by ``WeightReloadExtension`` (vLLM's
worker ``reload_weights``, reached through ``LLM.collective_rpc``), then the prefix cache is
reset; a new LoRA checkpoint is a new ``LoRARequest`` id. With ``enable_sleep_mode`` the engine
sleeps after each ``generate`` (level 2 for full weights, which the next iteration reloads
anyway; level 1 for LoRA, whose base weights are kept in CPU memory, and for weights received
by a sync, which are on no storage) and wakes up (weights, reload, then KV cache) before the
next one, so the GPU is free for the other stages in between.

In-memory weight sync (a resident rollout worker, ``rft_core.weightsync.engine``, transport ``vllm``):
``VLLMEngine.receive_weights`` has every worker join the trainer's sync group
(``rft_core.weightsync``) through ``WeightReloadExtension.rft_receive_weights`` and load each
bucket with the model's own ``load_weights``, as vLLM's RLHF example does
(``examples/offline_inference/rlhf_utils.py``, ``WorkerExtension.update_weight``).
"""
from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

from rft_core.engines import ENGINE_CACHE, VLLM_SEED_BITS, SyncedWeights, cached_engine, engine_dtype, sample_seed
from rft_core.engines.hf import Generation
from rft_core.heap import collect_all
from rft_core.models.logprobs import release_device_memory
from rft_core.weightsync.base import OWN_WAIT_SHARE, Meet
from rft_core.weightsync.collective import receive_buckets
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError

log = logging.getLogger("rft_core.engines.vllm")

WORKER_EXTENSION = "rft_core.engines.vllm.WeightReloadExtension"
# seconds an in-place reload of a checkpoint (``LLM.collective_rpc("rft_reload_weights")``) may
# take before the engine counts as dead: a worker that never answers (a hung read, a stuck
# collective) would otherwise block the rollout forever; generous for a large model on slow storage
RELOAD_TIMEOUT_S = 1800.0


def build_llm(**kwargs: Any):
    """``vllm.LLM(**kwargs)`` (the one place vllm's engine is built; tests replace it)."""
    from vllm import LLM

    return LLM(**kwargs)


def vllm_sampling_params():
    """The ``vllm.SamplingParams`` class."""
    from vllm import SamplingParams

    return SamplingParams


def lora_request(path: str, lora_id: int = 1):
    """A ``vllm.lora.request.LoRARequest`` for the adapter folder ``path``. vLLM caches adapters
    by ``lora_id``, so each new adapter folder needs a new id."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"policy-{lora_id}", lora_id, path)


def _cleanup_vllm() -> None:
    """vLLM's own teardown of its distributed state and GPU memory
    (``vllm.distributed.parallel_state.cleanup_dist_env_and_memory``), when vllm is importable."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        return
    cleanup_dist_env_and_memory()


class WeightReloadExtension:
    """Mixed into vLLM's GPU worker (``LLM(worker_extension_cls=WORKER_EXTENSION)``, the
    extension point of vLLM's RLHF examples) and called on every worker through
    ``LLM.collective_rpc("rft_reload_weights", args=(path,))``.

    Loads the HF checkpoint folder ``path`` into the running model in place: vLLM releases whose
    model runner's ``reload_weights`` takes ``weights_path`` (``reload_weights(weights_iterator=None,
    weights_path=None, is_checkpoint_format=True)``, ``vllm/v1/worker/gpu_model_runner.py``, 0.33.0)
    are given the path; older ones (0.10.x, ``reload_weights()`` re-reading
    ``model_config.model``; vLLM's ``examples/offline_inference`` in-place weight-loading example)
    get the runner's ``model_config.model`` pointed at ``path`` first. Each worker reads its own
    tensor-parallel shard. Parameter shapes stay the same, so compiled graphs and CUDA graphs
    stay valid.

    No method of this extension raises through ``collective_rpc``: each answers
    ``{"ok": True, ...}`` or ``{"ok": False, "rank", "error"}`` and the driver raises after it has
    read every worker's answer. vLLM's executor (``MultiprocExecutor.collective_rpc``,
    ``vllm/v1/executor/multiproc_executor.py``, 0.33.0) reads the workers' reply queues in rank
    order and raises at the first failed reply, leaving the other workers' replies queued, where
    the next ``collective_rpc`` would read them as its own.
    """

    def _rft_answer(self, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``call()``'s answer with ``"ok": True``, or its exception as ``{"ok": False, ...}``."""
        try:
            return {"ok": True, **call()}
        except Exception as exc:  # noqa: BLE001  answered, never raised through collective_rpc (see the class doc)
            log.exception("rft worker extension call failed on rank %s", self._rft_tp_rank())
            return {"ok": False, "rank": self._rft_tp_rank(), "error": f"{type(exc).__name__}: {exc}"}

    def rft_reload_weights(self, path: str) -> dict[str, Any]:
        """Reload this worker's weights from the checkpoint folder ``path``: ``{"ok": True}`` or
        ``{"ok": False, "rank", "error"}``."""
        def reload() -> dict[str, Any]:
            runner = self.model_runner
            if "weights_path" in inspect.signature(runner.reload_weights).parameters:
                self.reload_weights(weights_path=path)
            else:
                runner.model_config.model = path
                self.reload_weights()
            return {}

        return self._rft_answer(reload)

    def _rft_tp_rank(self) -> int:
        """This worker's tensor-parallel rank: ``get_tensor_model_parallel_rank()``
        (``vllm/distributed/parallel_state.py``); without vllm (tests) the worker's ``rank``
        (``WorkerBase.__init__``, ``vllm/v1/worker/worker_base.py``: the global rank, which is
        the tensor-parallel rank of a tensor-parallel-only engine)."""
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        except ImportError:
            return int(self.rank)
        return int(get_tensor_model_parallel_rank())

    def rft_receive_weights(self, plan_json: str, addr: str, port: int, world_size: int, backend: str,
                            timeout_s: float, refusal: str | None = None) -> dict[str, Any]:
        """Receive a weight sync into this worker's model: join the sync group at ``addr:port``
        as rank 1 + tensor-parallel rank of ``world_size`` (``rft_core.weightsync.collective.receive_buckets``
        on ``self.device``) and hand each bucket's (HF name, tensor) list to the model's own
        ``self.model_runner.model.load_weights(weights=...)`` (``load_weights(self, weights:
        Iterable[tuple[str, Tensor]]) -> set[str]``, e.g. ``vllm/model_executor/models/llama.py``:
        it maps HF names onto vLLM's fused parameters, q/k/v -> qkv_proj, gate/up -> gate_up_proj,
        and each parameter's ``weight_loader`` keeps this rank's shard). As vLLM's own loader does
        (``DefaultModelLoader.load_weights``, ``vllm/model_executor/model_loader/default_loader.py``),
        an unquantized model whose ``load_weights`` reports the loaded names must have had every
        parameter loaded. Quantized models (whose weights need ``process_weights_after_loading``)
        are not supported.

        Args:
            plan_json: the sender's plan (``SyncPlan.to_json``).
            world_size: 1 + tensor_parallel_size.
            backend: "nccl" (GPU) or "gloo".
            timeout_s: the limit of each collective.
            refusal: the driver found that the plan does not fit the model
                (``SyncedWeights.plan_refusal``): join and fail the plan check with it, so every
                rank stops before a bucket moves.
        Returns:
            ``{"ok": True, "digest": the weight digest of the received tensors (``device`` sums
            on the GPU over NCCL; XXH3-128 over gloo), "bytes", "seconds", "buckets"}``, or ``{"ok": False, "rank", "error"}`` when the
            sync failed (timeout, a peer gone, the plan refused, a bucket ``load_weights`` refused:
            unknown name or shape, a parameter left out): the model is then partly written.
            Never raises (see the class docstring).
        """
        return self._rft_answer(lambda: self._rft_receive(plan_json, addr, port, world_size, backend, timeout_s, refusal))

    def _rft_receive(self, plan_json: str, addr: str, port: int, world_size: int, backend: str, timeout_s: float,
                     refusal: str | None) -> dict[str, Any]:
        import torch

        plan = SyncPlan.from_json(plan_json)
        model = self.model_runner.model
        quantized = getattr(getattr(self, "model_config", None), "quantization", None) is not None
        expected = {name for name, _ in model.named_parameters()}
        state: dict[str, Any] = {"loaded": set(), "landed": 0}

        def on_bucket(weights: list) -> None:
            got = model.load_weights(weights=weights)
            state["loaded"] = None if got is None or state["loaded"] is None else state["loaded"] | set(got)
            state["landed"] += 1
            if state["landed"] == len(plan.bucket_sizes) and state["loaded"] is not None and not quantized:
                missing = sorted(expected - state["loaded"])
                if missing:
                    raise ValueError(f"{len(missing)} parameter(s) of the vLLM model were not in the sync: {missing[:5]}")

        rep = receive_buckets(plan, addr=addr, port=port, rank=1 + self._rft_tp_rank(), world_size=world_size,
                              backend=backend, timeout_s=timeout_s, device=self.device, on_bucket=on_bucket,
                              refusal=refusal)
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"digest": rep.digest, "bytes": rep.bytes, "seconds": rep.seconds, "buckets": rep.buckets}


class VLLMEngine(SyncedWeights):
    """Rollouts with ``vllm.LLM``.

    Args:
        model_path: a local HF folder (or hub id) of the policy, or of a LoRA adapter's base
            when ``lora_path`` is given.
        eos_ids: token ids that end a response (the tokenizer's and the generation config's EOS).
        lora_path: a peft adapter folder to apply (vLLM LoRA).
        enable_lora: build a LoRA engine without an adapter to serve yet (a resident LoRA run:
            it serves the base, its initial policy, until ``load_policy`` gives it an adapter
            landed from a sync); implied by ``lora_path``.
        dtype: the policy dtype; the engine runs in ``engine_dtype(dtype)``.
        enable_sleep_mode: build the engine with sleep mode and sleep after every ``generate``.
        llm: an object with vllm.LLM's ``generate(prompts, sampling_params, use_tqdm=..., lora_request=...)``
            (tests pass one backed by the HF engine); None builds ``vllm.LLM`` from the other arguments.
        sampling_params: the SamplingParams class (default ``vllm.SamplingParams``).
        reload_timeout_s: the limit of an in-place reload of a new checkpoint (``load_policy``;
            ``LLM.collective_rpc``'s ``timeout``, vllm/entrypoints/llm.py of vLLM 0.33): past it
            the engine is closed as dead (``died``) and the rollout fails; the next one builds a
            new engine.
    """

    sync_transport = "vllm"  # rft_core.weightsync.engine.VLLMTransport

    def __init__(self, model_path: str, *, eos_ids: set[int], lora_path: str | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, dtype: str = "auto", max_model_len: int | None = None,
                 enable_sleep_mode: bool = False, max_lora_rank: int = 64, enable_lora: bool = False, llm: Any = None,
                 sampling_params: Callable[..., Any] | None = None, reload_timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        self.eos_ids = set(eos_ids)
        self.reload_timeout_s = reload_timeout_s
        self.sleep_after_generate = enable_sleep_mode
        self.tensor_parallel_size = tensor_parallel_size
        self._policy_dtype = dtype
        self._model_path = model_path  # its architecture: what a sync must fit (plan_refusal)
        if llm is None:
            kwargs: dict[str, Any] = {
                "model": model_path, "tensor_parallel_size": tensor_parallel_size,
                "gpu_memory_utilization": gpu_memory_utilization, "dtype": engine_dtype(dtype),
                "enable_sleep_mode": enable_sleep_mode, "logprobs_mode": "processed_logprobs",
                "enable_prefix_caching": True, "worker_extension_cls": WORKER_EXTENSION}
            if max_model_len is not None:
                kwargs["max_model_len"] = max_model_len
            if lora_path is not None or enable_lora:
                kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank)
            llm = build_llm(**kwargs)
        self.llm = llm
        self.sampling_params = sampling_params or vllm_sampling_params()
        self.weights_path: str | None = model_path  # the checkpoint to serve (the LoRA base); None: synced or invalid
        self._loaded_path: str | None = model_path  # the checkpoint the GPU weights hold (None: synced, discarded)
        self.weights_version: str | None = None  # the synced version the GPU weights hold (receive_weights)
        self._sleep_level = 0
        self._weights_awake = False  # the weights were woken while the KV cache still sleeps
        self._lora_ids = itertools.count(1)
        self.lora = lora_path is not None or enable_lora  # a LoRA engine: it serves adapters on its base
        self.lora_request = lora_request(lora_path, next(self._lora_ids)) if lora_path is not None else None
        self._lora_path = lora_path

    def load_policy(self, model_path: str, lora_path: str | None = None, *, version: str | None = None) -> None:
        """Serve another checkpoint of the same model from now on: a full checkpoint's weights
        are reloaded in place before the next ``generate``; a LoRA checkpoint (``lora_path``, on
        the same base ``model_path``) gets a new ``LoRARequest``; on a LoRA engine, its base
        itself (``lora_path`` None) is served without an adapter (a LoRA run's initial policy).

        Args:
            version: what the adapter folder holds when it was landed by a sync (a resident
                rollout worker's key of the policy version: ``weights_version``), else None.
        Raises:
            ValueError: a LoRA checkpoint on an engine built without LoRA, another full checkpoint
                than its base on a LoRA engine, or a LoRA checkpoint on another base model.
        """
        if (lora_path is not None and not self.lora) or (lora_path is None and self.lora and model_path != self.weights_path):
            raise ValueError(f"the cached vLLM engine was built {'with' if self.lora else 'without'} LoRA; "
                             f"cannot serve {lora_path or model_path} on it (release it first)")
        if self.lora:
            if model_path != self.weights_path:
                raise ValueError(f"LoRA adapter {lora_path} has base {model_path}, the engine serves {self.weights_path}")
            if lora_path is None:
                self.lora_request = None
            elif lora_path != self._lora_path or self.lora_request is None:
                self.lora_request = lora_request(lora_path, next(self._lora_ids))
            self._lora_path, self.weights_version = lora_path, version
            return
        self.weights_path, self.weights_version = model_path, None

    def _wake_weights(self) -> None:
        if self._sleep_level and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    def _ensure_ready(self) -> None:
        """Wake the engine if it sleeps and make its GPU weights those of ``weights_path`` (or
        keep the synced ones).

        Raises:
            WeightSyncError: the weights are invalid (a failed sync, synced weights discarded by
                a level-2 sleep): nothing is served until a sync or ``load_policy`` succeeds.
            RuntimeError: the engine died (``died``), or an in-place reload failed; an executor
                that failed during the reload kills the engine.
        """
        if self.dead:
            raise RuntimeError(f"the vLLM engine died ({self.dead}): the next rollout builds a new one")
        self._wake_weights()
        if self.weights_path is None:
            if self.weights_version is None:
                raise WeightSyncError("the vLLM engine's weights are invalid (a weight sync failed, or its synced weights "
                                      "were discarded by a level-2 sleep): sync them again or load a checkpoint")
        elif self._loaded_path != self.weights_path:
            log.info("vLLM: reloading weights in place from %s", self.weights_path)
            self._loaded_path = None  # a failed reload leaves the weights partly written
            try:
                answers = self.llm.collective_rpc("rft_reload_weights", timeout=self.reload_timeout_s,
                                                  args=(self.weights_path,))
            except Exception as exc:  # the executor failed (a worker process died), or a worker did not answer
                # within reload_timeout_s (its reply may still come: the engine cannot be reused); the extension never raises
                self.died(f"{type(exc).__name__}: {exc}")
                raise
            failed = [a for a in answers if not a["ok"]]
            if failed:
                raise RuntimeError(f"vLLM: reloading {self.weights_path} failed on worker(s) "
                                   f"{[a['rank'] for a in failed]}: {'; '.join(a['error'] for a in failed)}")
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            self._loaded_path = self.weights_path
        if self._sleep_level:
            self.llm.wake_up(tags=["kv_cache"])
            self._sleep_level, self._weights_awake = 0, False

    @property
    def sync_world_size(self) -> int:
        """The size of a weight-sync group into this engine: the sender and one receiver per
        tensor-parallel worker (1 + tensor_parallel_size).

        Raises:
            ValueError: a LoRA engine (it serves adapters; a sync moves full weights).
        """
        if self.lora:
            raise ValueError("a vLLM engine built with LoRA serves adapters; an in-memory weight sync needs an engine "
                             "built on the full model (lora_path=None)")
        return 1 + self.tensor_parallel_size

    def receive_weights(self, plan: "SyncPlan | str", meet: Meet, *, timeout_s: float) -> SyncReport:
        """Receive the trainer's weights in memory: wake a sleeping engine's weights, have every
        worker join the sync group and load the buckets (``LLM.collective_rpc(method, timeout=None,
        args=(), kwargs=None) -> list`` of ``vllm/entrypoints/llm.py``, one result per worker,
        calling ``WeightReloadExtension.rft_receive_weights``, under ``timeout_s``: without one it
        waits forever, e.g. for a worker stuck in NCCL's communicator setup when a peer never
        arrives, which no collective's timeout covers), check that every worker received
        the same weights (their digests), reset the prefix cache and record ``meet.version`` as
        what the GPU weights hold (``weights_version``; ``generate`` then reloads nothing). A plan that
        does not fit the engine's model (``plan_refusal``: a tensor missing, unexpected or of
        another shape or dtype) is refused by every worker at the plan check, before a bucket
        moves. The workers answer a status each (``WeightReloadExtension``), so a failure on one
        worker leaves no reply queued in vLLM's executor; the error raised here names each failed
        worker's own error. A ``collective_rpc`` that raises (its ``timeout_s`` passed, a worker
        process died: ``EngineDeadError``) leaves the executor failed or with replies to come: the
        engine is closed (``died``) and the next rollout builds a new one.

        Args:
            plan: the sender's ``SyncPlan`` (or its JSON), in ``sync_dtype``.
            meet: the transaction (``rft_core.weightsync.base.Meet``): ``addr``, ``port``,
                ``backend``, where the sender (rank 0) meets its ``sync_world_size - 1``
                receivers; ``version``, what the weights are (the caller's key of the policy version).
            timeout_s: the limit of the whole receive (``collective_rpc``'s timeout); each wait of
                the workers gets ``OWN_WAIT_SHARE`` of it (``rft_core.weightsync.base``), so that a
                worker that has not answered by then hangs.
        Returns:
            the ``SyncReport`` of what landed (``digest``: the workers' one digest; ``seconds``:
            the slowest worker; ``extra["workers"]``), unverified: the session compares it with
            the sent digest.
        Raises:
            ValueError: a LoRA engine (``sync_world_size``).
            WeightSyncError: the sync failed or the workers' digests differ; the weights are
                then invalid (``generate`` refuses until a sync or ``load_policy`` succeeds), or
                the engine died (see above).
        """
        world_size, version, backend = self.sync_world_size, meet.version, meet.backend
        plan = SyncPlan.from_json(plan) if isinstance(plan, str) else plan
        refusal = self.plan_refusal(plan)
        self._wake_weights()
        self.invalidate_weights()
        try:
            results = self.llm.collective_rpc("rft_receive_weights", timeout=float(timeout_s),
                                              args=(plan.to_json(), meet.addr, meet.port, world_size, backend,
                                                    float(timeout_s) * OWN_WAIT_SHARE, refusal))
        except Exception as exc:  # noqa: BLE001  the executor failed (a worker process died) or the call timed out
            self.died(f"{type(exc).__name__}: {exc}")
            raise WeightSyncError(f"vLLM weight sync of {version} failed: {type(exc).__name__}: {exc} (the engine is "
                                  "closed; the next rollout builds a new one)") from exc
        failed = [r for r in results if not r.get("ok")]
        if failed:
            raise WeightSyncError(f"vLLM weight sync of {version} failed on worker(s) {[r['rank'] for r in failed]}: "
                                  + "; ".join(r["error"] for r in failed))
        digests = sorted({r["digest"] for r in results})
        if len(results) != world_size - 1 or len(digests) != 1:
            raise WeightSyncError(f"vLLM weight sync of {version}: {len(results)} worker(s) of {world_size - 1} answered "
                                  f"with digests {digests}")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.weights_version = version
        return SyncReport(bytes=results[0]["bytes"], seconds=max(r["seconds"] for r in results),
                          buckets=results[0]["buckets"], digest=digests[0], backend=backend,
                          extra={"workers": len(results)})

    def batches(self, prompts: list[list[int]], n: int, batch_size: int, **_: Any) -> list[list[tuple[int, int]]]:
        """Whole groups, prompts sorted by length, max(1, batch_size // n) prompts per batch: the
        units rollout shards split (``only_batches``); one ``generate`` sends all of its batches'
        prompts to vLLM at once."""
        order = sorted(range(len(prompts)), key=lambda p: len(prompts[p]))
        per = max(1, batch_size // n)
        return [[(p, k) for p in order[i:i + per] for k in range(n)] for i in range(0, len(order), per)]

    def generate(self, prompts: list[list[int]], *, n_samples_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, batch_size: int = 256, seed: int = 0, first_token_temperature: float | None = None,
                 progress=None, only_batches: set[int] | None = None, greedy: bool = False,
                 **_: Any) -> list[Generation]:
        """``HFEngine.generate``'s contract: len(prompts) * n generations (of ``only_batches``),
        grouped by prompt in input order; each response up to and including its first EOS.
        ``greedy``: argmax decoding (vLLM's temperature 0; ``temperature`` and ``top_p`` play no part).

        Raises:
            NotImplementedError: ``first_token_temperature`` (FIRE) was asked for.
            RuntimeError: vLLM returned another number of outputs, samples or log-probs.
        """
        if first_token_temperature is not None:
            raise NotImplementedError("rollout.first_token_temperature (FIRE) is not supported by the vLLM engine; "
                                      "use rollout.engine=hf")
        if greedy:
            temperature, top_p = 0.0, 1.0
        n = n_samples_per_prompt
        batches = self.batches(prompts, n, batch_size)
        todo = [p for b, batch in enumerate(batches) if only_batches is None or b in only_batches
                for p, k in batch if k == 0]
        requests = [{"prompt_token_ids": list(prompts[p])} for p in todo]  # vllm TokensPrompt
        params = [self.sampling_params(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                       seed=sample_seed(seed, p, 0, n, bits=VLLM_SEED_BITS), logprobs=0,
                                       stop_token_ids=sorted(self.eos_ids), detokenize=False)
                  for p in todo]
        results: dict[tuple[int, int], Generation] = {}
        if todo:
            self._ensure_ready()
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
            if len(outputs) != len(todo):
                raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(todo)} prompts")
            for p, out in zip(todo, outputs):
                if len(out.outputs) != n:
                    raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for prompt {p}, expected {n}")
                for k, completion in enumerate(out.outputs):
                    results[(p, k)] = self._generation(p, k, completion)
            if self.sleep_after_generate:
                self.sleep()
        if progress is not None:
            progress(len(results), len(results))
        return [results[(p, k)] for p in range(len(prompts)) for k in range(n) if (p, k) in results]

    def _generation(self, p: int, k: int, completion: Any) -> Generation:
        """A vLLM CompletionOutput (token_ids, logprobs: one {token id: Logprob} per token,
        finish_reason) as a Generation, cut after the first EOS as the HF engine does."""
        tokens = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(tokens):
            raise RuntimeError("vLLM returned no log-prob per generated token (SamplingParams.logprobs=0 expected)")
        lps = [float(step[t].logprob) for step, t in zip(completion.logprobs, tokens)]
        finish = "stop" if completion.finish_reason == "stop" else "length"
        for j, t in enumerate(tokens):
            if t in self.eos_ids:
                tokens, lps, finish = tokens[: j + 1], lps[: j + 1], "stop"
                break
        return Generation(p, k, tokens, lps, finish)

    def sleep(self, level: int | None = None) -> None:
        """Free the GPU memory of the KV cache and the weights (``LLM.sleep``, which also resets
        the prefix cache). Level 1 offloads the weights to CPU memory, level 2 discards them
        (they are reloaded from ``weights_path`` on wake-up; synced weights are then invalid);
        None: 1 for LoRA (the base stays) and for synced weights (on no storage), 2 otherwise.
        Needs ``enable_sleep_mode``."""
        if self._sleep_level:
            return
        level = level if level is not None else (1 if self.lora or self.weights_version else 2)
        self.llm.sleep(level=level)
        self._sleep_level, self._weights_awake = level, False
        if level >= 2:
            self._loaded_path = self.weights_version = None

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed (weights reloaded after a level-2 sleep)."""
        self._ensure_ready()

    def close(self) -> None:
        """Shut the engine down and free its GPU memory (``LLM.shutdown`` where the release has
        it, then vLLM's ``cleanup_dist_env_and_memory``); the engine is unusable afterwards."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        collect_all()  # the heap may be frozen: rft_core.heap, or vLLM's freeze_gc_heap when its worker ran here
        _cleanup_vllm()
        release_device_memory()


def get_vllm_engine(model_path: str, *, eos_ids: set[int], lora_path: str | None = None, reload: bool = True,
                      **settings: Any) -> VLLMEngine:
    """The process's cached ``VLLMEngine`` for ``model_path`` (+ ``lora_path``), reused across
    iterations (``rft_core.engines.cached_engine``, ``reload`` as there); ``settings`` are
    ``VLLMEngine``'s keyword arguments."""
    return cached_engine(VLLMEngine, model_path, eos_ids=eos_ids, lora_path=lora_path, reload=reload, **settings)


def release_vllm_engine() -> bool:
    """Close the process's cached vLLM engine, if the cached engine is one; True if closed."""
    return ENGINE_CACHE.release(VLLMEngine)
