"""Config validation errors as a user reads them: the dotted key as written (tagged-union tags
taken out), the problem, the valid keys or names, and for a tagged section its two forms."""
from __future__ import annotations

import types
import typing
from typing import Any, Mapping

from pydantic import BaseModel

from rft_core.config._base import TAG_KEYS, strip_tags


def error_line(e: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error as a line that names the key as a user writes it (tagged-union tags
    taken out of the path), its problem, and for a tagged section the name given and the two
    documented forms. ``root``: the config model the error's location starts from."""
    key, tag = strip_tags(e["loc"])
    if e["type"] == "unknown_name":
        given = e["input"]
        tag_key = next((k for k in TAG_KEYS if isinstance(given, Mapping) and k in given), "name")
        name = given.get(tag_key) if isinstance(given, Mapping) else given
        return (f"{key}: {e['msg']} (got {name!r}); write {key}=NAME for its defaults, or {key}.{tag_key}=NAME "
                f"beside its fields ({key}.<field>=...)")
    where = f" (in {tag})" if tag else ""
    if e["type"] == "extra_forbidden":
        return f"{key}{where}: not a setting{_valid_fields(e['loc'], root)}"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{key}{where}: {msg}" if key else msg


def _valid_fields(loc: tuple, root: type[BaseModel]) -> str:
    """'; valid keys here: a, b, c' for the model that holds the unknown key at ``loc``, or ''
    when it cannot be found (a dict of sections, a list)."""
    model: Any = root
    for part in [str(x) for x in loc[:-1]]:
        if "=" in part and part.split("=", 1)[0] in TAG_KEYS:  # the tagged class: find it by its tag
            key, name = part.split("=", 1)
            model = next((m for m in _union_members(model) if m.model_fields[key].default == name), None)
        elif isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields:
            model = model.model_fields[part].annotation
        else:
            model = _dict_value(model) if not part.isdigit() else _list_item(model)
        if model is None:
            return ""
        model = _unwrap(model)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return "; valid keys here: " + ", ".join(model.model_fields)
    return ""


def _unwrap(tp: Any) -> Any:
    """``X`` from ``X | None`` and ``Annotated[X, ...]`` (a tagged union stays a union)."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _union_members(tp: Any) -> list:
    return [_unwrap(a) for a in typing.get_args(_unwrap(tp))]


def _dict_value(tp: Any) -> Any:
    args = typing.get_args(tp)
    return args[1] if typing.get_origin(tp) is dict and len(args) == 2 else None


def _list_item(tp: Any) -> Any:
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) in (list, tuple) and args else None
