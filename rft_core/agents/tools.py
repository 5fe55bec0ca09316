"""Tool-call formats, and ``ToolEnvironment``: the base of environments whose turns are calls.

A model turn ends at EOS or at a format's stop string (the end tag of a call), so a turn holds
at most one call: the first complete one in the turn's text. Formats (``TOOL_FORMATS``):

- ``hermes`` (alias ``json``), the Qwen2.5 / Hermes format:
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>``
  (``arguments`` may also be a JSON string holding the object, as OpenAI-style APIs send it);
- ``calc``: ``<calc>12*34</calc>`` -> tool ``calculator`` with ``{"expression": "12*34"}`` (short
  enough for a 135M model to learn);
- ``python``: ``<python>print(2**10)</python>`` -> tool ``python`` with ``{"code": ...}`` (a
  fenced block inside the tags is unwrapped).

A turn without a call is the model's final answer.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from rft_core.agents.env import Environment, StepResult
from rft_core.registry import Registry


class ToolCallError(ValueError):
    """A malformed tool call (unterminated tag, bad JSON, no name); the message says which."""


class ToolFailure(Exception):
    """Raised by a tool that failed and knows what to show: ``observation`` (default
    ``"error: <message>"``); ``message`` goes to the record's ``error``."""

    def __init__(self, message: str, observation: str | None = None) -> None:
        super().__init__(message)
        self.observation = observation


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax.

    Attributes:
        name: the registry name.
        stop_strings: strings that end the model's turn (the call's end tag).
        parse: ``parse(text) -> ToolCall | None`` (None: no call in the turn); raises
            ``ToolCallError`` on a malformed call.
        example: one call in this format, for system prompts and docs.
    """

    name: str
    stop_strings: tuple[str, ...]
    parse: Callable[[str], ToolCall | None]
    example: str


TOOL_FORMATS: Registry[ToolFormat] = Registry("tool-call format")


def _tagged_body(text: str, tag: str) -> str | None:
    """The text between the first ``<tag>`` and the ``</tag>`` after it; None without an
    opening tag. Raises: ToolCallError: an opening tag without its end tag."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    end = text.find(f"</{tag}>", start)
    if end < 0:
        raise ToolCallError(f"unterminated <{tag}>: no </{tag}> after it")
    return text[start + len(tag) + 2:end]


def parse_hermes(text: str) -> ToolCall | None:
    """Parse ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (see module docstring).

    Raises:
        ToolCallError: unterminated tag, a body that is not a JSON object, no string ``name``,
            or ``arguments`` that is not an object (or a JSON string of one).
    """
    body = _tagged_body(text, "tool_call")
    if body is None:
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body.strip()[:120]!r}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallError(f'tool call must be {{"name": str, "arguments": {{...}}}}, got {body.strip()[:120]!r}')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError(f"tool call arguments are a string that is not JSON: {args[:120]!r}") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"tool call arguments must be an object, got {json.dumps(args)[:120]}")
    return ToolCall(obj["name"], args)


def tag_format(name: str, tag: str, tool: str, argument: str, example: str) -> ToolFormat:
    """A format where ``<tag>body</tag>`` calls ``tool`` with ``{argument: body}`` (stripped;
    a fenced code block inside is unwrapped)."""

    def parse(text: str) -> ToolCall | None:
        body = _tagged_body(text, tag)
        if body is None:
            return None
        fenced = re.fullmatch(r"\s*```[\w+-]*[ \t]*\n(.*?)\n?```\s*", body, re.DOTALL)
        return ToolCall(tool, {argument: (fenced.group(1) if fenced else body).strip()})

    return ToolFormat(name, (f"</{tag}>",), parse, example)


TOOL_FORMATS.register("hermes", "json")(ToolFormat(
    "hermes", ("</tool_call>",), parse_hermes,
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'))
TOOL_FORMATS.register("calc")(tag_format("calc", "calc", "calculator", "expression", "<calc>12*34</calc>"))
TOOL_FORMATS.register("python")(tag_format("python", "python", "python", "code", "<python>print(2**10)</python>"))


def tool_output_text(value: Any) -> str:
    """A tool's return value as observation text: str as is, numbers via ``str``, JSON-able
    lists/dicts as JSON. Raises: TypeError: anything else (the caller reports it as garbage)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (list, dict)):
        try:
            return json.dumps(value, sort_keys=True)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"tool returned {type(value).__name__} {value!r:.80}, not text")


class ToolEnvironment(Environment):
    """An environment whose turns are tool calls in ``tool_format``; a turn without a call is
    the final answer (``done=True``, reward from ``final``).

    Subclasses fill ``tools`` (name -> callable taking the call's arguments as keywords,
    returning text) and may override ``final``. Every tool failure is an observation starting
    with ``error:`` and ``info["error"]``, never an exception: a malformed call, an unknown tool,
    bad arguments, a tool that raises, returns something that is not text, or runs past
    ``tool_timeout_s`` (it runs in a worker thread; Python cannot kill a thread, so a hung tool
    keeps its thread until it returns: tools that may hang belong in a subprocess, as the
    ``python`` environment does).

    Attributes:
        tool_format: the ``ToolFormat`` used to parse turns (its stop strings end turns).
        tool_timeout_s: wall-time limit of one tool call in seconds, None for none.
    """

    tools: dict[str, Callable[..., Any]]
    tool_timeout_s: float | None = None

    def __init__(self, tool_format: str | ToolFormat, tools: dict[str, Callable[..., Any]] | None = None) -> None:
        self.tool_format = TOOL_FORMATS[tool_format] if isinstance(tool_format, str) else tool_format
        self.stop_strings = self.tool_format.stop_strings
        self.tools = dict(tools or {})
        self.prompt: dict[str, Any] = {}

    def reset(self, prompt: dict[str, Any]) -> str | None:
        """Keep the prompt row (``self.prompt``) for ``final``; no first observation."""
        self.prompt = prompt
        return None

    def final(self, text: str) -> StepResult:
        """The answer to a turn without a call: done, no reward (the reward stage grades it)."""
        return StepResult(None, None, True, {})

    def step(self, text: str) -> StepResult:
        """Parse the turn's call and run it (see the class docstring)."""
        try:
            call = self.tool_format.parse(text)
        except ToolCallError as exc:
            return self._error(str(exc), None)
        if call is None:
            return self.final(text)
        record = {"name": call.name, "arguments": call.arguments}
        fn = self.tools.get(call.name)
        if fn is None:
            return self._error(f"unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", record)
        try:
            out = self._run(fn, call.arguments)
        except ToolFailure as exc:
            return StepResult(exc.observation or f"error: {exc}", None, False, {"tool_call": record, "error": str(exc)})
        except FutureTimeout:
            return self._error(f"tool {call.name!r} timed out after {self.tool_timeout_s:g} s", record)
        except (TypeError, ValueError) as exc:  # bad arguments or values, or garbage output: the message says it
            return self._error(f"{call.name}: {exc}", record)
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation for the model
            return self._error(f"{call.name}: {type(exc).__name__}: {exc}", record)
        return StepResult(out, None, False, {"tool_call": record})

    def _run(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> str:
        if self.tool_timeout_s is None:
            return tool_output_text(fn(**arguments))
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rft-tool")
        try:
            return tool_output_text(pool.submit(fn, **arguments).result(timeout=self.tool_timeout_s))
        finally:
            pool.shutdown(wait=False)

    @staticmethod
    def _error(message: str, record: dict[str, Any] | None) -> StepResult:
        return StepResult(f"error: {message}", None, False, {"tool_call": record, "error": message})

