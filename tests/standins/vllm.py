"""A stand-in for vLLM 0.33.0 (the release constraints-gpu.txt pins) over tensor-parallel GPU
workers, for a machine without a GPU: ``LLM``, ``SamplingParams``, ``LoRARequest`` and the errors
they raise; ``install(monkeypatch)`` puts them where ``import vllm`` finds them.

Copied behaviour, refusals included:

- **Engine arguments** (``vllm/entrypoints/llm.py`` ``LLM.__init__``, ``vllm/engine/arg_utils.py``
  ``EngineArgs``, a dataclass): ``LLM(model, *, tokenizer, tensor_parallel_size, dtype, seed,
  gpu_memory_utilization, **kwargs)``, every other keyword an ``EngineArgs`` field; an unknown one
  is refused (``TypeError: EngineArgs.__init__() got an unexpected keyword argument ...``), as are
  a ``logprobs_mode`` outside ``LogprobsMode``, a ``max_lora_rank`` outside ``MaxLoRARanks``
  (``vllm/config/model.py``, ``vllm/config/lora.py``) and a dtype outside ``ModelDType``.
  ``ENGINE_ARGS`` lists the fields modelled (``tests/standins/test_upstream.py`` checks each is
  one of 0.33.0's).
- **Worker extension** (``vllm/v1/worker/worker_base.py`` ``WorkerWrapperBase.init_worker``):
  ``worker_extension_cls`` is a qualified name, imported and mixed into the worker class; an
  attribute of the extension that the worker class already has is refused ("Worker class ...
  already has an attribute ..., which conflicts with the worker extension class ...").
- **Sampling parameters** (``vllm/sampling_params.py`` ``SamplingParams``, a msgspec struct):
  keyword fields only; an unknown one is refused (msgspec: ``TypeError: Unexpected keyword
  argument ...``); ``_verify_args``' range checks raise ``VLLMValidationError``; greedy
  (temperature 0) with ``n > 1`` is refused; ``seed=-1`` means no seed.
- **generate** (``LLM.generate``; ``vllm/entrypoints/common/offline.py`` ``_params_to_seq``,
  ``_lora_request_to_seq``): one params (or LoRA request) for all prompts, or one per prompt: a
  list of another length is refused ("The lengths of prompts (2) and params (1) must be the
  same."). Each request's n samples are seeded ``seed + k`` (``vllm/v1/engine/parallel_sampling.py``);
  CompletionOutputs carry the sampled token ids (EOS included), one {token: Logprob} per token
  and finish_reason "stop"/"length".
- **LoRA** (``vllm/v1/engine/input_processor.py`` ``_validate_lora``; ``vllm/lora/request.py``
  ``LoRARequest``; ``vllm/lora/worker_manager.py`` ``_load_adapter``): a request with a LoRA
  request on an engine built without ``enable_lora`` is refused ("Got lora_request ... but LoRA is
  not enabled!"); the adapter is loaded once per ``lora_int_id`` (a later request with the same
  id and another path gets the adapter loaded first: vLLM's cache, ``load_inplace=False``) and
  applied to that request's samples. An adapter that cannot load (no folder:
  ``LoRAAdapterNotFoundError``; a rank above ``max_lora_rank``) fails inside the engine core's
  step, which is fatal (``vllm/v1/engine/core.py``: "EngineCore encountered a fatal error"): that
  ``generate`` and every later call raise ``EngineDeadError``.
- **Workers** (``vllm/v1/worker/gpu_worker.py`` ``Worker``, ``worker_base.py``): ``rank``,
  ``local_rank``, ``device``, ``model_runner`` with ``model`` (the fused, tensor-parallel
  sharded ``EngineModel`` of ``tests/standins/engine_model.py``) and ``model_config``;
  ``reload_weights(*args, **kwargs)`` passes on to the runner's
  ``reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)``
  (``gpu_model_runner.py``; ``model_loader/reload/inplace.py``: with ``weights_path`` the model
  config is pointed at it and the checkpoint's tensors go through ``model.load_weights``; weights
  that were not loaded are only logged).
- **Sleep mode** (``Worker.sleep`` / ``wake_up``; ``vllm/device_allocator/cumem.py``: sleeping
  unmaps the GPU memory of the weights): level 1 offloads the weights to CPU memory, level 2
  discards them; after ``wake_up(["weights"])`` the memory is mapped again, with undefined
  content (NaN here) after level 2 until weights are loaded. Writing weights while they sleep
  touches unmapped memory: "CUDA error: an illegal memory access was encountered", a sticky
  error (every later call of that worker fails). ``generate`` refuses while weights or KV cache
  sleep.
- **The executor** (``vllm/v1/executor/multiproc_executor.py``, ``MultiprocExecutor.collective_rpc``
  and ``WorkerProc``): a call is broadcast to every worker; each worker answers into its own
  response queue, an exception as ``(FAILURE, str(exc))``; the driver reads the queues in rank
  order and raises ``RuntimeError("Worker failed with error '...', please check the stack trace
  above for the root cause")`` at the first failure, leaving the other workers' answers queued,
  where the next call reads them; a ``timeout`` raises ``TimeoutError("RPC call to ... timed
  out.")`` and waits forever without one. A worker process that dies
  (``start_worker_monitor``: the executor is failed and shut down, the engine core dies) fails
  the pending call and every later one with ``EngineDeadError`` (``vllm/v1/engine/exceptions.py``).
  Tests make a worker hang (``Worker.hang``) or die (``Worker.die``) inside a call.

Not modelled: separate processes (workers are threads of this process), the GPU (weights live in
CPU memory), CUDA graphs, the scheduler. Generation runs through the HF engine on an HF model that
holds what the workers' shards hold (``engine_model.load_hf_into``), so samples reflect the
weights the workers really hold; its dtype is the HF model's.
"""
from __future__ import annotations

