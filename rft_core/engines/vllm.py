"""vLLM rollout engine: the same interface and outputs as ``HFEngine`` (token ids, rollout
log-probs, finish reasons), on vLLM's batched generation. GPU only; vLLM lives in its own
environment (it pins its own torch and cannot share one with Prefect): run the rollout stage
there with ``runners.rollout: {mode: subprocess, python: /path/to/vllm-env/bin/python}``
(docs/scale.md). Imported lazily: nothing here imports vllm at module import.

Differences from the HF engine, by design:
- Seeds are per prompt (``seed + prompt index`` in ``SamplingParams.seed``), so a prompt's samples
  do not depend on which other prompts share its batch (vLLM schedules requests itself).
- Log-probs come from ``logprobs_mode="processed_logprobs"``: log-softmax of the logits after
  temperature (and after top-p masking when ``top_p < 1``, where they differ from the HF
  engine's; the actor log-prob stage recomputes them anyway unless
  ``logprobs.recompute_old_logprobs=false``).
- FIRE sampling (``first_token_temperature``) is not supported (vLLM has no per-step
  temperature): a clear error.
- A LoRA policy checkpoint is served through vLLM's LoRA support (``LoRARequest``) on its base
  model; a full checkpoint is loaded as a model.
- ``sleep()`` / ``wake_up()`` free and restore the GPU memory of weights and KV cache when the
  engine shares a GPU with training (``enable_sleep_mode``).
"""
from __future__ import annotations

from typing import Any, Callable

from rft_core.engines.hf import Generation


def build_llm(**kwargs: Any):
    """``vllm.LLM(**kwargs)`` (the one place vllm's engine is built; tests replace it)."""
    from vllm import LLM

    return LLM(**kwargs)


def vllm_sampling_params():
    """The ``vllm.SamplingParams`` class."""
    from vllm import SamplingParams

    return SamplingParams


def lora_request(path: str):
    """A ``vllm.lora.request.LoRARequest`` for the adapter folder ``path``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest("policy", 1, path)


class VLLMEngine:
    """Rollouts with ``vllm.LLM``.

    Args:
        model_path: a local HF folder (or hub id) of the policy, or of a LoRA adapter's base
            when ``lora_path`` is given.
        eos_ids: token ids that end a response (the tokenizer's and the generation config's EOS).
        lora_path: a peft adapter folder to apply (vLLM LoRA).
        llm: an object with vllm.LLM's ``generate(prompts, sampling_params, use_tqdm=..., lora_request=...)``
            (tests pass one backed by the HF engine); None builds ``vllm.LLM`` from the other arguments.
        sampling_params: the SamplingParams class (default ``vllm.SamplingParams``).
    """

    def __init__(self, model_path: str, *, eos_ids: set[int], lora_path: str | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, dtype: str = "auto", max_model_len: int | None = None,
                 enable_sleep_mode: bool = False, max_lora_rank: int = 64, llm: Any = None,
                 sampling_params: Callable[..., Any] | None = None) -> None:
        self.eos_ids = set(eos_ids)
        if llm is None:
            kwargs: dict[str, Any] = dict(model=model_path, tensor_parallel_size=tensor_parallel_size,
                                          gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                                          enable_sleep_mode=enable_sleep_mode, logprobs_mode="processed_logprobs",
                                          enable_prefix_caching=True)
            if max_model_len is not None:
                kwargs["max_model_len"] = max_model_len
            if lora_path is not None:
                kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank)
            llm = build_llm(**kwargs)
        self.llm = llm
        self.sampling_params = sampling_params or vllm_sampling_params()
        self.lora_request = lora_request(lora_path) if lora_path is not None else None

    def batches(self, prompts: list[list[int]], n: int, batch_size: int, **_: Any) -> list[list[tuple[int, int]]]:
        """Whole groups, prompts sorted by length, max(1, batch_size // n) prompts per call (vLLM
        schedules inside a call; the split only bounds memory and lets shards share work)."""
        order = sorted(range(len(prompts)), key=lambda p: len(prompts[p]))
        per = max(1, batch_size // n)
        return [[(p, k) for p in order[i:i + per] for k in range(n)] for i in range(0, len(order), per)]

    def generate(self, prompts: list[list[int]], *, n_samples_per_prompt: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, batch_size: int = 256, seed: int = 0, first_token_temperature: float | None = None,
                 progress=None, only_batches: set[int] | None = None, **_: Any) -> list[Generation]:
        """``HFEngine.generate``'s contract: len(prompts) * n generations (of ``only_batches``),
        grouped by prompt in input order; each response up to and including its first EOS.

        Raises:
            NotImplementedError: ``first_token_temperature`` (FIRE) was asked for.
        """
        if first_token_temperature is not None:
            raise NotImplementedError("rollout.first_token_temperature (FIRE) is not supported by the vLLM engine; "
                                      "use rollout.engine=hf")
        n = n_samples_per_prompt
        batches = self.batches(prompts, n, batch_size)
        todo = [b for b in range(len(batches)) if only_batches is None or b in only_batches]
        total = sum(len(batches[b]) for b in todo)
        results: dict[tuple[int, int], Generation] = {}
        done = 0
        for b in todo:
            group_prompts = [p for p, k in batches[b] if k == 0]
            requests = [{"prompt_token_ids": list(prompts[p])} for p in group_prompts]  # a vllm TokensPrompt
            params = [self.sampling_params(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                           seed=seed + p, logprobs=0, stop_token_ids=sorted(self.eos_ids), detokenize=False)
                      for p in group_prompts]
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
            for p, out in zip(group_prompts, outputs):
                if len(out.outputs) != n:
                    raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for prompt {p}, expected {n}")
                for k, completion in enumerate(out.outputs):
                    results[(p, k)] = self._generation(p, k, completion)
            done += len(batches[b])
            if progress is not None:
                progress(done, total)
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

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory of the KV cache (level 1: weights offloaded to CPU; 2: discarded)."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed."""
        self.llm.wake_up()
