"""Which columns of a user's dataset hold the prompt, the answer, ... and how a row becomes an entry.

Recognised without a mapping (first match wins, per key):

| our key | columns tried | layouts |
|---|---|---|
| prompt | ``prompt``, ``question``, ``problem``, ``Problem`` | verl (``prompt`` = chat messages), TRL standard (``prompt`` text) and conversational (``prompt`` messages), plain, GSM8K (``question``), MATH-500 (``problem``), AIME 2024 as ``Maxwell-Jia/AIME_2024`` ships it (``Problem``) |
| answer | ``reward_model.ground_truth``, ``answer``, ``solution``, ``ground_truth``, ``completion``, ``Answer`` | verl nests the reference in ``reward_model``; TRL passes ``solution``/``answer`` columns to reward functions; GSM8K, MATH-500 (``answer``), ``Maxwell-Jia/AIME_2024`` (``Answer``, an integer) |
| data_source | ``data_source`` | verl |
| images | ``images``, ``image`` | verl / HF ``Image`` features ({bytes, path}), paths, URIs |
| videos | ``videos``, ``video`` | paths, URIs, bytes |

A ``columns`` mapping (our key -> the file's column, dotted for a nested field:
``reward_model.ground_truth``) overrides the detection key by key, e.g. OpenRLHF's
``{prompt: input, answer: label}``. The capitalised names come last, so no file that read
before reads differently.

GSM8K (``openai/gsm8k``, configs ``main`` and ``socratic``: columns ``question``, ``answer``)
ships a worked solution as the answer, its last line ``#### N``. When the prompt column is
``question`` and the answer column ``answer`` (``Layout.gsm8k_answers``), an answer whose last
line is ``#### N`` is read as N with the commas between digits removed (``gsm8k_final_answer``:
``#### 1,200`` -> ``1200``); other answers of such a file are kept as they are (a plain
question/answer file). Every top-level column not mapped directly is kept in the
entry's ``metadata`` (JSON-serialisable: bytes become base64 text), so reward functions see it.

A prompt is text (a string column) or chat messages (a list of {role, content} structs); see
``rft_core.data.prompts.build_prompts`` for how each is rendered.
"""
from __future__ import annotations

import base64
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import unquote, urlparse

import pyarrow as pa

from rft_core.data.prompts import CHAT_ROLES, IMAGE_MARKER, VIDEO_MARKER, DatasetError

KEYS = ("prompt", "answer", "data_source", "images", "videos")
REQUIRED_KEYS = ("prompt", "answer")
CANDIDATES: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "question", "problem", "Problem"),
    "answer": ("reward_model.ground_truth", "answer", "solution", "ground_truth", "completion", "Answer"),
    "data_source": ("data_source",),
    "images": ("images", "image"),
    "videos": ("videos", "video"),
}
MEDIA_KEYS = ("images", "videos")


@dataclass(frozen=True)
class Layout:
    """How one file's columns map onto entries.

    Attributes:
        columns: our key -> the file's (dotted) column, for every key found or mapped.
        prompt_kind: "text" or "messages".
        style: "verl", "trl_conversational", "trl_standard", "plain" (detected) or "mapped"
            (a ``columns`` mapping was given).
        metadata_columns: top-level columns copied into ``metadata``.
        gsm8k_answers: the prompt column is ``question`` and the answer column ``answer``
            (text), GSM8K's names: an answer ending in a ``#### N`` line is read as N.
    """

    columns: dict[str, str]
    prompt_kind: str
    style: str
    metadata_columns: tuple[str, ...]
    gsm8k_answers: bool = False


def column_paths(schema: pa.Schema) -> list[str]:
    """Every column of ``schema`` as a dotted path: top-level names and nested struct fields."""
    out: list[str] = []

    def walk(prefix: str, t: pa.DataType) -> None:
        if pa.types.is_struct(t):
            for k in range(t.num_fields):
                f = t.field(k)
                out.append(f"{prefix}.{f.name}")
                walk(f"{prefix}.{f.name}", f.type)

    for f in schema:
        out.append(f.name)
        walk(f.name, f.type)
    return out


