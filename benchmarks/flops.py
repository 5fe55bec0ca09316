"""Floating-point operations of one GRPO step, counted from the model's shape and the step's
token counts (issue 19: the distance of a step to the machine's GEMM rate, ``gemm_rate.py``).

The counting is Kaplan et al. 2020, "Scaling Laws for Neural Language Models"
(arXiv:2001.08361), Table 1: a forward pass costs 2 FLOPs per weight per token (a multiply and
an add) plus ``2 * n_ctx * d_attn`` per token per layer for attention, and the backward pass
twice the forward. Chinchilla (Hoffmann et al. 2022, arXiv:2203.15556, Appendix F) counts the
same way per matrix: query/key/value and output projections, attention scores and values,
feed-forward, logits. Adapted here to grouped-query attention (key/value width
``num_key_value_heads * head_dim``), the SwiGLU MLP of Llama (three ``d x d_ff`` matrices) and
causal attention (a token at position ``i`` attends ``i + 1`` tokens). Per token per layer:

- projections ``2*d*q + 2*2*d*kv + 2*q*d`` (q = heads * head_dim = d on Llama, kv = kv_heads *
  head_dim), i.e. ``2*d*(2*d + 2*d_kv)`` when q = d;
- MLP ``2 * 3 * d * d_ff``;
- attention scores and weighted values ``4 * ctx * q`` (``ctx`` = tokens attended):
  Chinchilla's count, ``2 * ctx * q`` for the logits Q K^T and as much for the reduction A V
  (Kaplan's Table 1 lists ``2 * n_ctx * d_attn`` for this term).

Plus the lm_head, ``2 * d * V`` per position whose logits are computed (tied or not: the
product is the same). Left out, as in both papers: embedding lookups (no arithmetic), norms,
rotary embeddings, activations, softmax, the sampling and the optimizer step (each well under
1% here: AdamW is ~10 FLOPs per parameter per step against ~6 per parameter per token).

Only real tokens count (no padding): this is the arithmetic a step needs, the same formula for
every framework, given each one's actual prompt and response lengths. Per sample with a prompt
of ``P`` tokens and a response of ``R`` (``R >= 1``; a sample with no response counts nothing):

- generation: the prompt's prefill and one decode step per response token but the last (the
  last sampled token is never fed back): ``P + R - 1`` positions through the body, position
  ``i`` attending ``i + 1`` tokens, logits at the ``R`` positions that sample a token;
- a log-prob pass (actor or reference): the ``P + R`` tokens through the body, logits at the
  ``R`` positions that predict a response token (``logits_to_keep``, what both frameworks do);
- the update: a log-prob pass forward plus its backward, 3x the forward (activation
  checkpointing would recompute one more forward; that is not counted).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

PARTS = ("generation", "actor_logprobs", "ref_logprobs", "update")
# passes per step when a record names none: generation, the reference pass and one update epoch
DEFAULT_PASSES = {"generation": 1, "actor_logprobs": 0, "ref_logprobs": 1, "update": 1}


@dataclass(frozen=True)
class ModelDims:
    """The shape of a Llama-style decoder, all sizes in elements (not bytes)."""

    hidden_size: int  # d
    num_hidden_layers: int
    intermediate_size: int  # d_ff of the SwiGLU MLP
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V
    tie_word_embeddings: bool = False  # does not change the FLOPs; kept for the record

    @classmethod
    def from_config(cls, config: Any) -> ModelDims:
        """From a transformers config (``LlamaConfig`` and the like) or a dict with the same keys.
        ``head_dim`` defaults to ``hidden_size // num_attention_heads``, ``num_key_value_heads``
        to ``num_attention_heads``."""
        def get(key: str, default: Any = None) -> Any:
            value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
            return default if value is None else value

        d, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(hidden_size=d, num_hidden_layers=int(get("num_hidden_layers")),
                   intermediate_size=int(get("intermediate_size")), num_attention_heads=heads,
                   num_key_value_heads=int(get("num_key_value_heads", heads)), head_dim=int(get("head_dim", d // heads)),
                   vocab_size=int(get("vocab_size")), tie_word_embeddings=bool(get("tie_word_embeddings", False)))

    def to_dict(self) -> dict:
        """JSON-ready dict, readable again by ``from_config``."""
        return asdict(self)


def body_flops_per_token(m: ModelDims) -> int:
    """FLOPs of one token through all layers without attention's context-dependent part:
    projections and MLP, ``layers * (2*d*q + 4*d*kv + 2*q*d + 6*d*d_ff)``."""
    d, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return m.num_hidden_layers * (2 * d * q + 2 * 2 * d * kv + 2 * q * d + 2 * 3 * d * m.intermediate_size)


def attention_flops(m: ModelDims, attended: int) -> int:
    """FLOPs of attention scores (Q K^T) and weighted values (A V) over all layers, for
    ``attended`` (query, key) pairs in total: ``layers * 4 * q * attended``."""
    return m.num_hidden_layers * 4 * m.num_attention_heads * m.head_dim * attended


def lm_head_flops(m: ModelDims, positions: int) -> int:
    """FLOPs of the logits at ``positions`` positions: ``2 * d * V`` each."""
    return 2 * m.hidden_size * m.vocab_size * positions


def forward_flops(m: ModelDims, tokens: int, logit_positions: int) -> int:
    """FLOPs of one causal forward pass over ``tokens`` positions 0..tokens-1 (position ``i``
    attends ``i + 1`` tokens), with logits at ``logit_positions`` of them."""
    if tokens <= 0:
        return 0
    return tokens * body_flops_per_token(m) + attention_flops(m, tokens * (tokens + 1) // 2) + lm_head_flops(m, logit_positions)


def generation_flops(m: ModelDims, prompt_tokens: int, response_tokens: int) -> int:
    """FLOPs of sampling ``response_tokens`` tokens after a ``prompt_tokens``-token prompt with
    a KV cache: ``P + R - 1`` positions through the body, logits at ``R`` (0 when ``R == 0``)."""
    if response_tokens <= 0:
        return 0
    return forward_flops(m, prompt_tokens + response_tokens - 1, response_tokens)


def logprob_pass_flops(m: ModelDims, prompt_tokens: int, response_tokens: int) -> int:
    """FLOPs of one log-prob forward pass (actor or reference) of a sample: ``P + R`` tokens
    through the body, logits at the ``R`` response positions (0 when ``R == 0``)."""
    if response_tokens <= 0:
        return 0
    return forward_flops(m, prompt_tokens + response_tokens, response_tokens)


def update_flops(m: ModelDims, prompt_tokens: int, response_tokens: int) -> int:
    """FLOPs of one forward and backward pass of a sample in the policy update: 3x the
    log-prob forward (the backward is twice the forward: gradients of activations and weights)."""
    return 3 * logprob_pass_flops(m, prompt_tokens, response_tokens)


def step_flops(m: ModelDims, samples: Iterable[tuple[int, int]], passes: Mapping[str, float] | None = None) -> dict[str, int]:
    """FLOPs of one RL step over ``samples`` (``(prompt tokens, response tokens)`` per sample).

    Args:
        m: the model's shape.
        samples: per sample, real prompt tokens and real response tokens (no padding).
        passes: how many times each part runs over all samples in the step, keys of ``PARTS``
            (missing keys: ``DEFAULT_PASSES``): ``generation`` [1], ``actor_logprobs``
            (recomputing the old log-probs) [0], ``ref_logprobs`` [1], ``update`` (forward +
            backward epochs) [1]. May be fractional (a pass over part of the samples).

    Returns:
        FLOPs per part (keys of ``PARTS``) and ``total``; ints (float-rounded when a pass
        count is fractional).
    """
    n = {**DEFAULT_PASSES, **(passes or {})}
    gen = lp = 0
    for p, r in samples:
        gen += generation_flops(m, int(p), int(r))
        lp += logprob_pass_flops(m, int(p), int(r))
    parts = {"generation": n["generation"] * gen, "actor_logprobs": n["actor_logprobs"] * lp,
             "ref_logprobs": n["ref_logprobs"] * lp, "update": n["update"] * 3 * lp}
    out = {k: round(v) for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out