import copy
import importlib
import json
import logging
import math
import queue
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tests.standins.engine_model import EngineModel, load_hf_into

log = logging.getLogger("tests.standins.vllm")

SUCCESS, FAILURE = "SUCCESS", "FAILURE"  # WorkerProc.ResponseStatus

# vllm/config/model.py ModelDType and LogprobsMode, vllm/config/lora.py MaxLoRARanks (0.33.0)
DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16}
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The EngineArgs fields (vllm/engine/arg_utils.py, 0.33.0) this stand-in takes, with their defaults; every
# other keyword is refused as EngineArgs refuses an unknown one.
ENGINE_ARGS = {"enable_sleep_mode": False, "logprobs_mode": "raw_logprobs", "enable_prefix_caching": None,
               "worker_extension_cls": "", "max_model_len": None, "enable_lora": False, "max_lora_rank": 16,
               "max_loras": 1, "disable_log_stats": False, "enforce_eager": False}
# SamplingParams fields (vllm/sampling_params.py, 0.33.0) modelled, with their defaults
SAMPLING_FIELDS = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": None,
                   "stop_token_ids": None, "ignore_eos": False, "max_tokens": 16, "min_tokens": 0, "logprobs": None,
                   "prompt_logprobs": None, "detokenize": True, "skip_special_tokens": True}
_SAMPLING_EPS = 1e-5  # vllm/sampling_params.py: below it, greedy


class VLLMValidationError(Exception):
    """``vllm.exceptions.VLLMValidationError`` (a ``VLLMClientError``: not a ValueError)."""


class EngineDeadError(Exception):
    """``vllm.v1.engine.exceptions.EngineDeadError``: the engine core died; unrecoverable."""

    def __init__(self, *args: Any) -> None:
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.", *args)


class LoRAAdapterNotFoundError(Exception):
    """``vllm.exceptions.LoRAAdapterNotFoundError``."""

    def __init__(self, lora_name: str, lora_path: str) -> None:
        super().__init__(f"Loading lora {lora_name} failed: No adapter found for {lora_path}")


class WorkerDied(BaseException):  # noqa: N818  the worker's process is gone, not an error it answers
    """Raised inside a worker to end its process (``Worker.die``)."""


