"""Continuing sequences from their tokens: the chunks after the first of a partial rollout
(``rollout.partial``; docs/algorithms.md, "Partial rollouts").

Every engine continues a sequence the same way, through its own ``generate``: the prompt and the
response so far, as token ids (never re-tokenised text), are the new prompt of one sample, and the
engine generates at most the chunk's budget of new tokens with the weights it holds now. Nothing
of an engine survives between rollouts (no KV cache, no request handle): what a continuation
needs is in the rollout shard, so a resumed run or a restarted worker continues the same way.

- ``hf`` (``HFEngine.generate``, one sample per prefix): the shared prefill computes the prefix's
  KV cache with the current weights, then the engine's decode loop samples.
- ``vllm`` (``VLLMEngine.generate``): one ``TokensPrompt`` (``{"prompt_token_ids": [...]}``) per
  prefix in one ``LLM.generate``; vLLM's automatic prefix caching (``enable_prefix_caching=True``,
  blocks hashed by their token ids and the tokens before them: vllm ``docs/design/prefix_caching.md``,
  ``vllm/v1/core/kv_cache_utils.py``) serves the prefix blocks already computed for the same
  tokens in this rollout (the samples of one group share their prompt's blocks). The engine resets
  the cache whenever its weights change (``LLM.reset_prefix_cache`` after an in-place reload in
  ``VLLMEngine._ensure_ready`` and after ``receive_weights``), so a prefix is never served from KV
  computed by an older policy.
- ``sglang`` (``SGLangEngine.generate``): ``input_ids`` per request; SGLang's radix cache shares
  prefixes the same way and is flushed after every weight change (``flush_cache`` after
  ``update_weights_from_disk``, ``update_weights_from_tensor(..., flush_cache=True)`` on a sync).

A continuation's prompt plus its budget is never longer than the prompt plus ``max_new_tokens``,
so the engines' context limits (vLLM's and SGLang's ``max_model_len``) bound it as they bound an
unchunked response.

The new tokens are sampled from pi_new(. | prompt, response so far): the continued response is a
sequence whose tokens come from several policies, each recorded with its version and its
behaviour log-prob (``rollout_logprobs``) by the rollout stage. FIRE's first-token temperature
does not apply: a continuation's first token is not the response's first.
"""
from __future__ import annotations

from rft_core.engines.hf import Generation

# the prefixes with b tokens of budget left are one generate call seeded seed + BUDGET_STRIDE * b
BUDGET_STRIDE = 1_000_003


def continue_sequences(engine, prefixes: list[list[int]], budgets: list[int], *, temperature: float, top_p: float,
                       batch_size: int, seed: int, progress=None) -> list[Generation]:
    """Continue each prefix (prompt + response so far) by at most its budget of new tokens with
    ``engine`` (``HFEngine``, ``VLLMEngine`` or ``SGLangEngine``, same contract).

    Seeding (what makes a continuation reproducible): the prefixes with budget b form one
    ``engine.generate(..., n_samples_per_prompt=1, max_new_tokens=b, seed=seed + BUDGET_STRIDE * b)``
    call, in their order here; the engine then seeds as it always does (hf: its batch k, prefixes
    sorted by length, from a ``torch.Generator`` seeded ``seed + BUDGET_STRIDE * b + k``; vLLM and
    SGLang: prefix i of the call with ``sample_seed(seed + BUDGET_STRIDE * b, i, 0, 1)``). So the
    tokens are a function of (prefixes, budgets, seed, weights, sampling settings) only.

    Args:
        prefixes: token ids of each sequence so far (prompt then response), non-empty.
        budgets: new tokens allowed per prefix (>= 1).
        temperature, top_p: as ``rollout.temperature`` / ``rollout.top_p`` (no FIRE).
        batch_size: the engine's batch size.
        progress: the engine's progress callable (per call).
    Returns:
        one ``Generation`` per prefix in input order (``prompt_index`` = its index in
        ``prefixes``, ``sample_index`` 0): the new tokens (up to and including a first EOS), their
        log-probs under the distribution each was sampled from, "stop" or "length".
    Raises:
        ValueError: ``budgets`` and ``prefixes`` differ in length, or a budget below 1.
        RuntimeError: the engine returned no generation for a prefix (or its own errors).
    """
    if len(budgets) != len(prefixes):
        raise ValueError(f"continue_sequences: {len(prefixes)} prefixes but {len(budgets)} budgets")
    if any(b < 1 for b in budgets):
        raise ValueError(f"continue_sequences: every budget must be >= 1, got {min(budgets)}")
    out: list[Generation | None] = [None] * len(prefixes)
    for budget in sorted(set(budgets)):
        idx = [i for i, b in enumerate(budgets) if b == budget]
        gens = engine.generate([prefixes[i] for i in idx], n_samples_per_prompt=1, max_new_tokens=budget,
                               temperature=temperature, top_p=top_p, batch_size=batch_size,
                               seed=seed + BUDGET_STRIDE * budget, first_token_temperature=None, progress=progress)
        for g in gens:
            i = idx[g.prompt_index]
            out[i] = Generation(i, 0, g.response_token_ids, g.logprobs, g.finish_reason)
    missing = [i for i, g in enumerate(out) if g is None]
    if missing:
        raise RuntimeError(f"continue_sequences: the engine returned no generation for prefixes {missing[:5]}")
    return [g for g in out if g is not None]
