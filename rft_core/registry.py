"""Named registries: variants are chosen by name, and a bad name lists the valid ones."""
from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised when a registry lookup misses; the message lists every valid name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Registry(Generic[T]):
    """A name -> object map with a decorator for registration.

    Example:
        >>> KL = Registry("kl estimator")
        >>> @KL.register("k1")
        ... def k1(x): return x
        >>> KL["k1"] is k1
        True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._info: dict[str, Any] = {}

    def register(self, *names: str, info: Any = None) -> Callable[[T], T]:
        """Register the decorated object under each of ``names``, with optional metadata
        ``info`` (what callers must know about the entry without calling it, e.g. whether an
        advantage estimator needs critic values); ``info(name)`` returns it.

        Raises:
            ValueError: a name is already registered.
        """

        def deco(obj: T) -> T:
            for name in names:
                if name in self._items:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._items[name] = obj
                self._info[name] = info
            return obj

        return deco

    def __getitem__(self, name: str) -> T:
        self._check(name)
        return self._items[name]

    def info(self, name: str) -> Any:
        """The metadata registered with ``name`` (None when none was given).

        Raises:
            UnknownNameError: ``name`` is not registered (the message lists the valid names).
        """
        self._check(name)
        return self._info[name]

    def _check(self, name: str) -> None:
        if name not in self._items:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self._items))}")

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        """Sorted list of registered names."""
        return sorted(self._items)
