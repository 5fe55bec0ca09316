"""The tokens the chat template puts between two model turns, without re-rendering the history.

A multi-turn trajectory is kept as token ids: the model's own tokens exactly as sampled, and
between turns the tokens of the template's text that (1) closes the assistant message and (2)
holds the observation message and the next generation prompt. That text is found by rendering
a fixed two-message conversation with and without the new message and taking the difference
(the template must render the history unchanged when a message is added; checked every time):

- close: ``render([user, assistant(M)])`` after the marker M, e.g. ``<|im_end|>\\n`` (ChatML);
  when the model's turn already ended with a token that opens the close text (its EOS
  ``<|im_end|>``), only the rest (``\\n``) is added;
- observation: ``render([user, assistant(M), obs], generation prompt)`` minus
  ``render([user, assistant(M)])``, e.g. ``<|im_start|>tool\\n408<|im_end|>\\n<|im_start|>assistant\\n``.

Only that suffix text is tokenized (``add_special_tokens=False``) and appended, as verl's agent
loop and TRL do to avoid the drift of re-tokenizing decoded text (verl #6501, TRL PR #5242).
"""
from __future__ import annotations

from typing import Any

_USER = "\u2063U\u2063"  # invisible separators: text no template or observation contains
_MARK = "\u2063M\u2063"


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, the template refuses the observation role, or it
    re-renders earlier messages when one is added (so no suffix can be appended)."""


class ObservationRenderer:
    """Renders observations as the token suffix described in the module docstring.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        role: the observation message's role (``tool``; ``user`` for templates without one).
    Raises:
        ChatTemplateError: see the class; raised at construction (a probe observation is
            rendered once).
    """

    def __init__(self, tokenizer: Any, *, role: str = "tool") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("multi-turn rollouts render observations with the chat template, and the "
                                    "tokenizer has none; use a chat model")
        self.tokenizer, self.role = tokenizer, role
        self._base = [{"role": "user", "content": _USER}]
        self._turn = self._base + [{"role": "assistant", "content": _MARK}]
        self._closed = self._render(self._turn, generation_prompt=False)
        at = self._closed.rfind(_MARK)
        if at < 0:
            raise ChatTemplateError("the chat template drops the assistant's message content")
        self.close_text = self._closed[at + len(_MARK):]
        self._base_open = self._render(self._base, generation_prompt=False)
        self.generation_prompt = self._suffix(self._base_open, self._render(self._base, generation_prompt=True))
        self.observation_text("probe")

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:
            roles = [m["role"] for m in messages]
            raise ChatTemplateError(f"the chat template cannot render roles {roles}: {type(exc).__name__}: {exc}; "
                                    "set the agent's observation_role to a role it accepts (e.g. user)") from exc

    @staticmethod
    def _suffix(prefix: str, full: str) -> str:
        if not full.startswith(prefix):
            raise ChatTemplateError("the chat template renders earlier messages differently once a message is added, "
                                    "so the new message cannot be appended as a suffix")
        return full[len(prefix):]

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens parsed, none added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _message(self, content: str, name: str) -> dict[str, str]:
        # ``name``: templates that render tool results per function (Hermes) require it; others ignore it
        return {"role": self.role, "content": content, "name": name}

    def observation_text(self, content: str, *, name: str = "tool") -> str:
        """The template's text of one observation message (from tool ``name``) plus the next
        generation prompt, as it follows a closed assistant message."""
        full = self._render(self._turn + [self._message(content, name)], generation_prompt=True)
        return self._suffix(self._closed, full)

    def after_turn_ids(self, content: str, *, last_token_text: str | None, name: str = "tool") -> list[int]:
        """Token ids appended after a model turn: the rest of the assistant message's close text
        (all of it unless ``last_token_text``, the decoded last model token, opens it) and the
        observation ``content`` of tool ``name``."""
        close = self.close_text
        if last_token_text and close.startswith(last_token_text):
            close = close[len(last_token_text):]
        return self.encode(close + self.observation_text(content, name=name))

    def prompt_with_observation(self, prompt_ids: list[int], content: str, *, name: str = "tool") -> list[int]:
        """``prompt_ids`` (ending with the generation prompt) with an observation message put
        before the generation prompt: the prompt of a trajectory whose environment's ``reset``
        returned a first observation.

        Raises:
            ChatTemplateError: the prompt does not end with the template's generation prompt
                tokens.
        """
        gen = self.encode(self.generation_prompt)
        if not gen or list(prompt_ids[-len(gen):]) != gen:
            raise ChatTemplateError(f"the prompt does not end with the chat template's generation prompt "
                                    f"{self.generation_prompt!r}, so a first observation cannot be put before it")
        full = self._render(self._base + [self._message(content, name)], generation_prompt=True)
        return list(prompt_ids[:-len(gen)]) + self.encode(self._suffix(self._base_open, full))
