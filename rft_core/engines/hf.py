"""The transformers rollout engine (the CPU/default engine), also the greedy decoder of the eval
stage (``HFEngine.generate(..., greedy=True)``): text models decode in the engine's own KV-cache
loop (``HFEngine._decode``), vision-language models (Qwen2-VL / Qwen2.5-VL: images and videos)
through transformers' ``generate``; both draw by inverse CDF (``InverseCDFSampler``)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from schemas.experience import zero_pad_sequences

# Sampling settings passed to every ``generate`` call so that the distribution sampled from is
# exactly the one ``StepLogprobs`` records (temperature, top-p): a model's own
# ``generation_config.json`` (instruct checkpoints often set top_k or repetition_penalty) would
# otherwise fill in the processors the call does not name (transformers ``_prepare_generation_config``
# takes every setting the call leaves unset from the model's generation config).
NEUTRAL_SAMPLING = {"top_k": 0, "repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0}


def cache_keyword(model) -> str:
    """The name under which ``model``'s forward takes its KV cache and its output returns it:
    ``cache`` where the installed transformers renamed it (5.x releases that deprecate
    ``past_key_values``, to be removed in 5.40: ``@deprecate_kwarg("past_key_values", "5.40.0",
    new_name="cache")`` on every ``forward`` in ``transformers/models/*/modeling_*.py``, 5.24), else
    ``past_key_values``. A peft wrapper (``forward(*args, **kwargs)``) is read through its base
    model, to which it passes the keyword on."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    Attributes:
        prompt_index: index of the prompt in the request.
        sample_index: 0..n_samples_per_prompt-1.
        response_token_ids: generated tokens up to and including the first EOS (if any).
        logprobs: float32 log-probs of those tokens under the processed distribution each was
            sampled from (``StepLogprobs``: that step's temperature, the top-p mask,
            renormalised); greedy decoding: under softmax(logits) at temperature 1.
        finish_reason: "stop" (EOS generated) or "length" (max_new_tokens reached).
    """

    prompt_index: int
    sample_index: int
    response_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class InverseCDFSampler:
    """Logits processor that draws each row's next token from the processed distribution by
    inverse-CDF sampling and returns scores that are 0 at the drawn token and -inf elsewhere, so
    ``generate`` with ``do_sample=False`` (greedy argmax) emits exactly that token.

    The processed distribution of step j (0-based) is softmax(``processed_scores``(logits,
    temperature_j, top_p)): temperature_0 = ``first_token_temperature`` (FIRE sampling, Chen et
    al. 2024, arXiv:2410.21236) when given, else ``temperature``; the same scores the engine's
    ``StepLogprobs`` recorder scores the drawn tokens under. Drawing: p = softmax(x) in float32,
    c = cumsum(p) in float64, u ~ U[0, 1) per row (float64, from ``generator``: the batch's own
    ``torch.Generator`` that ``HFEngine.generate`` seeds, never torch's global one), token = the
    first index with c > u * c[-1]. Tokens outside the nucleus have p = 0 (an empty interval)
    and are never drawn.

    Why not ``do_sample=True``: transformers draws with ``torch.multinomial(probs, 1)``, which on
    the CPU fills a (B, V) float tensor with exponential noise every step (about 30 ms for
    32 x 49152 on two cores, 15% of a SmolLM2-135M decode step); one uniform per row and a
    cumulative sum cost about 3 ms. The distribution is the same; the random stream is not, so
    a seed draws other tokens than ``do_sample=True`` did.

    Args:
        prompt_len: columns of the (left-padded) prompt batch; step j sees input_ids of
            prompt_len + j columns.
        temperature: > 0, every step after the first.
        first_token_temperature: FIRE's step-0 temperature (None: ``temperature``).
        top_p: nucleus of every step (1: none).
        generator: where the uniforms come from (None: torch's global generator).
    """

    def __init__(self, *, prompt_len: int, temperature: float, first_token_temperature: float | None = None,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> None:
        self.prompt_len = prompt_len
        self.temperature = float(temperature)
        self.first = float(first_token_temperature) if first_token_temperature is not None else self.temperature
        self.top_p = float(top_p)
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        x = processed_scores(scores, temperature=self.first if step == 0 else self.temperature, top_p=self.top_p)
        tokens = sample_inverse_cdf(torch.softmax(x, dim=-1), generator=self.generator)
        out = torch.full_like(x, float("-inf"))
        return out.scatter_(-1, tokens[:, None], 0.0)


def sample_inverse_cdf(probs: torch.Tensor, *, generator: torch.Generator | None = None,
                       uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` (B, V), non-negative, rows summing to about 1 (any float
    dtype): (B,) int64 indices, row i drawn with probability probs[i, k] / sum(probs[i]).
    Inverse-CDF sampling with a float64 cumulative sum (rounding error about 1e-16 per entry)
    and one uniform per row: ``uniforms`` ((B, 1) float64 in [0, 1)) when given, else drawn
    (``torch.rand``) from ``generator`` (on ``probs``' device; None: torch's global generator).

    Raises:
        ValueError: ``probs`` is not 2-D, or ``uniforms`` is not (B, 1).
    """
    if probs.dim() != 2:
        raise ValueError(f"sample_inverse_cdf: probs must be (B, V), got shape {tuple(probs.shape)}")
    if uniforms is not None and tuple(uniforms.shape) != (probs.shape[0], 1):
        raise ValueError(f"sample_inverse_cdf: uniforms must be ({probs.shape[0]}, 1), got {tuple(uniforms.shape)}")
    # the float64 copy, then the scan in place: the same sequential sums as
    # torch.cumsum(probs, dim=-1, dtype=torch.float64), at about half its time on the CPU
    # (which converts on the fly: 8.6 against 4.6 ms for 64 x 49152, two cores)
    cdf = probs.to(torch.float64, copy=True).cumsum_(dim=-1)
    total = cdf[:, -1:]
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)
    u = uniforms.to(torch.float64) * total
    # strictly below the total, so the first index with cdf > u exists and has probability > 0
    # (u * total may round up to the total)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def processed_scores(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The scores ``generate`` samples from, from one step's raw logits: x = logits (float32,
    copied) / temperature, then tokens outside the top-p nucleus set to -inf.

    ``InverseCDFSampler`` draws from these scores and the ``StepLogprobs`` recorder scores the
    drawn tokens under them, so the kept set is the one the sampler used, ties included (the
    operations of transformers' own sampling path: float32 copy of the last logits,
    ``TemperatureLogitsWarper``, ``TopPLogitsWarper``). softmax(x) is then the processed distribution
    (vLLM's ``logprobs_mode="processed_logprobs"``: after temperature and top-p, renormalised).

    Args:
        logits: (B, V) any float dtype.
        temperature: > 0.
        top_p: in (0, 1]; 1 keeps every token.
    Returns:
        (B, V) float32, -inf outside the nucleus.
    """
    x = logits.detach().to(torch.float32, copy=True)
    if temperature != 1.0:
        x.div_(temperature)  # in place on the copy: the same values as x / temperature, one (B, V) less
    if top_p < 1.0:
        from transformers import TopPLogitsWarper

        x = TopPLogitsWarper(top_p)(None, x)
    return x


class StepLogprobs:
    """Forward hook (``register_forward_hook(..., with_kwargs=True)``) that records, during
    ``generate``, the log-prob of each sampled token under the processed distribution it was
    sampled from: log p(token) = x[token] - logsumexp(x) with x = ``processed_scores`` of the
    step (raw logits / that step's temperature, the top-p mask; renormalised over the kept
    tokens). Step 0 (the first generated token) uses ``first_token_temperature`` when given
    (FIRE), every later step ``temperature``. With top_p = 1 and no FIRE this is
    log_softmax(logits / temperature), what the actor stage computes.

    It keeps one step at a time: the last position's processed scores (B, V) float32 of the
    latest forward pass and their logsumexp. The token sampled from step j is the ``input_ids``
    of forward j+1 (the KV-cache decode step), so each forward first scores the previous step's
    token; ``result`` scores the last one. Memory: one (B, V) float32 row for the pending step
    plus (B,) per generated token, instead of ``output_logits``' (B, V) tensor per step.

    Args:
        temperature: sampling temperature of every step after the first (> 0).
        first_token_temperature: FIRE's temperature of step 0 (None: ``temperature``).
        top_p: the nucleus of every step (1: none).
    """

    def __init__(self, temperature: float, *, first_token_temperature: float | None = None, top_p: float = 1.0) -> None:
        self.temperature = float(temperature)
        self.first = float(first_token_temperature) if first_token_temperature is not None else self.temperature
        self.top_p = float(top_p)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (scores (B, V) float32, lse (B,) float32)
        self.steps: list[torch.Tensor] = []  # (B,) float32 per scored token

    def step_temperature(self, step: int) -> float:
        """The temperature of generated step ``step`` (0-based)."""
        return self.first if step == 0 else self.temperature

    def __call__(self, module, args, kwargs, output) -> None:
        logits = output.logits if hasattr(output, "logits") else output[0]
        if self.pending is not None:
            ids = kwargs.get("input_ids")
            if ids is None and args:
                ids = args[0]
            if ids is None:
                raise RuntimeError("StepLogprobs: a decode step was called without input_ids; cannot score the sampled token")
            self.steps.append(self._score(ids[:, -1]))
        step = len(self.steps)  # forwards scored so far: this forward's logits are generated step `step`
        x = processed_scores(logits[:, -1, :], temperature=self.step_temperature(step), top_p=self.top_p)
        self.pending = (x, torch.logsumexp(x, dim=-1))

    def _score(self, tokens: torch.Tensor) -> torch.Tensor:
        x, lse = self.pending
        return x.gather(-1, tokens[:, None].to(x.device)).squeeze(-1) - lse

    def result(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, N) float32 log-probs of ``new_tokens`` (B, N), the tokens ``generate`` appended.

        The entries after a row's EOS score the padding ``generate`` appends and may be -inf
        (outside the nucleus); ``HFEngine.generate`` drops them.

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


def _check_finite(lps: torch.Tensor, *, row: int | None = None) -> None:
    """Raise when a recorded log-prob (B, N) is -inf: a token outside its step's nucleus, which
    the sampler cannot have drawn (the tokens after a row's EOS are padding and are not checked)."""
    bad = torch.nonzero(~torch.isfinite(lps))
    if bad.numel():
        r, step = (int(v) for v in bad[0])
        row = r if row is None else row
        raise RuntimeError(f"StepLogprobs: the token generated at step {step} of batch row {row} lies outside the "
                           "processed sampling distribution (log-prob -inf): generate sampled from another distribution")


class HFEngine:
    """Generates in batches of left-padded prompts with a KV cache: text models in ``_decode``
    (finished rows leave the batch), vision-language models and generate-only stand-ins with
    ``model.generate``.

    Speed (``benchmarks/rollout_speed.py``): prompts are sorted by length so each batch holds
    prompts of similar length (little left padding), and a batch holds whole groups: each
    prompt's KV cache is computed once (prefill) and repeated for its n samples
    (``DynamicCache.batch_repeat_interleave``), so ``generate`` starts decoding from the cached
    prefix instead of recomputing the prompt n times. Outputs are returned in the original
    (prompt, sample) order.

    Each batch draws from its own ``torch.Generator`` (on the model's device) seeded with
    ``seed + batch number``, so a rerun with the same seed and inputs produces the same samples
    whatever ran before in the process or runs beside it in another thread (the asynchronous
    prefetched rollout shares its process with the update, whose LoRA dropout and gradient
    checkpointing use torch's global generator). The engine never reads or reseeds torch's
    global generator. Each decode step of the KV-cache loop draws one uniform per row of the
    batch, finished rows included, and row r samples with the r-th (``_decode``), so a row's
    samples do not depend on when the other rows of its batch end
    (``tests/rft_core/engines/test_row_invariant_sampling.py``; rollout contract v6: before it,
    a batch whose rows ended at different steps drew other tokens after the first end).
    """

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.cache_name = cache_keyword(model)  # what the forward calls its KV cache
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
        cache = getattr(out, self.cache_name)
        if n > 1:
            cache.batch_repeat_interleave(n)
        return cache

    def _decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache, sampler: "InverseCDFSampler | None",
                *, max_new_tokens: int, on_step=None) -> tuple[list[list[int]], list[list[float]]]:
        """Token-by-token decoding of a text model with a KV cache that drops each row once it has
        emitted an EOS token, so later steps compute only the rows still generating (HF
        ``generate`` keeps every row to the end of the batch, for about 45% of the demo's decode
        steps). ``cache``: the prompts' KV cache without their last token (``_prefill``), or None
        (the whole prompt is the first forward). Positions follow generate's rule (cumsum of the
        mask - 1, then +1 per token), so the logits equal generate's. Step j draws from the
        processed distribution (``processed_scores`` at ``sampler``'s step-j temperature and
        top-p, by ``sample_inverse_cdf``), or takes the argmax of the raw logits when ``sampler``
        is None (greedy, log-probs at temperature 1), and records log p(token) = x[token] -
        logsumexp(x). Returns per row the new tokens (up to and including the first EOS, at most
        ``max_new_tokens``) and their log-probs (float32 values as Python floats). ``on_step``:
        optional callable(new_tokens, finished_rows) after each decode step (progress).

        Every step draws one uniform per row of the batch (B of them, for finished rows too) and
        row r samples with the r-th: a row's tokens depend on its own logits and uniforms only,
        so a row that ends earlier or later in another run (a token changed by float rounding,
        say after an update on other ranks) does not shift the other rows' random draws, as it
        did when each step drew one uniform per row still generating (rollout contract v6)."""
        B = input_ids.shape[0]
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        alive = torch.arange(B, device=input_ids.device)
        mask = attention_mask
        pos = mask.long().sum(-1, keepdim=True) - 1  # (B, 1) position of each row's last prompt token
        if cache is None:
            ids, position_ids = input_ids, (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        else:
            ids, position_ids = input_ids[:, -1:], pos
        eos = torch.tensor(sorted(self.eos_ids), device=input_ids.device)
        for step in range(max_new_tokens):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                             logits_to_keep=1, **{self.cache_name: cache})
            cache, logits = getattr(out, self.cache_name), out.logits[:, -1, :]
            if sampler is None:
                x = logits.detach().to(torch.float32, copy=True)
                tok = x.argmax(-1)
            else:
                x = processed_scores(logits, temperature=sampler.first if step == 0 else sampler.temperature,
                                     top_p=sampler.top_p)
                # a uniform for every row of the batch, finished or not, each row taking its own:
                # row r's token at step j depends on U[j, r] only, never on when other rows ended
                u = torch.rand(B, 1, dtype=torch.float64, device=x.device, generator=sampler.generator)
                tok = sample_inverse_cdf(torch.softmax(x, dim=-1), uniforms=u[alive])
            lp = (x.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)).tolist()
            for r, t, v in zip(alive.tolist(), tok.tolist(), lp):
                tokens[r].append(t)
                logprobs[r].append(v)
            keep = ~torch.isin(tok, eos)
            if on_step is not None:
                on_step(len(lp), B - int(keep.sum()) if step + 1 < max_new_tokens else B)
            if step + 1 == max_new_tokens or not bool(keep.any()):
                break
            if not bool(keep.all()):
                idx = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                alive, tok, mask, pos = alive[idx], tok[idx], mask[idx], pos[idx]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            pos = pos + 1
            ids, position_ids = tok[:, None], pos
        return tokens, logprobs

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: dict, *, max_new_tokens: int,
                  recorder: StepLogprobs) -> tuple:
        """``model.generate`` with ``sampling``; returns (output, (B, N) float32 log-probs of the N
        new tokens under each step's processed distribution), scored step by step by ``recorder``
        (a forward hook). A model that is not an ``nn.Module`` (a generate-only stand-in, no
        forward hooks) is asked for ``output_logits`` (raw logits) instead, which are processed
        and scored one (B, V) step at a time the same way."""
        hooked = isinstance(self.model, torch.nn.Module)
        handle = self.model.register_forward_hook(recorder, with_kwargs=True) if hooked else None
        try:
            gen = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **{**NEUTRAL_SAMPLING, **sampling},
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=sorted(self.eos_ids),
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=not hooked,
            )
        finally:
            if handle is not None:
                handle.remove()
        new_tokens = gen.sequences[:, input_ids.shape[1]:]
        if hooked:
            return gen, recorder.result(new_tokens)
        if not gen.logits:
            return gen, torch.zeros(new_tokens.shape[0], 0)
        steps = []
        for j, logits in enumerate(gen.logits):
            x = processed_scores(logits, temperature=recorder.step_temperature(j), top_p=recorder.top_p)
            steps.append(x.gather(-1, new_tokens[:, j:j + 1].to(x.device)).squeeze(-1) - torch.logsumexp(x, dim=-1))
        return gen, torch.stack(steps, dim=1).cpu()

    def _generate_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: dict, *,
                       max_new_tokens: int, recorder: StepLogprobs) -> tuple[list[list[int]], list[list[float]]]:
        """``_generate``'s output per row as ``_decode`` returns it: the new tokens up to and
        including the first EOS, and their log-probs (the padding after EOS dropped unchecked:
        it may lie outside the nucleus)."""
        gen, step_lps = self._generate(input_ids, attention_mask, sampling, max_new_tokens=max_new_tokens,
                                       recorder=recorder)
        toks, lps = [], []
        for row, tokens in enumerate(gen.sequences[:, input_ids.shape[1]:].cpu().tolist()):
            end = next((j + 1 for j, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
            toks.append(tokens[:end])
            lps.append(step_lps[row, :end].tolist())
        return toks, lps

    def _sampling(self, *, prompt_len: int, temperature: float, top_p: float, first_token_temperature: float | None,
                  greedy: bool, generator: torch.Generator | None = None) -> tuple[dict, StepLogprobs]:
        """The ``generate`` settings of one batch and the recorder of the distribution they sample:
        greedy argmax, or draws from the processed distribution by ``InverseCDFSampler`` (its
        uniforms from ``generator``)."""
        if greedy:
            return {"do_sample": False}, StepLogprobs(1.0)
        recorder = StepLogprobs(temperature, first_token_temperature=first_token_temperature, top_p=top_p)
        from transformers import LogitsProcessorList

        sampler = InverseCDFSampler(prompt_len=prompt_len, temperature=temperature,
                                    first_token_temperature=first_token_temperature, top_p=top_p, generator=generator)
        return {"do_sample": False, "temperature": 1.0, "top_p": 1.0,
                "logits_processor": LogitsProcessorList([sampler])}, recorder

    def _vision(self, chunk: list[tuple[int, int]], input_ids: torch.Tensor, device, images, videos, processor) -> dict:
        """The VL model inputs of a batch's rows (``VLProcessor.batch_inputs``), on ``device``."""
        per_row = lambda media: None if media is None else [media[p] for p, _ in chunk]  # noqa: E731
        vision = processor.batch_inputs(per_row(images) or [[] for _ in chunk], input_ids.cpu(), per_row(videos))
        return {k: v.to(device) for k, v in vision.items()}

    def _generate_batch(self, chunk: list[tuple[int, int]], rows: list[list[int]], *, device: torch.device, seed: int,
                        n: int, max_new_tokens: int, temperature: float, top_p: float,
                        first_token_temperature: float | None, greedy: bool, share_prefill: bool,
                        media: tuple | None, on_step) -> list[Generation]:
        """One batch of ``generate`` (its arguments): ``chunk``'s (prompt index, sample index)
        rows with prompt token ids ``rows``, left-padded on ``device``, drawn with the batch's own
        generator seeded with ``seed``; decoded by the engine's KV-cache loop (``_decode``: a text
        ``nn.Module``) or by transformers' ``generate`` (``_generate_rows``: a vision-language
        batch, ``media`` = (images, videos, processor), or a generate-only stand-in). One
        Generation per row, in ``chunk``'s order.

        Raises:
            RuntimeError: a generated token outside its step's processed distribution.
        """
        ids = [torch.tensor(r, dtype=torch.long) for r in rows]
        input_ids = zero_pad_sequences(ids, side="left", value=self.pad_token_id).to(device)
        attention_mask = zero_pad_sequences([torch.ones(len(r), dtype=torch.long) for r in ids], side="left").to(device)
        P = input_ids.shape[1]
        generator = torch.Generator(device=device).manual_seed(seed)
        if media is None and isinstance(self.model, torch.nn.Module):
            cache = self._prefill(input_ids, attention_mask, n) if share_prefill and P > 1 else None
            sampler = None if greedy else InverseCDFSampler(prompt_len=P, temperature=temperature, top_p=top_p,
                                                            first_token_temperature=first_token_temperature,
                                                            generator=generator)
            toks, lps_rows = self._decode(input_ids, attention_mask, cache, sampler, max_new_tokens=max_new_tokens,
                                          on_step=on_step)
        else:
            sampling, recorder = self._sampling(prompt_len=P, temperature=temperature, top_p=top_p,
                                                first_token_temperature=first_token_temperature, greedy=greedy,
                                                generator=generator)
            if media is not None:
                sampling.update(self._vision(chunk, input_ids, device, *media))
            elif share_prefill and P > 1:
                sampling[self.cache_name] = self._prefill(input_ids, attention_mask, n)
            toks, lps_rows = self._generate_rows(input_ids, attention_mask, sampling, max_new_tokens=max_new_tokens,
                                                 recorder=recorder)
        generations = []
        for row, (p, k) in enumerate(chunk):
            finish = "stop" if toks[row] and toks[row][-1] in self.eos_ids else "length"
            _check_finite(torch.tensor([lps_rows[row]], dtype=torch.float32), row=row)
            generations.append(Generation(p, k, toks[row], lps_rows[row], finish))
        return generations

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
        videos: list[list[bytes]] | None = None,
        processor=None,
        greedy: bool = False,
    ) -> list[Generation]:
        """Sample ``n_samples_per_prompt`` responses for each prompt.

        Args:
            prompts: token ids of each prompt (chat template applied, no padding).
            batch_size: sequences generated at once (with ``share_prefill``, rounded to whole
                groups, at least one group).
            top_p: nucleus sampling; the returned log-probs are under the renormalised nucleus.
            first_token_temperature: FIRE sampling: the first token is sampled at this
                temperature, the rest at ``temperature``; top-p applies to both. The returned
                log-probs are each token's under the distribution it was sampled from (the first
                token's at ``first_token_temperature``), i.e. the behaviour policy's.
            sort_by_length, share_prefill: the speed-ups above (both off: the plain batching
                of the first version, kept for benchmarks and debugging).
            progress: optional callable(done, total, tokens) after each batch and each decode
                step (sequences finished, tokens generated so far).
            only_batches: generate only these batches (indices into ``batches(...)``), each with
                its own seed as in a full run: how a rollout is split over workers whose outputs
                together equal the single-worker rollout.
            images, videos, processor: a vision-language policy's prompt images and videos
                (encoded bytes, one list per prompt, [] for none; either may be None) and its
                ``rft_core.models.vl.VLProcessor``: each batch gets ``pixel_values`` /
                ``image_grid_thw``, ``pixel_values_videos`` / ``video_grid_thw`` (and
                ``second_per_grid_ts`` for Qwen2.5-VL) and ``mm_token_type_ids`` of its rows,
                and the shared prefill is skipped (the model computes its M-RoPE positions).
            greedy: argmax decoding (the eval stage): ``temperature``, ``top_p``, FIRE and the
                seed play no part, and the log-probs are under softmax(logits) at temperature 1.
        Returns:
            len(prompts) * n_samples_per_prompt generations (those of ``only_batches``), grouped
            by prompt in input order.
        Raises:
            ValueError: images or videos without a processor, or not one list per prompt.
            RuntimeError: a generated token outside its step's processed distribution.
            rft_core.models.vl.VLError / rft_core.data.video.VideoError: a row's media do not
                match its tokens, or a video does not decode (named by batch row).
        """
        n = n_samples_per_prompt
        for what, media in (("images", images), ("videos", videos)):
            if media is not None and (processor is None or len(media) != len(prompts)):
                raise ValueError(f"{what} need a processor and one list per prompt: "
                                 f"{len(media)} lists for {len(prompts)} prompts")
        vl = processor is not None and (images is not None or videos is not None)
        params = getattr(self.model, "parameters", None)
        device = next(params()).device if params is not None else torch.device("cpu")
        batches = self.batches(prompts, n, batch_size, sort_by_length=sort_by_length, share_prefill=share_prefill)
        todo = [b for b in range(len(batches)) if only_batches is None or b in only_batches]
        total = sum(len(batches[b]) for b in todo)
        results: dict[tuple[int, int], Generation] = {}
        done, generated, finished_tokens = 0, 0, 0

        def on_step(new_tokens: int, finished_rows: int) -> None:
            nonlocal generated
            generated += new_tokens
            if progress is not None:
                progress(done + finished_rows, total, generated)

        for b in todo:
            chunk = batches[b]
            generations = self._generate_batch(
                chunk, [prompts[p] for p, _ in chunk], device=device, seed=seed + b, n=n, max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, first_token_temperature=first_token_temperature, greedy=greedy,
                share_prefill=share_prefill, media=(images, videos, processor) if vl else None, on_step=on_step)
            results.update({(g.prompt_index, g.sample_index): g for g in generations})
            done += len(chunk)
            # the decode steps' count, also where generate ran instead
            finished_tokens += sum(len(g.response_token_ids) for g in generations)
            generated = finished_tokens
            if progress is not None:
                progress(done, total, generated)
        return [results[(p, k)] for p in range(len(prompts)) for k in range(n) if (p, k) in results]
