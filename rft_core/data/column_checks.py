"""Column-wise checks of one record batch of a data file (``rft_core.data.validate``): null and
blank masks, chat messages flattened with their parent rows, answers, media paths, labels. Each
returns a (rows,) bool numpy mask of the bad rows; none loops over rows in Python."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rft_core.data.columns import _exists, is_messages_type
from rft_core.data.prompts import CHAT_ROLES

TEXT_PARTS = ("text",)
MEDIA_PARTS = ("image", "image_url", "video", "video_url")


def _column(batch: pa.RecordBatch, dotted: str) -> pa.Array:
    """The (dotted) column of ``batch``; a null parent struct gives null (as ``columns._get``)."""
    if dotted in batch.schema.names:
        return batch.column(dotted)
    head, *rest = dotted.split(".")
    arr = batch.column(head)
    for name in rest:
        arr = pc.struct_field(arr, name)
    return arr


def _np(mask: pa.Array) -> np.ndarray:
    """A boolean Arrow array as numpy, null as False."""
    return pc.fill_null(mask, False).to_numpy(zero_copy_only=False)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _blank(arr: pa.Array) -> np.ndarray:
    """Text values that are null or only whitespace."""
    return _np(pc.or_kleene(pc.is_null(arr), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0)))


def _to_rows(flags: np.ndarray, parents: np.ndarray, n: int) -> np.ndarray:
    """Per row: whether any of its items (``parents``: each item's row) is flagged."""
    if not len(flags):
        return np.zeros(n, dtype=bool)
    return np.bincount(parents[flags], minlength=n)[:n] > 0


def _flatten(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """The items of a list column and the row of each (null lists have none)."""
    return pc.list_flatten(arr), pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)


# ------------------------------------------------------------------------------- the checks

def _content_ok(content: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(bad, has_text) per message content, as ``columns._content_text``: text, or a list of parts
    (strings, or {type: text|image|image_url|video|video_url, text}); an image or video part
    counts as text (its marker)."""
    t, n = content.type, len(content)
    null = _np(pc.is_null(content))
    if _is_text(t):
        return null, ~_blank(content)
    if not _is_list(t):  # neither text nor parts: every value is refused
        return np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
    parts, parents = _flatten(content)
    pt = parts.type
    if _is_text(pt):
        bad_part, text_part = _np(pc.is_null(parts)), ~_blank(parts)
    elif pa.types.is_struct(pt) and pt.get_field_index("type") >= 0:
        kind = pc.struct_field(parts, "type")
        is_text = _np(pc.is_in(kind, value_set=pa.array(TEXT_PARTS)))
        is_media = _np(pc.is_in(kind, value_set=pa.array(MEDIA_PARTS)))
        text = (~_blank(pc.struct_field(parts, "text")) if pt.get_field_index("text") >= 0
                and _is_text(pt.field("text").type) else np.zeros(len(parts), dtype=bool))
        bad_part = _np(pc.is_null(parts)) | ~(is_text | is_media)
        text_part = is_media | (is_text & text)
    else:
        bad_part, text_part = np.ones(len(parts), dtype=bool), np.zeros(len(parts), dtype=bool)
    return null | _to_rows(bad_part, parents, n), _to_rows(text_part, parents, n)


def _messages_bad(arr: pa.Array) -> np.ndarray:
    """Rows whose chat messages ``columns.messages_of`` refuses: null or no messages, a null
    message, an unknown role, a null or unreadable content, or no user turn with text."""
    n = len(arr)
    bad = _np(pc.is_null(arr)) | (pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False) == 0)
    msgs, parents = _flatten(arr)
    if not len(msgs):
        return bad
    role = pc.struct_field(msgs, "role")
    content_bad, has_text = _content_ok(pc.struct_field(msgs, "content"))
    msg_bad = _np(pc.is_null(msgs)) | ~_np(pc.is_in(role, value_set=pa.array(CHAT_ROLES))) | content_bad
    user_text = _np(pc.equal(role, "user")) & has_text
    return bad | _to_rows(msg_bad, parents, n) | ~_to_rows(user_text, parents, n)


def _answer_bad(arr: pa.Array) -> np.ndarray:
    """Rows whose answer ``columns.answer_text`` makes null or blank: a null, blank text, or chat
    messages whose last content is blank text."""
    t = arr.type
    bad = _np(pc.is_null(arr))
    if _is_text(t):
        return bad | _blank(arr)
    if _is_list(t) and is_messages_type(t) and _is_text(t.value_type.field("content").type):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        msgs, parents = _flatten(arr)
        last = np.flatnonzero(np.r_[parents[1:] != parents[:-1], True]) if len(parents) else np.zeros(0, np.int64)
        content = pc.struct_field(msgs, "content").take(pa.array(last, pa.int64()))
        blank_last = _np(pc.and_kleene(pc.is_valid(content), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(content)), 0)))
        rows = np.zeros(len(arr), dtype=bool)
        rows[parents[last]] = blank_last
        return bad | (rows & (lengths > 0))
    return bad


def _answer_type_problem(t: pa.DataType) -> str | None:
    """Why a text-comparing grader cannot read an answer column of type ``t`` (None: it can)."""
    if _is_text(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) \
            or pa.types.is_boolean(t) or is_messages_type(t):
        return None
    return "the grader compares the answer as text: give text, a number, a bool or chat messages"


def _media_paths(arr: pa.Array, base_dir: str) -> tuple[np.ndarray, pa.Array, np.ndarray]:
    """(rows with an item that is neither bytes nor a path, the resolved paths, each path's row)
    of an image/video column (``columns.resolve_media``: a path or URI, bytes, an HF
    {bytes, path} struct, or a list of them)."""
    n = len(arr)
    if _is_list(arr.type):
        items, parents = _flatten(arr)
        item_null = _np(pc.is_null(items))
    else:
        valid = _np(pc.is_valid(arr))
        items, parents = arr.filter(pa.array(valid)), np.flatnonzero(valid)
        item_null = np.zeros(len(items), dtype=bool)
    t = items.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return _to_rows(item_null, parents, n), pa.array([], pa.string()), np.zeros(0, np.int64)
    if _is_text(t):
        paths, is_path = items, ~_blank(items)
        bad = ~is_path
    else:  # a {bytes, path} struct: its bytes when not empty, else its path
        has_bytes = (_np(pc.greater(pc.binary_length(pc.struct_field(items, "bytes")), 0))
                     if t.get_field_index("bytes") >= 0 else np.zeros(len(items), dtype=bool))
        has_path = t.get_field_index("path") >= 0 and _is_text(t.field("path").type)
        paths = pc.struct_field(items, "path") if has_path else pa.nulls(len(items), pa.string())
        is_path = ~has_bytes & (~_blank(paths) if has_path else np.zeros(len(items), dtype=bool))
        bad = item_null | ~(has_bytes | is_path)
    paths = paths.filter(pa.array(is_path))
    absolute = pc.or_(pc.starts_with(paths, "/"), pc.match_substring(paths, "://"))
    sep = "" if base_dir.endswith("/") else "/"
    joined = pc.binary_join_element_wise(pa.scalar(base_dir + sep, paths.type), paths, pa.scalar("", paths.type))
    return _to_rows(bad, parents, n), pc.if_else(absolute, paths, joined), parents[is_path]


class _Exists:
    """Which resolved paths exist, each asked once per validation (``columns._exists``)."""

    def __init__(self) -> None:
        self.known: dict[str, bool] = {}

    def missing(self, paths: pa.Array) -> np.ndarray:
        """Per path of ``paths``: True when no file is there."""
        unique = pc.unique(paths).to_pylist()
        for p in unique:
            if p not in self.known:
                self.known[p] = _exists(p)
        gone = [p for p in unique if not self.known[p]]
        if not gone:
            return np.zeros(len(paths), dtype=bool)
        return _np(pc.is_in(paths, value_set=pa.array(gone, paths.type)))


def _labels(arr: pa.Array, name: str) -> pa.Array:
    """Each row's label: its data_source, else ``name`` when null or empty (as ``row_entry``)."""
    text = arr if _is_text(arr.type) else pc.cast(arr, pa.string())
    return pc.if_else(pc.fill_null(pc.greater(pc.utf8_length(text), 0), False), text, pa.scalar(name, text.type))


def _labels_bad(arr: pa.Array, name: str, labels: tuple[str, ...]) -> np.ndarray:
    """Rows whose label (``_labels``) has no recipe."""
    label = _labels(arr, name)
    return ~_np(pc.is_in(label, value_set=pa.array(labels, label.type)))
