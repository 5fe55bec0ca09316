"""Shared pieces of the config models: the frozen base class, registry-name checks and
tagged unions."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_name(registry, value: str) -> str:
    if value not in registry:
        raise ValueError(f"unknown {registry.kind} {value!r}; valid names: {', '.join(registry.names())}")
    return value


def _tagged_union(classes: tuple, key: str, default: str, kind: str):
    """A union of configs chosen by the field ``key`` (which may be left out: then ``default``).

    Each class's ``key`` is a Literal of one or more names; an unknown name fails with the list
    of valid names.
    """
    aliases = {name: c.model_fields[key].default for c in classes for name in c.model_fields[key].annotation.__args__}

    def tag_of(v: Any) -> str | None:
        name = v.get(key, default) if isinstance(v, dict) else getattr(v, key, default)
        return aliases.get(name, name)

    valid = ", ".join(aliases)
    return Annotated[
        Union[tuple(Annotated[c, Tag(c.model_fields[key].default)] for c in classes)],
        Discriminator(tag_of, custom_error_type="unknown_name",
                      custom_error_message=f"unknown {kind}; valid names: {valid}"),
    ]
