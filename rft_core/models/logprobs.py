"""Per-token log-probs of response tokens, computed without a full-vocab pass over the batch.

Layout (as in OpenRLHF/LightRFT): each row is [left-padded prompt | response, right-padded], so
all responses start at the same column P and the T response tokens are the last T columns.
Position ids are cumsum(attention_mask) - 1, so left padding does not shift positions (what HF
``generate`` does too). Only the last T+1 positions' logits are materialised
(``logits_to_keep``), in micro-batches, and log p(token) = logit[token] - logsumexp(logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.experience import zero_pad_sequences


@dataclass
class TokenBatch:
    """Padded model inputs for a batch of (prompt, response) pairs.

    Attributes:
        input_ids: (B, P+T) int64.
        attention_mask: (B, P+T) int64, 1 on real tokens.
        position_ids: (B, P+T) int64.
        action_mask: (B, T) bool, True on real response tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor

    @property
    def num_actions(self) -> int:
        """T, the padded response length."""
        return self.action_mask.shape[1]


def build_token_batch(prompts: list[list[int]], responses: list[list[int]], *, pad_token_id: int) -> TokenBatch:
    """Left-pad prompts, right-pad responses, concatenate.

    Raises:
        ValueError: lists of different lengths or an empty prompt.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt in batch")
    p_ids = zero_pad_sequences([torch.tensor(p, dtype=torch.long) for p in prompts], side="left", value=pad_token_id)
    p_mask = zero_pad_sequences([torch.ones(len(p), dtype=torch.long) for p in prompts], side="left")
    # a response of length 0 still gets one padded column so T >= 1
    r_ids = zero_pad_sequences([torch.tensor(r, dtype=torch.long) for r in responses], side="right", value=pad_token_id,
                               min_length=1)
    r_mask = zero_pad_sequences([torch.ones(len(r), dtype=torch.long) for r in responses], side="right", min_length=1)
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(torch.cat([p_ids, r_ids], dim=1), attention_mask, position_ids, r_mask.bool())


def response_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of the response tokens, in one forward pass.

    Args:
        model: a causal LM whose forward accepts ``logits_to_keep``.
        batch: see ``build_token_batch``; all of it goes through one forward pass, so keep it
            small (the caller micro-batches).
        temperature: logits are divided by it (the sampling temperature of the rollout).
    Returns:
        (logprobs, entropy): (B, T) float32 each (entropy None unless asked); values at
        positions where action_mask is False are meaningless but finite.
    """
    T = batch.num_actions
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=T + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float()  # logits at column j predict the token at column j+1
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.input_ids[:, -T:]
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logprobs, entropy


@torch.no_grad()
def batched_response_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_token_id: int,
    micro_batch_size: int = 8,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> list[list[float]] | tuple[list[list[float]], list[list[float]]]:
    """Unpadded per-sample log-prob lists (len = len(response)) for any number of samples.

    Samples are sorted by total length before micro-batching to reduce padding; the output is in
    the input order. With ``with_entropy`` it returns (logprobs, entropies), same layout.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    result: list[list[float]] = [[] for _ in prompts]
    entropies: list[list[float]] = [[] for _ in prompts]
    for start in range(0, len(order), micro_batch_size):
        idx = order[start:start + micro_batch_size]
        batch = build_token_batch([prompts[i] for i in idx], [responses[i] for i in idx], pad_token_id=pad_token_id)
        lp, ent = response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy)
        for row, i in enumerate(idx):
            result[i] = lp[row, : len(responses[i])].tolist()
            if ent is not None:
                entropies[i] = ent[row, : len(responses[i])].tolist()
    return (result, entropies) if with_entropy else result
