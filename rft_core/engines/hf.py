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


class HFEngine:
    """Generates with ``model.generate`` in micro-batches of left-padded prompts.

    Each micro-batch reseeds torch with ``seed + batch number``, so a rerun with the same seed
    produces the same samples whatever ran before in the process.
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
    ) -> list[Generation]:
        """Sample ``n_samples_per_prompt`` responses for each prompt.

        Args:
            prompts: token ids of each prompt (chat template applied, no padding).
            first_token_temperature: FIRE sampling: the first token is sampled at this
                temperature, the rest at ``temperature``; top-p applies to both. The returned
                log-probs are the policy's at ``temperature`` for every token (what the actor
                stage computes), not the first token's sampling distribution.
        Returns:
            len(prompts) * n_samples_per_prompt generations, grouped by prompt in input order.
        """
        requests = [(p, k) for p in range(len(prompts)) for k in range(n_samples_per_prompt)]
        out: list[Generation] = []
        for b, start in enumerate(range(0, len(requests), batch_size)):
            chunk = requests[start:start + batch_size]
            rows = [torch.tensor(prompts[p], dtype=torch.long) for p, _ in chunk]
            input_ids = zero_pad_sequences(rows, side="left", value=self.pad_token_id)
            attention_mask = zero_pad_sequences([torch.ones(len(r), dtype=torch.long) for r in rows], side="left")
            P = input_ids.shape[1]
            torch.manual_seed(seed + b)
            sampling: dict = {"temperature": temperature, "top_p": top_p}
            if first_token_temperature is not None:
                from transformers import LogitsProcessorList, TopPLogitsWarper

                procs = [StepTemperature(prompt_len=P, first_token_temperature=first_token_temperature, temperature=temperature)]
                if top_p < 1.0:
                    procs.append(TopPLogitsWarper(top_p))
                sampling = {"temperature": 1.0, "top_p": 1.0, "logits_processor": LogitsProcessorList(procs)}
            gen = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                **sampling,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=sorted(self.eos_ids),
                return_dict_in_generate=True,
                output_logits=True,
            )
            new_tokens = gen.sequences[:, P:]
            # log p of each sampled token, one (B, V) step at a time: never (B, T, V) at once
            step_lps = torch.stack([
                (logits.float() / temperature).log_softmax(-1).gather(-1, new_tokens[:, j:j + 1]).squeeze(-1)
                for j, logits in enumerate(gen.logits)
            ], dim=1) if gen.logits else torch.zeros(len(chunk), 0)
            for row, (p, k) in enumerate(chunk):
                tokens = new_tokens[row].tolist()
                finish = "length"
                for j, t in enumerate(tokens):
                    if t in self.eos_ids:
                        tokens, finish = tokens[: j + 1], "stop"
                        break
                lps = step_lps[row, : len(tokens)].tolist()
                out.append(Generation(p, k, tokens, lps, finish))
        return out
