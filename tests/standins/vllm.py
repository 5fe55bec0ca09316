"""A stand-in for ``vllm.LLM`` over tensor-parallel GPU workers (vLLM 0.33.0, the release
``vllm>=0.10.2`` installs today), for a machine without a GPU.

Copied behaviour:

- **Workers** (``vllm/v1/worker/gpu_worker.py`` ``Worker``, ``worker_base.py``): ``rank``,
  ``local_rank``, ``device``, ``model_runner`` with ``model`` (the fused, tensor-parallel
  sharded ``EngineModel`` of ``tests/standins/engine_model.py``) and ``model_config``;
  ``reload_weights(*args, **kwargs)`` passes on to the runner's
  ``reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)``
  (``gpu_model_runner.py``; ``model_loader/reload/inplace.py``: with ``weights_path`` the model
  config is pointed at it and the checkpoint's tensors go through ``model.load_weights``; weights
  that were not loaded are only logged). The project's ``worker_extension_cls`` is mixed into the
  worker class, as ``WorkerWrapperBase`` does.
- **Sleep mode** (``Worker.sleep`` / ``wake_up``): level 1 offloads the weights to CPU memory and
  frees the GPU's (their content is gone until ``wake_up`` copies them back); level 2 discards
  them: after ``wake_up(["weights"])`` the memory is allocated again with undefined content
  (NaN here) until weights are loaded. ``generate`` refuses while weights or KV cache sleep.
- **The executor** (``vllm/v1/executor/multiproc_executor.py``, ``MultiprocExecutor.collective_rpc``
  and ``WorkerProc``): a call is broadcast to every worker; each worker answers into its own
  response queue, an exception as ``(FAILURE, str(exc))``; the driver reads the queues in rank
  order and raises ``RuntimeError("Worker failed with error '...', please check the stack trace
  above for the root cause")`` at the first failure, leaving the other workers' answers queued,
  where the next call reads them; a ``timeout`` raises ``TimeoutError("RPC call to ... timed out.")``.

Not modelled: separate processes (workers are threads of this process), the GPU (weights live in
CPU memory), CUDA graphs, the scheduler. Generation runs through the HF engine on an HF model that
holds what the workers' shards hold (``engine_model.load_hf_into``), so samples reflect the
weights the workers really hold.
"""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.standins.engine_model import EngineModel, load_hf_into

log = logging.getLogger("tests.standins.vllm")

