"""Per-token log-probs of response tokens, computed without a full-vocab pass over the batch.

Layout (as in OpenRLHF/LightRFT): each row is [left-padded prompt | response, right-padded], so
all responses start at the same column P and the T response tokens are the last T columns.
Position ids are cumsum(attention_mask) - 1, so left padding does not shift positions (what HF
``generate`` does too). Only the last T+1 positions' logits are materialised
(``logits_to_keep``), in micro-batches, and log p(token) = logit[token] - logsumexp(logits).

Memory: the (B, T+1, V) logits stay in the model's dtype (bfloat16 on a GPU); ``token_logprobs``
reads them ``chunk_size`` positions at a time, so the float32 temporaries are (chunk, V), never
(B, T, V), in the forward pass and in the backward pass (a custom autograd function recomputes
each chunk's softmax from the saved logits and the per-position logsumexp).

Packed layout (``build_packed_batch``): the sequences of a micro-batch are concatenated into one
row without padding, position ids restarting at 0 for each sequence and no attention mask, so
transformers builds attention that never crosses sequences (a block-diagonal causal mask for
sdpa/eager, varlen kernels for flash-attention 2); only the logits of the positions that
predict response tokens are computed (``logits_to_keep`` as an index tensor).

Vision-language models (Qwen2-VL / Qwen2.5-VL) take both layouts. Padded: the model computes its
3-D M-RoPE positions itself from the attention mask and the image / video grids. Packed: the
vision inputs of every sequence go in row order, and the positions are built per sequence with
the model's own ``get_rope_index`` (each sequence's tokens and grids, as if alone) and passed as
the (4, 1, N) ``position_ids`` transformers' Qwen2-VL takes for packed rows: the restarting 1-D
text positions first (they delimit the sequences in the attention mask), then the temporal /
height / width rows (``mrope_packed_position_ids``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rft_core.heap import collect_all
from schemas.experience import zero_pad_sequences

CHUNK_BYTES = 64 * 2**20  # float32 bytes of one (chunk, V) temporary when chunk_size is None


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
    model_inputs: dict = field(default_factory=dict)  # VL: pixel_values(_videos), image/video_grid_thw, mm_token_type_ids

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
    batch: TokenBatch | PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Log-probs (and optionally entropies and sum_v pi(v)^2) of the response tokens, in one forward pass.

    Args:
        model: a causal LM whose forward accepts ``logits_to_keep``.
        batch: see ``build_token_batch`` (or ``build_packed_batch``); all of it goes through one
            forward pass, so keep it small (the caller micro-batches).
        temperature: logits are divided by it (the sampling temperature of the rollout).
        chunk_size: positions per chunk of ``token_logprobs`` (None: ``default_chunk_size``).
        with_sum_pi_squared: also sum_v softmax(logits / temperature)_v^2 at each response token
            (``token_logprobs``), as a third element.
    Returns:
        (logprobs, entropy), or (logprobs, entropy, sum_pi_squared) with ``with_sum_pi_squared``:
        (B, T) float32 each (entropy None unless asked); logprobs and entropy differentiable
        w.r.t. the model's parameters, sum_pi_squared not; values at positions where
        action_mask is False are meaningless but finite.
    """
    if isinstance(batch, PackedBatch):
        return packed_response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy,
                                        chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
    T = batch.num_actions
    device = model_device(model)
    if batch.model_inputs:  # VL: the model derives its 3-D positions from the mask and the image grid
        extra = {k: v.to(device) for k, v in batch.model_inputs.items()}
    else:
        extra = {"position_ids": batch.position_ids.to(device)}
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                logits_to_keep=T + 1, use_cache=False, **extra)
    # logits at column j predict the token at column j+1; the last column predicts nothing (target 0,
    # result dropped), which keeps the (B, T+1, V) logits a contiguous view instead of a sliced copy
    targets = torch.zeros(batch.input_ids.shape[0], T + 1, dtype=torch.long, device=device)
    targets[:, :T] = batch.input_ids[:, -T:].to(device)
    res = token_logprobs(out.logits, targets, temperature=temperature, with_entropy=with_entropy,
                         chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
    lp, ent = res[0], res[1]
    got = lp[:, :T].contiguous(), (ent[:, :T].contiguous() if ent is not None else None)
    return (*got, res[2][:, :T].contiguous()) if with_sum_pi_squared else got


def default_device() -> torch.device:
    """Where the stage programs put their models: ``$RFT_DEVICE`` if set, else the GPU of this
    rank (``cuda:$LOCAL_RANK``) when CUDA is available, else the CPU."""
    import os

    if os.environ.get("RFT_DEVICE"):
        return torch.device(os.environ["RFT_DEVICE"])
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


def with_vision(batch: TokenBatch | PackedBatch, processor, images: list[list[bytes]] | None,
                videos: list[list[bytes]] | None = None) -> TokenBatch | PackedBatch:
    """``batch`` with the vision inputs of its samples' images and videos (one list per sample,
    in sample order; None: no sample has any of that kind): ``VLProcessor.batch_inputs`` of the
    padded rows, or of the one packed row with every sample's media in sample order (and the
    per-sample counts the packed positions need, ``PackedBatch.media_counts``).

    Raises:
        ValueError: not one media list per sample.
        rft_core.models.vl.VLError: a row's image / video tokens do not match its media.
        rft_core.data.video.VideoError: a video does not decode (named by batch row).
    """
    B = batch.action_mask.shape[0]
    images = images if images is not None else [[] for _ in range(B)]
    if len(images) != B or (videos is not None and len(videos) != B):
        raise ValueError(f"with_vision: {B} samples but {len(images)} image lists and "
                         f"{len(videos) if videos is not None else 'no'} video lists")
    if isinstance(batch, PackedBatch):
        flat_videos = [[v for row in videos for v in row]] if videos is not None else None
        batch.model_inputs = processor.batch_inputs([[im for row in images for im in row]], batch.input_ids, flat_videos)
        batch.media_counts = [(len(images[i]), len(videos[i]) if videos is not None else 0) for i in range(B)]
        return batch
    batch.model_inputs = processor.batch_inputs(images, batch.input_ids, videos)
    return batch


def mrope_packed_position_ids(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """(4, 1, N) int64 position ids of a packed vision-language row: row 0 the 1-D text positions
    (``batch.position_ids``, restarting at 0 per sequence), rows 1..3 the M-RoPE temporal / height
    / width positions of each sequence as the model computes them for that sequence alone
    (``get_rope_index`` of the module that has it: ``Qwen2VLModel`` / ``Qwen2_5_VLModel``; Qwen2-VL,
    arXiv:2409.12191 Sec. 2.1), concatenated. A sequence without images or videos gets 0..L-1 in
    all three rows, as ``get_rope_index`` gives text.

    Raises:
        ValueError: the model has no ``get_rope_index`` (not a Qwen2-VL-style model), or the
            batch has no vision inputs (``with_vision`` not applied).
    """
    rope = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    if rope is None:
        raise ValueError(f"{type(model).__name__} has no get_rope_index: packed vision inputs need a Qwen2-VL-style model")
    if batch.media_counts is None or "mm_token_type_ids" not in batch.model_inputs:
        raise ValueError("mrope_packed_position_ids: the packed batch has no vision inputs (apply with_vision first)")
    inputs, text = batch.model_inputs, batch.position_ids.cpu()
    starts = torch.nonzero(text[0] == 0).flatten().tolist() + [text.shape[1]]
    grids = {"image_grid_thw": inputs.get("image_grid_thw"), "video_grid_thw": inputs.get("video_grid_thw"),
             "second_per_grid_ts": inputs.get("second_per_grid_ts")}
    parts, k_img, k_vid = [], 0, 0
    for (a, b), (n_img, n_vid) in zip(zip(starts[:-1], starts[1:]), batch.media_counts):
        if n_img == 0 and n_vid == 0:
            parts.append(torch.arange(b - a, dtype=torch.long).view(1, 1, -1).expand(3, 1, -1))
            continue
        kw = {"image_grid_thw": grids["image_grid_thw"][k_img:k_img + n_img] if n_img else None,
              "video_grid_thw": grids["video_grid_thw"][k_vid:k_vid + n_vid] if n_vid else None}
        if n_vid and grids["second_per_grid_ts"] is not None:
            kw["second_per_grid_ts"] = grids["second_per_grid_ts"][k_vid:k_vid + n_vid]
        pos, _ = rope.get_rope_index(batch.input_ids[:, a:b].cpu(),
                                     mm_token_type_ids=inputs["mm_token_type_ids"][:, a:b].cpu(), **kw)
        parts.append(pos.long().cpu())
        k_img, k_vid = k_img + n_img, k_vid + n_vid
    return torch.cat([text.view(1, 1, -1), torch.cat(parts, dim=-1)], dim=0)


def packed_model_inputs(model: torch.nn.Module, batch: PackedBatch, device: torch.device) -> dict:
    """The position ids (1-D, or (4, 1, N) M-RoPE ones with vision inputs) and vision inputs of a
    packed row, on ``device``."""
    if not batch.model_inputs:
        return {"position_ids": batch.position_ids.to(device)}
    return {**{k: v.to(device) for k, v in batch.model_inputs.items()},
            "position_ids": mrope_packed_position_ids(model, batch).to(device)}


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (where its inputs must go); an FSDP2 model's
    (DTensor parameters) is its device mesh's, which is where it computes also when its shards
    sit in CPU memory (``CPUOffloadPolicy``)."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and mesh.device_type != p.device.type:
        return (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
                else torch.device(mesh.device_type))
    return p.device


def release_device_memory() -> bool:
    """Return the CUDA caching allocator's unused blocks to the driver (``torch.cuda.empty_cache``
    after a garbage collection that also reaches a frozen heap, ``rft_core.heap.collect_all``, so
    that dropped models are unreferenced first). A no-op, without
    the garbage collection, when CUDA is unavailable or was never initialised in this process
    (nothing is cached then). Call it after a stage drops its model, so a colocated engine (vLLM's
    startup free-memory check, SGLang) sees the memory as free.

    Returns:
        True if the cache was emptied.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    collect_all()
    torch.cuda.empty_cache()
    return True


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk of ``token_logprobs``: one float32 (chunk, V) temporary is about
    ``CHUNK_BYTES`` (64 MiB: 341 positions for a 49,152-token vocabulary, 110 for 151,936)."""
    return max(1, CHUNK_BYTES // (4 * max(int(vocab_size), 1)))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False, chunk_size: int | None = None, with_sum_pi_squared: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """log p(target), the entropy of softmax(logits / temperature) and sum_v p_v^2, ``chunk_size``
    positions at a time, with bounded extra memory in the forward and the backward pass.

    With x = logits / temperature (in float32, float64 for float64 logits) and
    lse = logsumexp(x): log p(target) = x[target] - lse and H = -sum_v p_v log p_v with
    log p = x - lse (the entropy of the categorical distribution). Only one (chunk, V) slice of the
    logits is converted to float32 at a time; the backward pass recomputes each chunk's softmax
    from the saved logits and lse instead of keeping any (N, V) float32 tensor:
    d log p(t)/dx_v = 1[v = t] - p_v and dH/dx_v = -p_v (log p_v + H) (so the gradient w.r.t.
    the logits is these divided by the temperature). Same values as
    ``log_softmax(logits / temperature).gather(...)`` (verl ``logprobs_from_logits``,
    ``verl/utils/torch_functional.py``; OpenRLHF ``log_probs_from_logits``,
    ``openrlhf/models/utils.py``), which need a full-size softmax.

    ``with_sum_pi_squared``: also sum_v p_v^2 with p = softmax(logits / temperature), the
    collision probability of the categorical distribution, from the same chunk's p = exp(x - lse)
    (no further (chunk, V) temporary besides p itself). It equals verl's
    ``exp(logsumexp(2 x) - 2 lse)`` (``calculate_sum_pi_squared``; the ``sum_pi_squared`` of the
    optimal token baseline, ``rft_core.algorithms.baselines.optimal_token_baseline_advantages``).
    It is data, not a differentiable output (verl computes it in the no-grad log-prob pass).

    Args:
        logits: (..., V) any float dtype (the model's: bfloat16 on a GPU); its leading dims are
            flattened with ``reshape`` (a view for a contiguous tensor).
        targets: (...) int64 token ids in [0, V).
        temperature: > 0.
        with_entropy: also return the entropies.
        chunk_size: positions per chunk (None: ``default_chunk_size(V)``).
        with_sum_pi_squared: also return sum_v p_v^2 (a third element).
    Returns:
        (logprobs, entropy), or (logprobs, entropy, sum_pi_squared) with ``with_sum_pi_squared``:
        float32 tensors of targets' shape (float64 for float64 logits); entropy None unless
        asked. logprobs and entropy are differentiable w.r.t. ``logits``, sum_pi_squared is not.
    Raises:
        ValueError: shapes that do not match, a temperature <= 0 or a chunk_size < 1.
    """
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)} "
                         "(expected logits of shape targets.shape + (V,))")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    V = logits.shape[-1]
    chunk = default_chunk_size(V) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    lp, ent, spi2 = _ChunkedTokenLogprobs.apply(logits.reshape(-1, V), targets.reshape(-1).to(logits.device),
                                                float(temperature), bool(with_entropy), chunk, bool(with_sum_pi_squared))
    out = lp.view(targets.shape), (ent.view(targets.shape) if with_entropy else None)
    return (*out, spi2.view(targets.shape)) if with_sum_pi_squared else out


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(N, V) logits, (N,) targets -> (N,) log-probs, (N,) entropies and (N,) sum_v p_v^2 (each of
    the last two empty when not asked; sum_v p_v^2 is never differentiable); see
    ``token_logprobs``. Saves the logits (no copy), targets, lse and entropies."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk, with_sum_pi_squared=False):
        N = logits.shape[0]
        dtype = _compute_dtype(logits)
        logprobs = torch.empty(N, dtype=dtype, device=logits.device)
        lse = torch.empty(N, dtype=dtype, device=logits.device)
        entropy = torch.empty(N if with_entropy else 0, dtype=dtype, device=logits.device)
        sum_pi2 = torch.empty(N if with_sum_pi_squared else 0, dtype=dtype, device=logits.device)
        read_only = not (with_entropy or with_sum_pi_squared)  # x is then only read: no copy needed when already dtype
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            x = _scaled_chunk(logits, s, e, dtype, temperature, copy=not read_only)
            lse_c = torch.logsumexp(x, dim=-1)
            lse[s:e] = lse_c
            logprobs[s:e] = x.gather(-1, targets[s:e, None]).squeeze(-1) - lse_c
            if with_entropy or with_sum_pi_squared:
                logp = x.sub_(lse_c[:, None])
                p = logp.exp()
                if with_entropy:  # H = -sum_v p_v log p_v with log p = x - lse (no cancellation against lse)
                    entropy[s:e] = -(p * logp).sum(-1)
                if with_sum_pi_squared:  # sum_v p_v^2, in place on this chunk's p
                    sum_pi2[s:e] = p.mul_(p).sum(-1)
                del p  # not alive while the next chunk is allocated
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(sum_pi2)
        return logprobs, entropy, sum_pi2

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, grad_sum_pi2):
        logits, targets, lse, entropy = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        use_ent = grad_ent is not None and entropy.numel() > 0
        grad = torch.empty_like(logits)
        dtype = lse.dtype
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            if T == 1.0:  # one pass: the same values as a dtype copy of the chunk minus lse (exact promotion)
                logp = torch.sub(logits[s:e], lse[s:e, None])
            else:
                logp = _scaled_chunk(logits, s, e, dtype, T).sub_(lse[s:e, None])
            p = logp.exp()
            if grad_lp is not None:  # g_lp * (onehot(t) - p)
                g = p * (-grad_lp[s:e, None].to(dtype))
                g.scatter_add_(-1, targets[s:e, None], grad_lp[s:e, None].to(dtype))
            else:
                g = torch.zeros_like(p)
            if use_ent:  # - g_H * p * (log p + H)
                logp.add_(entropy[s:e, None]).mul_(p).mul_(grad_ent[s:e, None].to(dtype))
                g.sub_(logp)
            grad[s:e] = g.div_(T)
        return grad, None, None, None, None, None


def _scaled_chunk(logits: torch.Tensor, s: int, e: int, dtype: torch.dtype, temperature: float, *,
                  copy: bool = True) -> torch.Tensor:
    """logits[s:e] / temperature as a (e - s, V) tensor of ``dtype``: a new one (one allocation),
    or with ``copy=False`` the view of ``logits`` itself when it is already that (dtype
    ``dtype``, temperature 1), for a caller that only reads it."""
    if not copy and temperature == 1.0 and logits.dtype == dtype:
        return logits[s:e]
    x = logits[s:e].to(dtype, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


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
        model_inputs, media_counts: a vision-language row's vision inputs and each sequence's
            (images, videos) count (``with_vision``); empty / None for text.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    target_ids: torch.Tensor
    action_mask: torch.Tensor
    model_inputs: dict = field(default_factory=dict)  # VL (``with_vision``): the row's vision inputs
    media_counts: list[tuple[int, int]] | None = None  # VL: (images, videos) of each sequence

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
                             with_entropy: bool = False, chunk_size: int | None = None, with_sum_pi_squared: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None,
                                                                                      torch.Tensor]:
    """``response_logprobs`` for a packed batch: same (B, T) float32 outputs (zero where
    action_mask is False), differentiable; the (M, V) logits of the M response positions go
    through ``token_logprobs`` in chunks."""
    device = model_device(model)
    mask = batch.action_mask.to(device)
    B, T = mask.shape
    if batch.logit_index.numel() == 0:  # no response token at all
        zeros = torch.zeros(B, T, device=device)
        empty = zeros, (zeros.clone() if with_entropy else None)
        return (*empty, zeros.clone()) if with_sum_pi_squared else empty
    out = model(input_ids=batch.input_ids.to(device), attention_mask=None, logits_to_keep=batch.logit_index.to(device),
                use_cache=False, **packed_model_inputs(model, batch, device))
    flat = token_logprobs(out.logits[0], batch.target_ids.to(device), temperature=temperature,
                          with_entropy=with_entropy, chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)

    def unpack(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.zeros(B, T, device=device, dtype=x.dtype).masked_scatter(mask, x)

    return tuple(unpack(x) for x in flat)


def pass_groups(prompts: list[list[int]], responses: list[list[int]], micro_batch_size: int,
                groups: list[list[int]] | None) -> list[list[int]]:
    """The micro-batches of a pass over the samples: ``groups`` as given, checked, or (None) the
    samples sorted by prompt + response length (less padding) in chunks of ``micro_batch_size``.

    Raises:
        ValueError: ``groups`` that do not hold each sample exactly once.
    """
    if groups is None:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
        return [order[s:s + micro_batch_size] for s in range(0, len(order), micro_batch_size)]
    if sorted(i for g in groups for i in g) != list(range(len(prompts))):
        raise ValueError(f"groups must hold each of the {len(prompts)} samples exactly once")
    return groups


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
    chunk_size: int | None = None,
    videos: list[list[bytes]] | None = None,
    groups: list[list[int]] | None = None,
    with_sum_pi_squared: bool = False,
) -> list[list[float]] | tuple[list[list[float]], list[list[float]]] | tuple[list[list[float]], list[list[float]] | None,
                                                                             list[list[float]]]:
    """Unpadded per-sample log-prob lists (len = len(response)) for any number of samples.

    Samples are sorted by total length before micro-batching to reduce padding; the output is in
    the input order. ``groups``: the micro-batches instead (sample indices, each sample in
    exactly one; ``micro_batch_size`` is then unused), e.g. the update's
    (``rft_core.training.loop.epoch_micro_batches``). With ``with_entropy`` it returns
    (logprobs, entropies), same layout. With ``with_sum_pi_squared`` it returns (logprobs,
    entropies or None, sum_pi_squared): sum_v softmax(logits / temperature)_v^2 at each response
    token (``token_logprobs``), same layout (the optimal token baseline's input).
    ``packing``: each micro-batch goes through the model as one packed row (no padding).
    ``progress``: optional callable(done, total) called after each micro-batch (samples).
    ``images``, ``videos``, ``processor``: a vision-language model's per-sample images and
    videos (encoded bytes, one list per sample; either may be None) and its ``VLProcessor``
    (``with_vision``; packed or padded). ``chunk_size``: see ``token_logprobs``.
    """
    groups = pass_groups(prompts, responses, micro_batch_size, groups)
    result: list[list[float]] = [[] for _ in prompts]
    entropies: list[list[float]] = [[] for _ in prompts]
    sum_pi2: list[list[float]] = [[] for _ in prompts]
    done = 0
    for idx in groups:
        ps, rs = [prompts[i] for i in idx], [responses[i] for i in idx]
        batch = build_packed_batch(ps, rs) if packing else build_token_batch(ps, rs, pad_token_id=pad_token_id)
        if processor is not None:
            batch = with_vision(batch, processor, [images[i] for i in idx] if images is not None else None,
                                [videos[i] for i in idx] if videos is not None else None)
        res = response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy,
                                chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared)
        lp, ent = res[0].cpu(), (res[1].cpu() if res[1] is not None else None)
        spi2 = res[2].cpu() if with_sum_pi_squared else None
        for row, i in enumerate(idx):
            result[i] = lp[row, : len(responses[i])].tolist()
            if ent is not None:
                entropies[i] = ent[row, : len(responses[i])].tolist()
            if spi2 is not None:
                sum_pi2[i] = spi2[row, : len(responses[i])].tolist()
        done += len(idx)
        if progress is not None:
            progress(done, len(prompts))
    if with_sum_pi_squared:
        return result, (entropies if with_entropy else None), sum_pi2
    return (result, entropies) if with_entropy else result
