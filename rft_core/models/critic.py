"""The critic: a causal LM backbone with a scalar value head, per token.

Text policies: transformers' ``AutoModelForTokenClassification`` with ``num_labels=1`` (its
``score`` head is the value head), so it saves and loads with ``save_pretrained`` like any HF
model. A critic started from a policy checkpoint gets a zero-initialised head (V = 0 everywhere
at first, deterministic) and no classifier dropout.

Vision-language policies (Qwen2-VL / Qwen2.5-VL): transformers has no token-classification
class for them (``MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING`` has ``qwen2`` but no ``qwen2_vl``), so
the critic is ``VLValueModel``: the policy's multimodal backbone (``AutoModel``:
``Qwen2VLModel`` / ``Qwen2_5_VLModel``, vision tower and language model, no LM head) with the
same kind of head on its last hidden states, V(s) = w . h(s) + b, as transformers' generic
token classifier (``GenericForTokenClassification``: ``score = nn.Linear(hidden_size,
num_labels)``) and verl's / OpenRLHF's critics (a linear value head on the last hidden state).
It saves as the backbone's HF folder (``config.json`` keeps ``vision_config``, so the folder
stays a VL model folder) plus ``value_head.safetensors``; a folder without that file is a
policy and gets a fresh zero head. It takes the same vision inputs as the policy
(``VLProcessor.batch_inputs``), and the model computes its M-RoPE positions.
"""
from __future__ import annotations

from pathlib import Path

import torch

from rft_core.models.loading import attn_implementation, load_pretrained, resolve_model_path, set_trainable
from rft_core.models.pretrained import count_model_load
from rft_core.models.logprobs import (
    PackedBatch,
    TokenBatch,
    build_packed_batch,
    build_token_batch,
    model_device,
    packed_model_inputs,
    pass_groups,
    with_vision,
)
from rft_core.models.vl import is_vl_model

VALUE_HEAD_FILE = "value_head.safetensors"


class VLValueModel(torch.nn.Module):
    """A vision-language critic (see the module docstring): ``model`` (the multimodal backbone)
    and ``score`` (``nn.Linear(hidden_size, 1)``).

    ``forward(input_ids, attention_mask, position_ids, use_cache, **vision)`` returns an object whose
    ``logits`` are the values, (B, T, 1) in the head's dtype, like a token classifier's; it never
    keeps a cache (``use_cache`` is accepted, as a token classifier's, and ignored).
    """

    def __init__(self, backbone: torch.nn.Module, score: torch.nn.Linear) -> None:
        super().__init__()
        self.model = backbone
        self.score = score
        self.config = backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, **vision):
        from transformers.modeling_outputs import TokenClassifierOutput

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **vision)
        hidden = out.last_hidden_state
        return TokenClassifierOutput(logits=self.score(hidden.to(self.score.weight.dtype)))

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Gradient checkpointing of the backbone (transformers' switch)."""
        self.model.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, out_dir, state_dict: dict[str, torch.Tensor] | None = None, **kwargs) -> None:
        """Write the backbone's HF folder and ``value_head.safetensors`` into ``out_dir``.

        Args:
            state_dict: this module's full state dict (``model.*`` and ``score.*`` keys; e.g.
                the weights gathered from ZeRO ranks); None: the live weights.
        """
        from safetensors.torch import save_file

        state = state_dict if state_dict is not None else self.state_dict()
        backbone = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        head = {k[len("score."):]: v.detach().contiguous().cpu() for k, v in state.items() if k.startswith("score.")}
        self.model.save_pretrained(out_dir, state_dict=backbone, **kwargs)
        save_file(head, str(Path(out_dir) / VALUE_HEAD_FILE))


def load_vl_critic(path: str, *, dtype: str = "float32", trainable: bool = False) -> VLValueModel:
    """A ``VLValueModel`` from a VL critic checkpoint (backbone + ``value_head.safetensors``), or
    started from a VL policy folder with a zero head (V = 0 everywhere at first).

    Raises:
        ModelLoadError: unreadable path or weights, named in the message.
    """
    from safetensors.torch import load_file
    from transformers import AutoModel

    backbone = load_pretrained(AutoModel, path, dtype=dtype, trainable=trainable, what="vision-language critic",
                               model_kwargs={"attn_implementation": attn_implementation(dtype)})
    hidden = backbone.config.get_text_config().hidden_size
    dt = next(backbone.parameters()).dtype
    score = torch.nn.Linear(hidden, 1, dtype=dt)
    head = Path(resolve_model_path(path)) / VALUE_HEAD_FILE
    with torch.no_grad():
        if head.is_file():
            score.load_state_dict({k: v.to(dt) for k, v in load_file(str(head)).items()})
        else:  # started from a policy
            score.weight.zero_()
            score.bias.zero_()
    return set_trainable(VLValueModel(backbone, score), trainable)


