"""Per-token log-probs of response tokens, computed without a full-vocab pass over the batch.

Layout (as in OpenRLHF/LightRFT): each row is [left-padded prompt | response, right-padded], so
all responses start at the same column P and the T response tokens are the last T columns.
Position ids are cumsum(attention_mask) - 1, so left padding does not shift positions (what HF
``generate`` does too). Only the last T+1 positions' logits are materialised
(``logits_to_keep``), in micro-batches, and log p(token) = logit[token] - logsumexp(logits).

Packed layout (``build_packed_batch``): the sequences of a micro-batch are concatenated into one
row without padding, position ids restarting at 0 for each sequence and no attention mask, so
transformers builds attention that never crosses sequences (a block-diagonal causal mask for
sdpa/eager, varlen kernels for flash-attention 2); only the logits of the positions that
predict response tokens are computed (``logits_to_keep`` as an index tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
        model_inputs: extra forward inputs of a vision-language model (``with_vision``); with
            them the model computes its own (M-RoPE) positions and ``position_ids`` is unused.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor
    model_inputs: dict = field(default_factory=dict)  # VL: pixel_values, image_grid_thw, mm_token_type_ids

    @property
    def num_actions(self) -> int:
        """T, the padded response length."""
        return self.action_mask.shape[1]


def _check_pairs(prompts: list[list[int]], responses: list[list[int]]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt in batch")


def build_token_batch(prompts: list[list[int]], responses: list[list[int]], *, pad_token_id: int) -> TokenBatch:
    """Left-pad prompts, right-pad responses, concatenate.

    Raises:
        ValueError: lists of different lengths or an empty prompt.
    """
    _check_pairs(prompts, responses)
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
    batch: "TokenBatch | PackedBatch",
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of the response tokens, in one forward pass.

    Args:
        model: a causal LM whose forward accepts ``logits_to_keep``.
        batch: see ``build_token_batch`` (or ``build_packed_batch``); all of it goes through one
            forward pass, so keep it small (the caller micro-batches).
        temperature: logits are divided by it (the sampling temperature of the rollout).
    Returns:
        (logprobs, entropy): (B, T) float32 each (entropy None unless asked); values at
        positions where action_mask is False are meaningless but finite.
    """
    if isinstance(batch, PackedBatch):
        return packed_response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy)
    T = batch.num_actions
    device = model_device(model)
    if batch.model_inputs:  # VL: the model derives its 3-D positions from the mask and the image grid
        extra = {k: v.to(device) for k, v in batch.model_inputs.items()}
    else:
        extra = {"position_ids": batch.position_ids.to(device)}
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                logits_to_keep=T + 1, use_cache=False, **extra)
    logits = out.logits[:, :-1, :].float()  # logits at column j predict the token at column j+1
    return _token_logprobs(logits, batch.input_ids[:, -T:].to(device), temperature=temperature, with_entropy=with_entropy)


def default_device() -> torch.device:
    """Where the stage programs put their models: ``$RFT_DEVICE`` if set, else the GPU of this
    rank (``cuda:$LOCAL_RANK``) when CUDA is available, else the CPU."""
    import os

    if os.environ.get("RFT_DEVICE"):
        return torch.device(os.environ["RFT_DEVICE"])
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return torch.device("cpu")


def with_vision(batch: TokenBatch, processor, images: list[list[bytes]]) -> TokenBatch:
    """``batch`` with the vision inputs of its rows' images (one list per row, in row order).

    Raises:
        ValueError: a packed batch (vision inputs need the padded layout).
        rft_core.models.vl.VLError: a row's image tokens do not match its images.
    """
    if not isinstance(batch, TokenBatch):
        raise ValueError("sample packing is not supported for vision-language models; set packing: false")
    batch.model_inputs = processor.batch_inputs(images, batch.input_ids)
    return batch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (where its inputs must go)."""
    return next(model.parameters()).device


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) = logit[target] / temp - logsumexp(logits / temp) and, if asked, the entropy
    H = logsumexp - sum(p * logits) of the same distribution; shapes (..., V) -> (...)."""
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logprobs, entropy


