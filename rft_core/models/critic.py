"""The critic: a causal LM backbone with a scalar value head, per token.

Built on transformers' ``AutoModelForTokenClassification`` with ``num_labels=1`` (its ``score``
head is the value head), so it saves and loads with ``save_pretrained`` like any HF model.
A critic started from a policy checkpoint gets a zero-initialised head (V = 0 everywhere at
first, deterministic) and no classifier dropout.
"""
from __future__ import annotations

import torch

from rft_core.models.loading import load_pretrained
from rft_core.models.logprobs import PackedBatch, TokenBatch, build_packed_batch, build_token_batch, model_device


def load_critic(path: str, *, dtype: str = "float32", trainable: bool = False):
    """Load a critic from a critic checkpoint, or start one from a policy (causal LM) checkpoint.

    Raises:
        ModelLoadError: unreadable path or weights, named in the message.
    """
    from transformers import AutoModelForTokenClassification

    seen: dict[str, bool] = {}

    def as_critic(cfg):
        seen["fresh"] = not any(a.endswith("ForTokenClassification") for a in (cfg.architectures or []))
        cfg.num_labels = 1
        cfg.classifier_dropout = 0.0  # the value head sees the hidden states as they are
        if cfg.pad_token_id is None:
            cfg.pad_token_id = 0
        return cfg

    model = load_pretrained(AutoModelForTokenClassification, path, dtype=dtype, trainable=trainable, what="critic",
                            adjust_config=as_critic)
    if seen["fresh"]:  # started from a policy: a zero value head, V = 0 everywhere at first
        with torch.no_grad():
            model.score.weight.zero_()
            if getattr(model.score, "bias", None) is not None:
                model.score.bias.zero_()
    return model


def response_values(critic: torch.nn.Module, batch: TokenBatch | PackedBatch) -> torch.Tensor:
    """V(s_t) for each response token t: the value head at the column before the token
    (the state in which the token was chosen), as log-probs are aligned. The inputs go to the
    critic's device; a packed batch (``build_packed_batch``) gives the same values.

    Returns:
        (B, T) float32 on the critic's device (meaningless but finite where action_mask is
        False; zero there for a packed batch).
    """
    device = model_device(critic)
    if isinstance(batch, PackedBatch):
        mask = batch.action_mask.to(device)
        out = critic(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device))
        flat = out.logits[0, batch.logit_index.to(device), 0].float()
        return torch.zeros(mask.shape, device=device, dtype=flat.dtype).masked_scatter(mask, flat)
    T = batch.num_actions
    out = critic(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                 position_ids=batch.position_ids.to(device))
    return out.logits[:, -T - 1:-1, 0].float()


@torch.no_grad()
def batched_response_values(critic: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], *,
                            pad_token_id: int, micro_batch_size: int = 8, packing: bool = False) -> list[list[float]]:
    """Unpadded per-sample value lists (len = len(response)), in input order; ``packing``: each
    micro-batch is one packed row without padding."""
    out: list[list[float]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    for start in range(0, len(order), micro_batch_size):
        idx = order[start:start + micro_batch_size]
        ps, rs = [prompts[i] for i in idx], [responses[i] for i in idx]
        batch = build_packed_batch(ps, rs) if packing else build_token_batch(ps, rs, pad_token_id=pad_token_id)
        v = response_values(critic, batch).cpu()
        for row, i in enumerate(idx):
            out[i] = v[row, : len(responses[i])].tolist()
    return out