def load_critic(path: str, *, dtype: str = "float32", trainable: bool = False):
    """Load a critic from a critic checkpoint, or start one from a policy (causal LM or
    vision-language) checkpoint; a VL folder gives a ``VLValueModel``.

    Counts a model load and the bytes of its weight files (``rft_core.counters.counts``), as
    ``load_causal_lm`` does.

    Raises:
        ModelLoadError: unreadable path or weights, named in the message.
    """
    from transformers import AutoModelForTokenClassification

    count_model_load(path)
    if is_vl_model(path):
        return load_vl_critic(path, dtype=dtype, trainable=trainable)
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
    critic's device; a packed batch (``build_packed_batch``) gives the same values; a batch with
    vision inputs (``with_vision``) passes them on (padded: the model computes its positions;
    packed: ``rft_core.models.logprobs.mrope_packed_position_ids``).

    Returns:
        (B, T) float32 on the critic's device (meaningless but finite where action_mask is
        False; zero there for a packed batch).
    """
    device = model_device(critic)
    if isinstance(batch, PackedBatch):
        mask = batch.action_mask.to(device)
        # use_cache=False: with a cache transformers does not read the restarting position ids as packed
        # sequences and lets each attend to the ones before it in the row (transformers 5.24 masking_utils)
        out = critic(input_ids=batch.input_ids.to(device), use_cache=False, **packed_model_inputs(critic, batch, device))
        flat = out.logits[0, batch.logit_index.to(device), 0].float()
        return torch.zeros(mask.shape, device=device, dtype=flat.dtype).masked_scatter(mask, flat)
    T = batch.num_actions
    if batch.model_inputs:
        extra = {k: v.to(device) for k, v in batch.model_inputs.items()}
    else:
        extra = {"position_ids": batch.position_ids.to(device)}
    out = critic(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False,
                 **extra)
    return out.logits[:, -T - 1:-1, 0].float()


def critic_batch(prompts: list[list[int]], responses: list[list[int]], *, pad_token_id: int, packing: bool,
                 processor=None, images: list[list[bytes]] | None = None,
                 videos: list[list[bytes]] | None = None) -> TokenBatch | PackedBatch:
    """The model inputs of one critic micro-batch: padded (or packed) token ids, plus the rows'
    images and videos for a vision-language critic (``processor`` given)."""
    batch = build_packed_batch(prompts, responses) if packing else build_token_batch(prompts, responses,
                                                                                      pad_token_id=pad_token_id)
    return with_vision(batch, processor, images, videos) if processor is not None else batch


@torch.no_grad()
def batched_response_values(critic: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]], *,
                            pad_token_id: int, micro_batch_size: int = 8, packing: bool = False, processor=None,
                            images: list[list[bytes]] | None = None,
                            videos: list[list[bytes]] | None = None, progress=None,
                            groups: list[list[int]] | None = None) -> list[list[float]]:
    """Unpadded per-sample value lists (len = len(response)), in input order; ``packing``: each
    micro-batch is one packed row without padding; ``processor``, ``images``, ``videos``: a
    vision-language critic's ``VLProcessor`` and the samples' media (one list per sample);
    ``progress``: optional callable(done, total) after each micro-batch (samples). ``groups``:
    the micro-batches (sample indices, each sample in exactly one; ``micro_batch_size`` is then
    unused), e.g. by tokens (``rft_core.training.loop.pass_micro_batches``); None: the samples
    sorted by length in chunks of ``micro_batch_size``.

    Raises:
        ValueError: ``groups`` that do not hold each sample exactly once.
    """
    out: list[list[float]] = [[] for _ in prompts]
    done = 0
    for idx in pass_groups(prompts, responses, micro_batch_size, groups):
        batch = critic_batch([prompts[i] for i in idx], [responses[i] for i in idx], pad_token_id=pad_token_id,
                             packing=packing, processor=processor,
                             images=[images[i] for i in idx] if images is not None else None,
                             videos=[videos[i] for i in idx] if videos is not None else None)
        v = response_values(critic, batch).cpu()
        for row, i in enumerate(idx):
            out[i] = v[row, : len(responses[i])].tolist()
        done += len(idx)
        if progress is not None:
            progress(done, len(prompts))
    return out