class SamplingParams:
    """``vllm.SamplingParams`` (see the module docstring): the fields of ``SAMPLING_FIELDS``."""

    def __init__(self, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in SAMPLING_FIELDS:
                raise TypeError(f"Unexpected keyword argument {name!r}")  # msgspec's refusal
        for name, default in SAMPLING_FIELDS.items():
            setattr(self, name, kwargs.get(name, default))
        if self.seed == -1:
            self.seed = None
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_args(self) -> None:
        """``SamplingParams._verify_args`` (the checks of the modelled fields)."""
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}."),
            (math.isfinite(self.temperature), f"temperature must be a finite number, got {self.temperature}."),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}."),
            (self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}."),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}."),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.logprobs is None or self.logprobs == -1 or self.logprobs >= 0,
             f"logprobs must be non-negative or -1, got {self.logprobs}."),
            (all(isinstance(t, int) for t in self.stop_token_ids),
             f"stop_token_ids must contain only integers, got {self.stop_token_ids}."),
            (not (self.stop and not self.detokenize), "stop strings are only supported when detokenize is True. "
                                                      "Set detokenize=True to use stop."),
        ]
        for ok, message in checks:
            if not ok:
                raise VLLMValidationError(message)


class LoRARequest:
    """``vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)``: ids start at 1, the path is required;
    equal by name (``__eq__``)."""

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "") -> None:
        if lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")
        assert lora_path, "lora_path cannot be empty"
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, lora_path={self.lora_path!r})"


def install(monkeypatch) -> types.ModuleType:
    """Make ``import vllm`` (``from vllm import LLM, SamplingParams``, ``from vllm.lora.request import
    LoRARequest``) find this stand-in for the rest of the test; returns the ``vllm`` module."""
    top, lora, request = (types.ModuleType(n) for n in ("vllm", "vllm.lora", "vllm.lora.request"))
    top.LLM, top.SamplingParams, top.lora = LLM, SamplingParams, lora
    lora.request, request.LoRARequest = request, LoRARequest
    for name, module in (("vllm", top), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)
    return top