SUCCESS, FAILURE = "SUCCESS", "FAILURE"  # WorkerProc.ResponseStatus


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
    """``vllm.v1.worker.gpu_worker.Worker`` (see the module docstring)."""

    def __init__(self, model_path: str, config, *, rank: int, tp_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.rank = self.local_rank = rank
        self.device = torch.device(device)
        self.model_config = SimpleNamespace(quantization=None)
        self.model_runner = ModelRunner(EngineModel(config, tp_rank=rank, tp_size=tp_size, dtype=dtype, flavour="vllm"),
                                        model_path)
        self._offloaded: dict[str, torch.Tensor] | None = None
        self.asleep: set[str] = set()

    def reload_weights(self, *args, **kwargs) -> None:
        self.model_runner.reload_weights(*args, **kwargs)

    def sleep(self, level: int = 1) -> None:
        params = dict(self.model_runner.model.named_parameters())
        self._offloaded = {n: p.data.clone() for n, p in params.items()} if level == 1 else None
        for p in params.values():  # the GPU memory is released: its content is gone
            p.data.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = ["weights", "kv_cache"] if tags is None else tags
        if "weights" in tags and "weights" in self.asleep:
            if self._offloaded is not None:
                for n, p in self.model_runner.model.named_parameters():
                    p.data.copy_(self._offloaded[n])
            self._offloaded = None
        self.asleep -= set(tags)


def worker_class(extension: type | None) -> type:
    """The worker class with ``worker_extension_cls`` mixed in (``WorkerWrapperBase.init_worker``)."""
    return Worker if extension is None else type(f"{extension.__name__}Worker", (Worker, extension), {})


class Executor:
    """``MultiprocExecutor`` (see the module docstring): one request queue and one response
    queue per worker; each call runs every worker's request in a thread of its own."""

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.requests = [queue.Queue() for _ in workers]
        self.responses = [queue.Queue() for _ in workers]

    def _serve_one(self, rank: int) -> None:
        """``WorkerProc.worker_busy_loop`` for one request: run it, answer (status, result)."""
        method, args, kwargs = self.requests[rank].get()
        try:
            self.responses[rank].put((SUCCESS, getattr(self.workers[rank], method)(*args, **kwargs)))
        except Exception as exc:  # noqa: BLE001  enqueue_output: an exception becomes a FAILURE response
            log.exception("WorkerProc hit an exception.")
            self.responses[rank].put((FAILURE, str(exc)))

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        for q in self.requests:
            q.put((method, tuple(args), dict(kwargs or {})))
        for rank in range(len(self.workers)):
            threading.Thread(target=self._serve_one, args=(rank,), daemon=True).start()
        responses = []
        for q in self.responses:
            try:
                status, result = q.get(timeout=timeout)
            except queue.Empty as exc:
                raise TimeoutError(f"RPC call to {method} timed out.") from exc
            if status != SUCCESS:
                raise RuntimeError(f"Worker failed with error '{result}', please check the stack trace above for the "
                                   "root cause")
            responses.append(result)
        return responses


class LLM:
    """``vllm.LLM`` (vllm/entrypoints/llm.py): ``generate``, ``collective_rpc(method, timeout=None,
    args=(), kwargs=None) -> list``, ``reset_prefix_cache``, ``sleep(level)``, ``wake_up(tags)``,
    ``shutdown``; every call recorded in ``events``.

    Args:
        model_path: the checkpoint the workers load at start (``LLM(model=...)``).
        tok: the tokenizer (the HF engine generates with it).
        tensor_parallel_size, dtype: the workers and their shards.
        extension: the ``worker_extension_cls`` to mix in (the project's ``WeightReloadExtension``).
        hf: the HF model generation runs on (its weights are overwritten with the workers' before
            each ``generate``); None loads one from ``model_path``.
        eos_early: force this token at step 2 of each request's sample 0 (to exercise EOS cuts).
    """

    def __init__(self, model_path: str, tok, *, tensor_parallel_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                 extension: type | None = None, hf: torch.nn.Module | None = None, eos_early: int | None = None,
                 load: bool = True) -> None:
        from rft_core.engines.hf import HFEngine
        from rft_core.models.loading import load_causal_lm

        hf = hf if hf is not None else load_causal_lm(model_path).eval()
        cls = worker_class(extension)
        self.workers = [cls(model_path, hf.config, rank=r, tp_size=tensor_parallel_size, dtype=dtype)
                        for r in range(tensor_parallel_size)]
        if load:
            for w in self.workers:
                w.model_runner.model.load_weights(checkpoint_tensors(model_path))
        self.executor = Executor(self.workers)
        self.hf = HFEngine(hf, tok)
        self.eos_early = eos_early
        self.events: list[tuple] = []
        self.calls: list = []
        self.child_seeds: list[int] = []
        self.closed = False

    def _shards(self) -> list[EngineModel]:
        return [w.model_runner.model for w in self.workers]

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        """vLLM semantics: one request per prompt with n samples, sample k seeded ``seed + k``
        (vllm/v1/engine/parallel_sampling.py); CompletionOutputs carry the sampled token ids (EOS
        included), one {token: Logprob} per token and finish_reason "stop"/"length"."""
        sleeping = set().union(*(w.asleep for w in self.workers))
        if sleeping or self.closed:
            raise RuntimeError(f"vLLM stand-in: generate while {sorted(sleeping) or 'shut down'} (wake_up first)")
        self.calls.append((requests, params, lora_request))
        self.events.append(("generate", len(requests)))
        if lora_request is None:
            load_hf_into(self.hf.model, self._shards())
        outs = []
        for req, sp in zip(requests, params):
            assert sp.logprobs == 0 and sp.detokenize is False and sorted(self.hf.eos_ids) == sp.stop_token_ids
            completions = []
            for k in range(sp.n):
                self.child_seeds.append(sp.seed + k)
                greedy = sp.temperature == 0
                g = self.hf.generate([req["prompt_token_ids"]], n_samples_per_prompt=1, max_new_tokens=sp.max_tokens,
                                     temperature=1.0 if greedy else sp.temperature, top_p=sp.top_p, seed=sp.seed + k,
                                     batch_size=1, greedy=greedy)[0]
                tokens, lps, finish = list(g.response_token_ids), list(g.logprobs), g.finish_reason
                if k == 0 and self.eos_early is not None and len(tokens) >= 3:
                    tokens, finish = tokens[:2] + [self.eos_early] + tokens[3:], "length"
                completions.append(SimpleNamespace(
                    token_ids=tokens, finish_reason=finish, stop_reason=None,
                    logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, lps)]))
            outs.append(SimpleNamespace(outputs=completions))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.events.append(("collective_rpc", method, tuple(args) if method == "rft_reload_weights" else ()))
        return self.executor.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
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
        self.closed = True