def field_type(schema: pa.Schema, dotted: str) -> pa.DataType | None:
    """The Arrow type of the (dotted) column ``dotted``, or None when absent. An exact top-level
    name wins over a nested path (a column may itself contain dots)."""
    if dotted in schema.names:
        return schema.field(dotted).type
    head, *rest = dotted.split(".")
    if head not in schema.names:
        return None
    t = schema.field(head).type
    for name in rest:
        if not pa.types.is_struct(t) or t.get_field_index(name) < 0:
            return None
        t = t.field(name).type
    return t


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)


def _list_value(t: pa.DataType) -> pa.DataType | None:
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return t.value_type
    return None


def is_messages_type(t: pa.DataType) -> bool:
    """True for a list of structs with ``role`` and ``content`` fields (a chat prompt)."""
    v = _list_value(t)
    return v is not None and pa.types.is_struct(v) and v.get_field_index("role") >= 0 and v.get_field_index("content") >= 0


def _media_item_ok(t: pa.DataType) -> bool:
    if _is_text(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    return pa.types.is_struct(t) and (t.get_field_index("bytes") >= 0 or t.get_field_index("path") >= 0)


def _type_problem(key: str, t: pa.DataType) -> str | None:
    """Why a column of type ``t`` cannot serve as ``key`` (None when it can)."""
    if pa.types.is_null(t):
        return "every value is null"
    if key == "prompt" and not (_is_text(t) or is_messages_type(t)):
        return "a prompt must be text or a list of {role, content} chat messages"
    if key == "data_source" and not _is_text(t):
        return "data_source must be text"
    if key in MEDIA_KEYS:
        v = _list_value(t)
        if not _media_item_ok(v if v is not None else t):
            return f"{key} must be paths/URIs, bytes or {{bytes, path}} structs (or a list of them)"
    return None


def resolve_layout(schema: pa.Schema, columns: Mapping[str, str] | None = None, *, where: str,
                   require_answer: bool = True) -> Layout:
    """Find the prompt/answer/data_source/images/videos columns of ``schema``.

    Args:
        columns: our key -> column (dotted for nested); overrides the detection key by key.
        where: the file, for error messages.
        require_answer: False when the grader reads no reference answer: a file without an
            answer column is then accepted (``Layout.columns`` has no ``answer``).
    Raises:
        DatasetError: a mapping with an unknown key or naming an absent column, no prompt or
            (``require_answer``) answer column, or a column whose type cannot serve its key
            (naming file, column, type).
    """
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(KEYS))
    if unknown:
        raise DatasetError(f"data.columns: unknown key(s) {unknown}; valid keys: {list(KEYS)}")
    found: dict[str, str] = {}
    for key in KEYS:
        if key in columns:
            if field_type(schema, columns[key]) is None:
                raise DatasetError(f"{where}: data.columns.{key} names column {columns[key]!r}, which is not in the file; "
                                   f"columns: {column_paths(schema)}")
            found[key] = columns[key]
            continue
        hit = next((c for c in CANDIDATES[key] if field_type(schema, c) is not None), None)
        if hit is not None:
            found[key] = hit
    for key in REQUIRED_KEYS if require_answer else ("prompt",):
        if key not in found:
            raise DatasetError(f"{where}: no {key} column (looked for {list(CANDIDATES[key])}); the file has "
                               f"{column_paths(schema)}; map one with data.columns.{key}")
    for key, col in found.items():
        problem = _type_problem(key, field_type(schema, col))
        if problem:
            raise DatasetError(f"{where}: column {col!r} (used as {key}) has type {field_type(schema, col)}: {problem}")
    messages = is_messages_type(field_type(schema, found["prompt"]))
    if columns:
        style = "mapped"
    elif messages:
        style = "verl" if found["answer"] == "reward_model.ground_truth" else "trl_conversational"
    else:
        style = "trl_standard" if found["prompt"] == "prompt" else "plain"
    direct = {c for c in found.values() if c in schema.names}
    meta = tuple(n for n in schema.names if n not in direct)
    gsm8k = (found["prompt"] == "question" and found.get("answer") == "answer"
             and _is_text(field_type(schema, "answer")))
    return Layout(found, "messages" if messages else "text", style, meta, gsm8k_answers=gsm8k)