@dataclass
class PackedBatch:
    """A micro-batch packed into one row, without padding.

    Attributes:
        input_ids: (1, N) int64, N = sum of len(prompt) + len(response) over the batch.
        position_ids: (1, N) int64, 0..L_i-1 within each sequence i.
        logit_index: (M,) int64, M = total response tokens: the position whose logits predict
            each response token, in sample order then token order.
        target_ids: (M,) int64, the response tokens themselves.
        action_mask: (B, T) bool, True on real response tokens (T = longest response, >= 1),
            the same as ``build_token_batch``'s.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    target_ids: torch.Tensor
    action_mask: torch.Tensor

    @property
    def num_actions(self) -> int:
        """T, the padded response length of the (B, T) outputs."""
        return self.action_mask.shape[1]


def build_packed_batch(prompts: list[list[int]], responses: list[list[int]]) -> PackedBatch:
    """Concatenate [prompt_i | response_i] for every i into one row (see ``PackedBatch``).

    Raises:
        ValueError: lists of different lengths or an empty prompt.
    """
    _check_pairs(prompts, responses)
    ids: list[int] = []
    pos: list[int] = []
    index: list[int] = []
    for p, r in zip(prompts, responses):
        start = len(ids) + len(p)  # column of the first response token
        index.extend(range(start - 1, start - 1 + len(r)))
        ids.extend(p)
        ids.extend(r)
        pos.extend(range(len(p) + len(r)))
    T = max([len(r) for r in responses] + [1])
    mask = torch.zeros(len(responses), T, dtype=torch.bool)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = True
    return PackedBatch(torch.tensor([ids], dtype=torch.long), torch.tensor([pos], dtype=torch.long),
                       torch.tensor(index, dtype=torch.long), torch.tensor([t for r in responses for t in r], dtype=torch.long),
                       mask)


def packed_response_logprobs(model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0,
                             with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` for a packed batch: same (B, T) float32 outputs (zero where
    action_mask is False), differentiable."""
    device = model_device(model)
    mask = batch.action_mask.to(device)
    B, T = mask.shape
    if batch.logit_index.numel() == 0:  # no response token at all
        zeros = torch.zeros(B, T, device=device)
        return zeros, (zeros.clone() if with_entropy else None)
    out = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), attention_mask=None,
                logits_to_keep=batch.logit_index.to(device), use_cache=False)
    flat_lp, flat_ent = _token_logprobs(out.logits[0].float(), batch.target_ids.to(device), temperature=temperature,
                                        with_entropy=with_entropy)
    logprobs = torch.zeros(B, T, device=device, dtype=flat_lp.dtype).masked_scatter(mask, flat_lp)
    entropy = None
    if flat_ent is not None:
        entropy = torch.zeros(B, T, device=device, dtype=flat_ent.dtype).masked_scatter(mask, flat_ent)
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
    packing: bool = False,
    progress=None,
    images: list[list[bytes]] | None = None,
    processor=None,
) -> list[list[float]] | tuple[list[list[float]], list[list[float]]]:
    """Unpadded per-sample log-prob lists (len = len(response)) for any number of samples.

    Samples are sorted by total length before micro-batching to reduce padding; the output is in
    the input order. With ``with_entropy`` it returns (logprobs, entropies), same layout.
    ``packing``: each micro-batch goes through the model as one packed row (no padding).
    ``progress``: optional callable(done, total) called after each micro-batch (samples).
    ``images``, ``processor``: a vision-language model's per-sample images and its
    ``VLProcessor`` (``with_vision``).
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    result: list[list[float]] = [[] for _ in prompts]
    entropies: list[list[float]] = [[] for _ in prompts]
    for start in range(0, len(order), micro_batch_size):
        idx = order[start:start + micro_batch_size]
        ps, rs = [prompts[i] for i in idx], [responses[i] for i in idx]
        batch = build_packed_batch(ps, rs) if packing else build_token_batch(ps, rs, pad_token_id=pad_token_id)
        if processor is not None:
            batch = with_vision(batch, processor, [images[i] for i in idx])
        lp, ent = response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy)
        lp, ent = lp.cpu(), (ent.cpu() if ent is not None else None)
        for row, i in enumerate(idx):
            result[i] = lp[row, : len(responses[i])].tolist()
            if ent is not None:
                entropies[i] = ent[row, : len(responses[i])].tolist()
        if progress is not None:
            progress(min(start + micro_batch_size, len(order)), len(order))
    return (result, entropies) if with_entropy else result