def checkpoint_tensors(path: str):
    """The tensors of an HF checkpoint folder under their names on disk (vLLM's
    ``DefaultModelLoader.get_all_weights`` over ``*.safetensors``)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for f in files:
        yield from load_file(str(f)).items()


class ModelRunner:
    """``GPUModelRunner``: ``model``, ``model_config`` and in-place ``reload_weights``."""

    def __init__(self, model: EngineModel, model_path: str) -> None:
        self.model = model
        self.model_config = SimpleNamespace(model=model_path, quantization=None, hf_config=model.config)
        self.reloads: list[dict] = []

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True):
        """inplace.py ``reload_weights``: from ``weights_iterator``, else from ``weights_path`` (or
        the model config's path), through ``model.load_weights``; missing weights are only logged."""
        self.reloads.append({"weights_path": weights_path, "iterator": weights_iterator is not None})
        if weights_iterator is None:
            if weights_path is not None:
                self.model_config.model = weights_path
            weights_iterator = checkpoint_tensors(self.model_config.model)
        loaded = self.model.load_weights(weights_iterator)
        missing = {n for n, _ in self.model.named_parameters()} - set(loaded or ())
        if missing:
            log.warning("Following weights were not loaded from checkpoint: %s", missing)


class Worker:
    """``vllm.v1.worker.gpu_worker.Worker`` (see the module docstring). ``hang``: a threading.Event
    the next call waits on before it starts (a worker stuck, e.g. in NCCL's communicator setup);
    ``die``: the next call ends the worker's process instead of running."""

    def __init__(self, model_path: str, config, *, rank: int, tp_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.rank = self.local_rank = rank
        self.device = torch.device(device)
        self.model_config = SimpleNamespace(quantization=None)
        self.model_runner = ModelRunner(EngineModel(config, tp_rank=rank, tp_size=tp_size, dtype=dtype, flavour="vllm"),
                                        model_path)
        self._offloaded: dict[str, torch.Tensor] | None = None
        self.asleep: set[str] = set()
        self.hang: threading.Event | None = None
        self.die = False

    @property
    def cuda_error(self) -> str | None:
        """A CUDA error this worker's process hit (sticky: every later call fails with it)."""
        return self.model_runner.model.cuda_error

    def reload_weights(self, *args, **kwargs) -> None:
        self.model_runner.reload_weights(*args, **kwargs)

    def sleep(self, level: int = 1) -> None:
        params = dict(self.model_runner.model.named_parameters())
        self._offloaded = {n: p.data.clone() for n, p in params.items()} if level == 1 else None
        for p in params.values():  # the GPU memory is released: its content is gone
            p.data.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}
        self.model_runner.model.unmapped = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = ["weights", "kv_cache"] if tags is None else tags
        if "weights" in tags and "weights" in self.asleep:
            if self._offloaded is not None:
                for n, p in self.model_runner.model.named_parameters():
                    p.data.copy_(self._offloaded[n])
            self._offloaded = None
            self.model_runner.model.unmapped = False
        self.asleep -= set(tags)


def worker_class(extension: str | None) -> type:
    """The worker class with ``worker_extension_cls`` (a qualified name) mixed in, refused on a
    name conflict (``WorkerWrapperBase.init_worker``)."""
    if not extension:
        return Worker
    module, _, name = extension.rpartition(".")
    ext = getattr(importlib.import_module(module), name)  # vllm.utils.import_utils.resolve_obj_by_qualname
    for attr in dir(ext):
        if attr.startswith("__"):
            continue
        assert not hasattr(Worker, attr), (f"Worker class {Worker} already has an attribute {attr}, which conflicts "
                                           f"with the worker extension class {ext}.")
    return type(f"{ext.__name__}Worker", (Worker, ext), {})


class Executor:
    """``MultiprocExecutor`` (see the module docstring): one request queue and one response
    queue per worker; each call runs every worker's request in a thread of its own."""

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.requests = [queue.Queue() for _ in workers]
        self.responses = [queue.Queue() for _ in workers]
        self.is_failed = self.closed = False
        self._failed = threading.Event()

    def _serve_one(self, rank: int) -> None:
        """``WorkerProc.worker_busy_loop`` for one request: run it, answer (status, result)."""
        method, args, kwargs = self.requests[rank].get()
        worker = self.workers[rank]
        try:
            if worker.die:
                raise WorkerDied(f"worker {rank} died")
            if worker.hang is not None:
                worker.hang.wait()
                if self.closed:  # shut down while it hung: its process was killed, nothing answers
                    return
            if worker.cuda_error:
                raise RuntimeError(worker.cuda_error)
            self.responses[rank].put((SUCCESS, getattr(worker, method)(*args, **kwargs)))
        except WorkerDied:  # start_worker_monitor: the executor fails, the engine core dies
            log.error("Worker proc VllmWorker-%d died unexpectedly, shutting down executor.", rank)
            self.is_failed = True
            self._failed.set()
        except Exception as exc:  # noqa: BLE001  enqueue_output: an exception becomes a FAILURE response
            log.exception("WorkerProc hit an exception.")
            self.responses[rank].put((FAILURE, str(exc)))

    def _get(self, rank: int, deadline: float | None, method: str):
        """The answer of worker ``rank``; ``EngineDeadError`` as soon as the executor failed."""
        while True:
            left = None if deadline is None else deadline - _now()
            if left is not None and left <= 0:
                raise TimeoutError(f"RPC call to {method} timed out.")
            try:
                return self.responses[rank].get(timeout=0.05 if left is None else min(left, 0.05))
            except queue.Empty:
                if self._failed.is_set():
                    raise EngineDeadError() from None

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        if self.is_failed:
            raise EngineDeadError()
        for q in self.requests:
            q.put((method, tuple(args), dict(kwargs or {})))
        for rank in range(len(self.workers)):
            threading.Thread(target=self._serve_one, args=(rank,), daemon=True).start()
        deadline = None if timeout is None else _now() + timeout
        responses = []
        for rank in range(len(self.workers)):
            status, result = self._get(rank, deadline, method)
            if status != SUCCESS:
                raise RuntimeError(f"Worker failed with error '{result}', please check the stack trace above for the "
                                   "root cause")
            responses.append(result)
        return responses


def _now() -> float:
    import time

    return time.monotonic()


def torch_dtype(dtype: Any, config) -> torch.dtype:
    """``_get_and_verify_dtype`` (vllm/config/model.py): a ModelDType name or a torch dtype; ``auto`` is the
    checkpoint's dtype with float32 turned into the platform's first supported dtype (bfloat16 here)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"Unknown dtype: {dtype}")
    dtype = dtype.lower()
    if dtype == "auto":
        got = getattr(config, "torch_dtype", None) or torch.float32
        got = DTYPES.get(got, got) if isinstance(got, str) else got
        return torch.bfloat16 if got == torch.float32 else got
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype: {dtype!r}")
    return DTYPES[dtype]


def check_engine_args(kwargs: dict[str, Any], gpu_memory_utilization: float) -> dict[str, Any]:
    """``EngineArgs(**kwargs)`` and the config checks of the modelled fields: the fields with defaults.

    Raises:
        TypeError: an unknown field. ValueError: a value its config type refuses.
    """
    for name in kwargs:
        if name not in ENGINE_ARGS:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {name!r}")
    args = {**ENGINE_ARGS, **kwargs}
    if args["logprobs_mode"] not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode: Input should be {', '.join(map(repr, LOGPROBS_MODES))}")
    if args["max_lora_rank"] not in MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank: Input should be {', '.join(map(str, MAX_LORA_RANKS))}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return args


class LLM:
    """``vllm.LLM`` (vllm/entrypoints/llm.py; see the module docstring): ``generate``,
    ``collective_rpc(method, timeout=None, args=(), kwargs=None) -> list``, ``reset_prefix_cache``,
    ``sleep(level)``, ``wake_up(tags)``, ``shutdown``; every call recorded in ``events``, the engine
    arguments in ``engine_args``. ``eos_early``: force this token at step 2 of each request's
    sample 0 (to exercise EOS cuts)."""

    def __init__(self, model: str, *, tokenizer: str | None = None, tensor_parallel_size: int = 1,
                 dtype: Any = "auto", seed: int = 0, gpu_memory_utilization: float = 0.92, **kwargs: Any) -> None:
        from rft_core.engines.hf import HFEngine

        args = check_engine_args(kwargs, gpu_memory_utilization)
        self.engine_args = {"model": model, "tokenizer": tokenizer, "tensor_parallel_size": tensor_parallel_size,
                            "dtype": dtype, "seed": seed, "gpu_memory_utilization": gpu_memory_utilization, **kwargs}
        self.enable_lora, self.max_lora_rank = args["enable_lora"], args["max_lora_rank"]
        hf, tok = self._hf_model(model, tokenizer or model)
        cls = worker_class(args["worker_extension_cls"])
        self.workers = [cls(model, hf.config, rank=r, tp_size=tensor_parallel_size, dtype=self._dtype(dtype, hf))
                        for r in range(tensor_parallel_size)]
        for w in self.workers:
            w.model_runner.model.load_weights(self._weights(model))
        self.executor = Executor(self.workers)
        self.hf = HFEngine(hf, tok)
        self.eos_early: int | None = None
        self.events: list[tuple] = []
        self.calls: list = []
        self.child_seeds: list[int] = []
        self.adapters: dict[int, str] = {}  # lora_int_id -> the adapter folder loaded under it
        self.closed = False

    # -- what the stand-in loads (tests/rft_core/engines/fakes.py overrides these) ----------------------
    def _hf_model(self, model: str, tokenizer: str):
        from rft_core.models.loading import load_causal_lm, load_tokenizer

        return load_causal_lm(model).eval(), load_tokenizer(tokenizer)

    def _dtype(self, dtype: Any, hf: torch.nn.Module) -> torch.dtype:
        return torch_dtype(dtype, hf.config)

    def _weights(self, model: str):
        return checkpoint_tensors(model)

    # -----------------------------------------------------------------------------------------------------
    def _shards(self) -> list[EngineModel]:
        return [w.model_runner.model for w in self.workers]

    def _alive(self) -> None:
        if self.executor.is_failed:
            raise EngineDeadError()

    @staticmethod
    def _per_prompt(value: Any, n: int, what: str) -> list:
        """``_params_to_seq`` / ``_lora_request_to_seq``: one value for all, or one per prompt."""
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise VLLMValidationError(f"The lengths of prompts ({n}) and {what} ({len(value)}) must be the same.")
            return list(value)
        return [value] * n

    def _lora_engine(self, request: LoRARequest):
        """An HF engine of the base weights with ``request``'s adapter merged (the adapter its id
        was first loaded from); a load that fails kills the engine (see the module docstring)."""
        from peft import PeftModel

        from rft_core.engines.hf import HFEngine

        path = self.adapters.setdefault(request.lora_int_id, request.lora_path)
        try:
            config = Path(path) / "adapter_config.json"
            if not config.is_file():
                raise LoRAAdapterNotFoundError(request.lora_name, path)
            rank = json.loads(config.read_text())["r"]
            if rank > self.max_lora_rank:
                raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.")
        except Exception as exc:
            self.executor.is_failed = True
            self.executor._failed.set()
            raise EngineDeadError() from exc
        base = copy.deepcopy(self.hf.model)
        return HFEngine(PeftModel.from_pretrained(base, path).merge_and_unload().eval(), self.hf.tokenizer)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None):
        """``LLM.generate`` (see the module docstring)."""
        self._alive()
        sleeping = set().union(*(w.asleep for w in self.workers))
        if sleeping or self.closed:
            raise RuntimeError(f"vLLM stand-in: generate while {sorted(sleeping) or 'shut down'} (wake_up first)")
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        params = self._per_prompt(SamplingParams() if sampling_params is None else sampling_params, len(prompts),
                                  "params")
        loras = self._per_prompt(lora_request, len(prompts), "lora_request")
        for lr in loras:
            if lr is not None and not self.enable_lora:
                raise VLLMValidationError(f"Got lora_request {lr} but LoRA is not enabled!")
        self.calls.append((prompts, params, lora_request))
        self.events.append(("generate", len(prompts)))
        load_hf_into(self.hf.model, self._shards())
        engines = {lr.lora_int_id: self._lora_engine(lr) for lr in loras if lr is not None}
        return [SimpleNamespace(outputs=self._complete(req, sp, self.hf if lr is None else engines[lr.lora_int_id]))
                for req, sp, lr in zip(prompts, params, loras)]

    def _complete(self, req: dict, sp: SamplingParams, engine) -> list:
        """The n CompletionOutputs of one request, sample k seeded ``seed + k``."""
        assert sp.logprobs == 0 and sp.detokenize is False and sorted(self.hf.eos_ids) == sp.stop_token_ids
        completions = []
        for k in range(sp.n):
            self.child_seeds.append(sp.seed + k)
            greedy = sp.temperature < _SAMPLING_EPS
            g = engine.generate([req["prompt_token_ids"]], n_samples_per_prompt=1, max_new_tokens=sp.max_tokens,
                                temperature=1.0 if greedy else sp.temperature, top_p=sp.top_p, seed=sp.seed + k,
                                batch_size=1, greedy=greedy)[0]
            tokens, lps, finish = list(g.response_token_ids), list(g.logprobs), g.finish_reason
            if k == 0 and self.eos_early is not None and len(tokens) >= 3:
                tokens, finish = tokens[:2] + [self.eos_early] + tokens[3:], "length"
            completions.append(SimpleNamespace(
                token_ids=tokens, finish_reason=finish, stop_reason=None,
                logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, lps)]))
        return completions

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.events.append(("collective_rpc", method, tuple(args) if method == "rft_reload_weights" else ()))
        return self.executor.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self._alive()
        self.events.append(("reset_prefix_cache",))
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.events.append(("sleep", level))
        self.executor.collective_rpc("sleep", kwargs={"level": level})

    def wake_up(self, tags=None) -> bool:
        self.events.append(("wake_up", tuple(tags) if tags else None))
        self.executor.collective_rpc("wake_up", kwargs={"tags": list(tags) if tags else None})
        return not any(w.asleep for w in self.workers)

    def shutdown(self) -> None:
        self.events.append(("shutdown",))
        self.closed = self.executor.closed = True
        for w in self.workers:  # the workers' processes end, a hung one too
            if w.hang is not None:
                w.hang.set()