_GSM8K_FINAL = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*([^\n]*?)\s*\Z")


def gsm8k_final_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution (``openai/gsm8k``: a worked solution whose last line
    is ``#### N``): the text after ``####`` with the commas between digits removed
    (``"...\\n#### 1,200"`` -> ``"1200"``, as GSM8K's own evaluation reads it); None when the
    last non-blank line is not a ``####`` line with text after it."""
    m = _GSM8K_FINAL.search(text)
    if m is None or not m.group(1).strip():
        return None
    return re.sub(r"(?<=\d),(?=\d)", "", m.group(1).strip())


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    """The value of (dotted) column ``dotted`` in ``row``; None when a parent is null."""
    if dotted in row:
        return row[dotted]
    value: Any = row
    for name in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(name)
    return value


def jsonable(value: Any) -> Any:
    """``value`` with bytes as base64 text, dates as ISO text and other non-JSON scalars as
    ``str``, recursively, so ``json.dumps`` accepts it."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def answer_text(value: Any) -> str:
    """The reference answer as text: strings as they are, integers (and integral floats, which
    JSON readers produce when a column mixes 1 and 2.5) in decimal, other floats by ``repr``,
    a list of chat messages by its last message's content, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, list) and value and all(isinstance(m, Mapping) and "content" in m for m in value):
        return answer_text(value[-1]["content"])
    return json.dumps(jsonable(value), sort_keys=True, ensure_ascii=False)


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string as is; a list of parts joined, text parts by their
    text, image parts as ``<image>`` and video parts as ``<video>`` (the markers
    ``build_prompts`` turns into a vision-language model's placeholders)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                out.append(str(part.get("text") or ""))
            elif isinstance(part, Mapping) and part.get("type") in ("image", "image_url"):
                out.append(IMAGE_MARKER)
            elif isinstance(part, Mapping) and part.get("type") in ("video", "video_url"):
                out.append(VIDEO_MARKER)
            else:
                raise DatasetError(f"{where}: unsupported message content part {part!r:.80}")
        return "".join(out)
    raise DatasetError(f"{where}: message content must be text or a list of parts, got {type(content).__name__}")


def messages_of(value: Any, *, where: str) -> list[dict[str, Any]]:
    """Chat messages as dicts {role, content: str, ...}; keys whose value is null (Arrow fills
    keys that only other rows have) are dropped.

    Raises:
        DatasetError: not a non-empty list of {role, content}, an unknown role, or no user turn
            with text (an empty prompt).
    """
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: empty prompt (no messages)")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in CHAT_ROLES or m.get("content") is None:
            raise DatasetError(f"{where} message {k}: expected {{role: one of {list(CHAT_ROLES)}, content}}, got {m!r:.120}")
        msg = {key: v for key, v in m.items() if v is not None}
        msg["content"] = _content_text(m["content"], f"{where} message {k}")
        out.append(msg)
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise DatasetError(f"{where}: empty prompt (no user message with text)")
    return out


def _local_path(ref: str) -> str | None:
    """The local path of a plain path or file:// URL; None for another URI scheme."""
    if "://" not in ref:
        return ref
    url = urlparse(ref)
    return unquote(url.path) if url.scheme == "file" else None


def resolve_media(value: Any, *, base_dir: str, where: str, check: bool = True) -> list[str | bytes]:
    """The items of an image/video cell: bytes as they are; a path relative to ``base_dir`` (the
    dataset file's folder, a local path or URI) joined to it; absolute paths and URIs as given.
    An HF ``{bytes, path}`` struct gives its bytes, else its path.

    Args:
        check: verify that every path/URI exists (local: ``os.path.exists``; URI: fsspec).
    Raises:
        DatasetError: an item that is neither, or (check) a file that does not exist.
    """
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out: list[str | bytes] = []
    for k, item in enumerate(items):
        if isinstance(item, Mapping):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray, memoryview)):
            out.append(bytes(item))
            continue
        if not isinstance(item, str) or not item.strip():
            raise DatasetError(f"{where} item {k}: expected a path, URI or bytes, got {item!r:.80}")
        ref = item if ("://" in item or os.path.isabs(item)) else (
            posixpath.join(base_dir, item) if "://" in base_dir else os.path.join(base_dir, item))
        if check and not _exists(ref):
            raise DatasetError(f"{where} item {k}: {item!r} does not exist (resolved to {ref!r})")
        out.append(ref)
    return out


def _exists(ref: str) -> bool:
    local = _local_path(ref)
    if local is not None:
        return os.path.isfile(local)
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(ref)
        return bool(fs.isfile(path))
    except (OSError, ValueError, ImportError):
        return False


def read_remote(ref: str | bytes, *, where: str) -> str | bytes:
    """Bytes of a non-local URI (read with fsspec); local paths, file:// URLs and bytes are
    returned as they are (``rft_core.data.images`` reads those itself).

    Raises:
        DatasetError: the URI cannot be read.
    """
    if isinstance(ref, bytes) or _local_path(ref) is not None:
        return ref
    import fsspec

    try:
        with fsspec.open(ref, "rb") as f:
            return f.read()
    except (OSError, ValueError, ImportError) as exc:
        raise DatasetError(f"{where}: cannot read {ref!r}: {exc}") from exc


def row_entry(row: Mapping[str, Any], layout: Layout, *, where: str, base_dir: str, data_source: str,
              data_source_override: str | None = None, check_media: bool = True,
              require_answer: bool = True) -> dict[str, Any]:
    """The entry ``build_prompts`` takes for one row (``row``: column -> Python value).

    Args:
        require_answer: False when the grader reads no reference answer: a row without one
            (null, blank, or no answer column) gets the answer ``""``.
    Returns:
        {question, answer, data_source, metadata, images, videos} plus ``messages`` for a chat
        prompt (``question`` is then the last user message's text). ``data_source``: the
        override, else the row's data_source column, else ``data_source``.
    Raises:
        DatasetError: no prompt, an empty prompt, malformed messages, no (or a blank) answer, or a
            missing image/video file; the message names ``where`` and the column.
    """
    cols = layout.columns
    prompt = _get(row, cols["prompt"])
    if prompt is None:
        raise DatasetError(f"{where}: no prompt (column {cols['prompt']!r} is null)")
    entry: dict[str, Any] = {}
    if layout.prompt_kind == "messages":
        messages = messages_of(prompt, where=f"{where} column {cols['prompt']!r}")
        entry["messages"] = messages
        entry["question"] = [m["content"] for m in messages if m["role"] == "user"][-1]
    else:
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(f"{where}: empty prompt (column {cols['prompt']!r} is {prompt!r:.40})")
        entry["question"] = prompt
    answer = _get(row, cols["answer"]) if "answer" in cols else None
    text = None if answer is None else answer_text(answer)
    if layout.gsm8k_answers and text is not None:
        text = gsm8k_final_answer(text) or text
    if (text is None or not text.strip()) and require_answer:
        raise DatasetError(f"{where}: no answer (column {cols['answer']!r} is {answer!r:.40})")
    entry["answer"] = text or ""
    row_source = _get(row, cols["data_source"]) if "data_source" in cols else None
    entry["data_source"] = data_source_override or row_source or data_source
    entry["metadata"] = {c: jsonable(row.get(c)) for c in layout.metadata_columns}
    if data_source_override and row_source:
        entry["metadata"]["data_source"] = row_source  # the file's own label, replaced by the override
    for key in MEDIA_KEYS:
        entry[key] = resolve_media(_get(row, cols[key]), base_dir=base_dir, where=f"{where} column {cols[key]!r}",
                                   check=check_media) if key in cols else []
    return entry
