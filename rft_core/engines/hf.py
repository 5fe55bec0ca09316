"""Batched HF ``generate`` rollout engine (the CPU/default engine)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.experience import zero_pad_sequences


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    Attributes:
        prompt_index: index of the prompt in the request.
        sample_index: 0..n_samples_per_prompt-1.
        response_token_ids: generated tokens up to and including the first EOS (if any).
        logprobs: log-probs of those tokens under the sampling logits / temperature (float32).
        finish_reason: "stop" (EOS generated) or "length" (max_new_tokens reached).
    """

    prompt_index: int
    sample_index: int
    response_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class StepTemperature:
    """Logits processor: divide by ``first_token_temperature`` at the first generated step and by
    ``temperature`` afterwards (FIRE sampling, Chen et al. 2024, arXiv:2410.21236)."""

    def __init__(self, *, prompt_len: int, first_token_temperature: float, temperature: float) -> None:
        self.prompt_len = prompt_len
        self.first = first_token_temperature
        self.rest = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / (self.first if input_ids.shape[1] == self.prompt_len else self.rest)


class StepLogprobs:
    """Forward hook (``register_forward_hook(..., with_kwargs=True)``) that records, during
    ``generate``, log p(token) = x[token] - logsumexp(x) with x = raw logits / temperature of
    each sampled token, keeping one step at a time: the last position's logits row (B, V) of the
    latest forward pass and its logsumexp. The token sampled from step j is the ``input_ids`` of
    forward j+1 (the KV-cache decode step), so each forward first scores the previous step's
    token; ``result`` scores the last one. Memory: O(B x V) for the pending step plus (B,) per
    generated token, instead of ``output_logits``' (B, V) float32 tensor per step.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = float(temperature)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (row (B, V) model dtype, lse (B,) float32)
        self.steps: list[torch.Tensor] = []  # (B,) float32 per scored token

    def __call__(self, module, args, kwargs, output) -> None:
        logits = output.logits if hasattr(output, "logits") else output[0]
        if self.pending is not None:
            ids = kwargs.get("input_ids")
            if ids is None and args:
                ids = args[0]
            if ids is None:
                raise RuntimeError("StepLogprobs: a decode step was called without input_ids; cannot score the sampled token")
            self.steps.append(self._score(ids[:, -1]))
        row = logits[:, -1, :].detach().clone()
        self.pending = (row, torch.logsumexp(row.float() / self.temperature, dim=-1))

    def _score(self, tokens: torch.Tensor) -> torch.Tensor:
        row, lse = self.pending
        return row.gather(-1, tokens[:, None].to(row.device)).squeeze(-1).float() / self.temperature - lse

    def result(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, N) float32 log-probs of ``new_tokens`` (B, N), the tokens ``generate`` appended.

        Raises:
            RuntimeError: the hook saw a number of forward passes other than N.
        """
        n = new_tokens.shape[1]
        if n == 0:
            return torch.zeros(new_tokens.shape[0], 0)
        if self.pending is None or len(self.steps) != n - 1:
            raise RuntimeError(f"StepLogprobs: {len(self.steps) + (self.pending is not None)} forward passes for {n} "
                               "generated tokens (one forward per token expected)")
        return torch.stack(self.steps + [self._score(new_tokens[:, -1])], dim=1).cpu()


