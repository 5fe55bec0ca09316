"""Shared pieces of the config models: the frozen base class, registry-name checks and
tagged unions."""
from __future__ import annotations

from typing import Annotated, Any, Mapping, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Tag


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _given(section: Any) -> Any:
    """The explicitly given fields of a raw config section: a mapping as is, a config model's
    set fields, {} for None; anything else unchanged (validation reports it)."""
    if section is None:
        return {}
    if isinstance(section, BaseModel):
        return {k: getattr(section, k) for k in section.model_fields_set}
    return dict(section) if isinstance(section, Mapping) else section


def _check_token_budget(section: str, max_tokens: int | None, packing: bool) -> None:
    """``<section>.max_tokens_per_micro_batch`` counts the tokens of a packed row (each sample's
    prompt + response): refused on padded rows, whose cost is the longest sample times the count.

    Raises:
        ValueError: a budget with ``packing`` off, naming both keys.
    """
    if max_tokens is not None and not packing:
        raise ValueError(f"{section}.max_tokens_per_micro_batch={max_tokens} counts the tokens of a packed row (prompt + "
                         f"response of each sample): it needs {section}.packing=true (or leave it out: micro-batches "
                         f"of {section}.micro_batch_size sequences)")


def _check_name(registry, value: str) -> str:
    if value not in registry:
        raise ValueError(f"unknown {registry.kind} {value!r}; valid names: {', '.join(registry.names())}")
    return value


def _tagged_union(classes: tuple, key: str, default: str, kind: str):
    """A union of configs chosen by the field ``key`` (which may be left out: then ``default``).

    Each class's ``key`` is a Literal of one or more names; an unknown name fails with the list
    of valid names. A bare name stands for the section with that name and its defaults, as a
    verl or TRL user types it: ``update.policy_loss=gspo`` is ``update.policy_loss.name=gspo``.
    """
    aliases = {name: c.model_fields[key].default for c in classes for name in c.model_fields[key].annotation.__args__}

    def tag_of(v: Any) -> str | None:
        name = v.get(key, default) if isinstance(v, dict) else getattr(v, key, default)
        return f"{key}={aliases.get(name, name)}"  # the tag shows in error locations: strip_tags

    def bare_name(v: Any) -> Any:
        return {key: v} if isinstance(v, str) else v

    valid = ", ".join(aliases)
    union = Annotated[
        Union[tuple(Annotated[c, Tag(f"{key}={c.model_fields[key].default}")] for c in classes)],
        Discriminator(tag_of, custom_error_type="unknown_name",
                      custom_error_message=f"unknown {kind}; valid names: {valid}"),
    ]
    TAG_KEYS.add(key)
    return Annotated[union, BeforeValidator(bare_name)]


TAG_KEYS: set[str] = set()  # the fields that pick a tagged union's class (name, estimator, type)


def strip_tags(loc: tuple) -> tuple[str, str | None]:
    """A pydantic error location as the dotted key a user writes, and the tagged class it is in:
    ``("update", "policy_loss", "name=gspo", "clip_lo")`` -> ``("update.policy_loss.clip_lo", "name=gspo")``."""
    parts = [str(x) for x in loc]
    tags = [p for p in parts if "=" in p and p.split("=", 1)[0] in TAG_KEYS]
    return ".".join(p for p in parts if p not in tags), (tags[-1] if tags else None)
