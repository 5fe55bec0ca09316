"""Local reward model: any HF sequence-classification model scoring prompt + response.

The input is the chat-templated prompt followed by the response, tokenized without extra
special tokens and right-padded; the reward is logit 0 at the last real token (what
``AutoModelForSequenceClassification`` returns for ``num_labels=1``, the Bradley-Terry reward
models of Ouyang et al. 2022). Inputs longer than ``max_length`` keep their last tokens.
"""
from __future__ import annotations

from typing import Sequence

import torch

from rft_core.models.loading import load_pretrained, load_tokenizer
from rft_core.rewards.base import RewardError, RewardSample, SourceScore


def score_texts(model, tokenizer, texts: Sequence[str], *, batch_size: int, max_length: int, device: str) -> list[float]:
    """Reward of each text, in order.

    Args:
        texts: full texts (prompt + response).
        batch_size: texts per forward pass.
        max_length: tokens kept per text (its end).
    Returns:
        list of floats, logit 0 of each text (float32 on ``device``, returned as Python floats).
    Raises:
        RewardError: the model has more than one label and no ``num_labels == 1`` head.
    """
    if model.config.num_labels != 1:
        raise RewardError(f"reward model has num_labels={model.config.num_labels}; a reward model needs num_labels=1")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[float] = []
    for start in range(0, len(texts), batch_size):
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"][-max_length:] for t in texts[start:start + batch_size]]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, :len(x)] = 1
        with torch.no_grad():
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits  # (B, 1)
        out.extend(logits[:, 0].float().cpu().tolist())
    return out


class RewardModelReward:
    """Source ``reward_model``: a local sequence-classification reward model (loaded once per
    source object, under the process-wide model-load lock)."""

    def __init__(self, cfg, name: str = "reward_model") -> None:
        self.cfg, self.name = cfg, name
        self._model = self._tokenizer = None

    def _load(self):
        if self._model is None:
            from transformers import AutoModelForSequenceClassification

            self._tokenizer = load_tokenizer(self.cfg.path)
            model = load_pretrained(AutoModelForSequenceClassification, self.cfg.path, dtype=self.cfg.dtype,
                                    what="reward model")
            if model.config.pad_token_id is None:  # needed to find each row's last real token
                model.config.pad_token_id = (self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None
                                             else self._tokenizer.eos_token_id)
            self._model = model.to(self.cfg.device)
        return self._model, self._tokenizer

    def score(self, samples: Sequence[RewardSample]) -> list[SourceScore]:
        model, tok = self._load()
        scores = score_texts(model, tok, [s.prompt_text + s.response for s in samples], batch_size=self.cfg.batch_size,
                             max_length=self.cfg.max_length, device=self.cfg.device)
        return [SourceScore(x) for x in scores]