class HFEngine:
    """Generates with ``model.generate`` (KV cache on) in batches of left-padded prompts.

    Speed (``benchmarks/rollout_speed.py``): prompts are sorted by length so each batch holds
    prompts of similar length (little left padding), and a batch holds whole groups: each
    prompt's KV cache is computed once (prefill) and repeated for its n samples
    (``DynamicCache.batch_repeat_interleave``), so ``generate`` starts decoding from the cached
    prefix instead of recomputing the prompt n times. Outputs are returned in the original
    (prompt, sample) order.

    Each batch reseeds torch with ``seed + batch number``, so a rerun with the same seed and
    inputs produces the same samples whatever ran before in the process.
    """

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= set([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    def batches(self, prompts: list[list[int]], n: int, batch_size: int, *, sort_by_length: bool = True,
                share_prefill: bool = True) -> list[list[tuple[int, int]]]:
        """The batches ``generate`` runs: lists of (prompt index, sample index); with
        ``share_prefill`` a batch holds whole groups (max(1, batch_size // n) prompts). A
        function of the prompt lengths only, so workers given the same prompts agree on it."""
        order = sorted(range(len(prompts)), key=lambda p: len(prompts[p])) if sort_by_length else list(range(len(prompts)))
        if share_prefill:
            per = max(1, batch_size // n)
            return [[(p, k) for p in order[i:i + per] for k in range(n)] for i in range(0, len(order), per)]
        requests = [(p, k) for p in order for k in range(n)]
        return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int):
        """KV cache of every prompt but its last token, computed once per prompt and repeated n
        times (rows u*n .. u*n+n-1 are prompt u). Position ids follow generate's rule
        (cumsum of the mask - 1), so the cached prefix equals what generate would compute."""
        ids, mask = input_ids[::n, :-1], attention_mask[::n, :-1]
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        cache = out.past_key_values
        if n > 1:
            cache.batch_repeat_interleave(n)
        return cache

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: dict, *, max_new_tokens: int,
                  temperature: float) -> tuple:
        """``model.generate`` with ``sampling``; returns (output, (B, N) float32 log-probs of the N
        new tokens under raw logits / temperature), scored step by step by ``StepLogprobs``. A
        model that is not an ``nn.Module`` (a generate-only stand-in, no forward hooks) is asked
        for ``output_logits`` instead, scored one (B, V) step at a time."""
        recorder = StepLogprobs(temperature) if isinstance(self.model, torch.nn.Module) else None
        handle = self.model.register_forward_hook(recorder, with_kwargs=True) if recorder is not None else None
        try:
            gen = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                **sampling,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=sorted(self.eos_ids),
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=recorder is None,
            )
        finally:
            if handle is not None:
                handle.remove()
        new_tokens = gen.sequences[:, input_ids.shape[1]:]
        if recorder is not None:
            return gen, recorder.result(new_tokens)
        if not gen.logits:
            return gen, torch.zeros(new_tokens.shape[0], 0)
        return gen, torch.stack([
            (logits.float() / temperature).log_softmax(-1).gather(-1, new_tokens[:, j:j + 1]).squeeze(-1)
            for j, logits in enumerate(gen.logits)], dim=1).cpu()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n_samples_per_prompt: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 32,
        seed: int = 0,
        first_token_temperature: float | None = None,
        sort_by_length: bool = True,
        share_prefill: bool = True,
        progress=None,
        only_batches: set[int] | None = None,
        images: list[list[bytes]] | None = None,
        processor=None,
    ) -> list[Generation]:
        """Sample ``n_samples_per_prompt`` responses for each prompt.

        Args:
            prompts: token ids of each prompt (chat template applied, no padding).
            batch_size: sequences generated at once (with ``share_prefill``, rounded to whole
                groups, at least one group).
            first_token_temperature: FIRE sampling: the first token is sampled at this
                temperature, the rest at ``temperature``; top-p applies to both. The returned
                log-probs are the policy's at ``temperature`` for every token (what the actor
                stage computes), not the first token's sampling distribution.
            sort_by_length, share_prefill: the speed-ups above (both off: the plain batching
                of the first version, kept for benchmarks and debugging).
            progress: optional callable(done, total) after each batch (sequences).
            only_batches: generate only these batches (indices into ``batches(...)``), each with
                its own seed as in a full run: how a rollout is split over workers whose outputs
                together equal the single-worker rollout.
            images, processor: a vision-language policy's prompt images (encoded bytes, one list
                per prompt, [] for text-only) and its ``rft_core.models.vl.VLProcessor``: each
                batch gets ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` of its
                rows, and the shared prefill is skipped (the model computes its M-RoPE positions).
        Returns:
            len(prompts) * n_samples_per_prompt generations (those of ``only_batches``), grouped
            by prompt in input order.
        """
        n = n_samples_per_prompt
        if images is not None and (processor is None or len(images) != len(prompts)):
            raise ValueError(f"images need a processor and one list per prompt: {len(images)} lists for {len(prompts)} prompts")
        params = getattr(self.model, "parameters", None)
        device = next(params()).device if params is not None else torch.device("cpu")
        batches = self.batches(prompts, n, batch_size, sort_by_length=sort_by_length, share_prefill=share_prefill)
        todo = [b for b in range(len(batches)) if only_batches is None or b in only_batches]
        total = sum(len(batches[b]) for b in todo)
        results: dict[tuple[int, int], Generation] = {}
        done = 0
        for b in todo:
            chunk = batches[b]
            rows = [torch.tensor(prompts[p], dtype=torch.long) for p, _ in chunk]
            input_ids = zero_pad_sequences(rows, side="left", value=self.pad_token_id).to(device)
            attention_mask = zero_pad_sequences([torch.ones(len(r), dtype=torch.long) for r in rows], side="left").to(device)
            P = input_ids.shape[1]
            torch.manual_seed(seed + b)
            sampling: dict = {"temperature": temperature, "top_p": top_p}
            if first_token_temperature is not None:
                from transformers import LogitsProcessorList, TopPLogitsWarper

                procs = [StepTemperature(prompt_len=P, first_token_temperature=first_token_temperature, temperature=temperature)]
                if top_p < 1.0:
                    procs.append(TopPLogitsWarper(top_p))
                sampling = {"temperature": 1.0, "top_p": 1.0, "logits_processor": LogitsProcessorList(procs)}
            if images is not None:
                vision = processor.batch_inputs([images[p] for p, _ in chunk], input_ids.cpu())
                sampling.update({k: v.to(device) for k, v in vision.items()})
            elif share_prefill and P > 1:
                sampling["past_key_values"] = self._prefill(input_ids, attention_mask, n)
            gen, step_lps = self._generate(input_ids, attention_mask, sampling, max_new_tokens=max_new_tokens,
                                           temperature=temperature)
            new_tokens = gen.sequences[:, P:].cpu()
            for row, (p, k) in enumerate(chunk):
                tokens = new_tokens[row].tolist()
                finish = "length"
                for j, t in enumerate(tokens):
                    if t in self.eos_ids:
                        tokens, finish = tokens[: j + 1], "stop"
                        break
                lps = step_lps[row, : len(tokens)].tolist()
                results[(p, k)] = Generation(p, k, tokens, lps, finish)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        return [results[(p, k)] for p in range(len(prompts)) for k in range(n) if (p, k) in results]
