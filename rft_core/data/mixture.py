"""Weighted mixtures of datasets (``data.sources``), with a data order that is a pure function of
(seed, iteration); and ``open_data``, the entry point from the ``data`` config (a path or a
mixture) to a dataset.

Iteration i draws how many of its P prompts each source gives, ``n(i) ~ Multinomial(P, w/Σw)``,
and their order (a permutation of the source labels), from numpy PCG64 seeded with
``(seed, MIX_KEY, i)``. Source s then takes positions ``C_s(i-1) .. C_s(i-1)+n_s(i)-1`` of its
own endless epoch-permuted stream (``rft_core.data.prompts.stream_indices`` keyed
``(seed, SOURCE_KEY, s)``), where ``C_s(i-1) = Σ_{j<i} n_s(j)``. So every source walks through
all its rows before repeating one (a small, heavily weighted source is repeated, a large,
lightly weighted one is subsampled), and a resumed run gets exactly the same prompts.
The same idea as weighted dataset interleaving (``datasets.interleave_datasets`` with
``probabilities``), made resumable per iteration.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from rft_core.data.files import FileDataset, fingerprint_files, resolve_files
from rft_core.data.prompts import DatasetError, stream_indices

MIX_KEY = 2  # PCG64 key tag of the per-iteration source draw (the main order uses (seed, epoch))
SOURCE_KEY = 3  # ... of each source's row stream
REFILL_KEY = 4  # ... of dynamic-sampling refills
SOURCE_KEYS = ("path", "weight", "data_source", "columns", "format")


def check_weights(weights: Sequence[Any], *, names: Sequence[str] | None = None) -> np.ndarray:
    """The weights normalised to probabilities (float64, sum 1).

    Raises:
        DatasetError: no weights, or a weight that is not a finite number > 0 (naming the source).
    """
    if len(weights) == 0:
        raise DatasetError("data.sources is empty")
    for k, w in enumerate(weights):
        ok = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
        if not ok:
            label = f" ({names[k]})" if names else ""
            raise DatasetError(f"data.sources[{k}]{label}: weight must be a positive number, got {w!r}")
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def _draw(iteration: int, per_iteration: int, p: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts per source, source label of each slot) of ``iteration``."""
    rng = np.random.Generator(np.random.PCG64([seed, MIX_KEY, iteration]))
    counts = rng.multinomial(per_iteration, p)
    return counts, rng.permutation(np.repeat(np.arange(len(p)), counts))


_PREFIX_CACHE: dict[tuple, list[np.ndarray]] = {}  # (P, p, seed) -> cumulative counts after 0, 1, 2, ... iterations


def _counts_before(iteration: int, per_iteration: int, p: tuple[float, ...], seed: int) -> np.ndarray:
    """Σ_{j<iteration} n(j): each source's prompts in the iterations before ``iteration``; the
    running sums are cached per (P, p, seed), so a run costs O(iterations) draws in all."""
    key = (per_iteration, p, seed)
    sums = _PREFIX_CACHE.setdefault(key, [np.zeros(len(p), dtype=np.int64)])
    if len(_PREFIX_CACHE) > 16:
        _PREFIX_CACHE.pop(next(iter(_PREFIX_CACHE)))
    while len(sums) < iteration:
        sums.append(sums[-1] + _draw(len(sums), per_iteration, np.asarray(p), seed)[0])
    return sums[iteration - 1].copy()


def mixture_indices(iteration: int, *, per_iteration: int, sizes: Sequence[int], weights: Sequence[float],
                    seed: int) -> list[tuple[int, int]]:
    """(source index, row index) of each prompt of ``iteration`` (1-based); see the module
    docstring. The first call for a late ``iteration`` costs O(iteration) small draws (the
    sources' positions before it); later calls reuse them.

    Raises:
        ValueError: ``iteration`` < 1.
        DatasetError: a bad weight, or a source with no rows.
    """
    if iteration < 1:
        raise ValueError(f"iterations are 1-based, got {iteration}")
    p = check_weights(weights)
    if len(sizes) != len(p) or min(sizes) < 1:
        raise DatasetError(f"mixture: {len(sizes)} source sizes {list(sizes)} for {len(p)} weights; every source needs rows")
    before = _counts_before(iteration, per_iteration, tuple(p.tolist()), seed)
    counts, labels = _draw(iteration, per_iteration, p, seed)
    rows = {s: iter(stream_indices(int(before[s]), int(counts[s]), size=int(sizes[s]), key=(seed, SOURCE_KEY, s)))
            for s in range(len(p))}
    return [(int(s), next(rows[int(s)])) for s in labels]


def mixture_refill_indices(iteration: int, attempt: int, *, per_iteration: int, sizes: Sequence[int],
                           weights: Sequence[float], seed: int) -> list[tuple[int, int]]:
    """(source, row) pairs of dynamic-sampling refill ``attempt`` (>= 1) of ``iteration``: sources
    by weight, rows uniformly without repeats within a source, from PCG64 seeded with
    ``(seed, REFILL_KEY, iteration, attempt)``; a stream apart from the main order.

    Raises:
        ValueError: ``attempt`` < 1.
        DatasetError: a bad weight.
    """
    if attempt < 1:
        raise ValueError(f"refill attempts are numbered from 1, got {attempt}")
    p = check_weights(weights)
    rng = np.random.Generator(np.random.PCG64([seed, REFILL_KEY, iteration, attempt]))
    labels = rng.choice(len(p), size=per_iteration, p=p)
    out = []
    for s in range(len(p)):
        n = int((labels == s).sum())
        rows = rng.choice(int(sizes[s]), size=min(n, int(sizes[s])), replace=False) if n else []
        out += [(s, int(r)) for r in rows]
    return out


class MixtureDataset:
    """Several ``FileDataset`` sources drawn by weight. Global row index = the source's offset
    (sum of the sizes before it) + the row within the source, so prompt ids stay unique.

    Args:
        sources: each {path, weight (default 1), data_source, columns, format}.
        format, columns: defaults for sources that do not set their own.
        require_answer: as ``FileDataset``.
    Raises:
        DatasetError: an unknown key, a source without a path, a weight that is not positive,
            or anything ``FileDataset`` raises at open time (naming the source).
    """

    name = "mixture"

    def __init__(self, sources: Sequence[Mapping[str, Any]], *, format: str = "auto",
                 columns: Mapping[str, str] | None = None, require_answer: bool = True) -> None:
        for k, src in enumerate(sources):
            unknown = sorted(set(src) - set(SOURCE_KEYS))
            if unknown or not src.get("path"):
                raise DatasetError(f"data.sources[{k}]: needs 'path'; unknown key(s) {unknown}; valid keys: {list(SOURCE_KEYS)}")
        self.weights = [src.get("weight", 1) for src in sources]
        self.p = check_weights(self.weights, names=[str(s["path"]) for s in sources])
        self.sources = [FileDataset(src["path"], format=src.get("format") or format,
                                    columns=src.get("columns") if src.get("columns") is not None else columns,
                                    data_source=src.get("data_source"), require_answer=require_answer,
                                    key=f"data.sources[{k}].path")
                        for k, src in enumerate(sources)]
        self.sizes = [len(s) for s in self.sources]
        self._starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def global_index(self, source: int, row: int) -> int:
        """The global index of ``row`` of source ``source``."""
        return int(self._starts[source] + row)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, row within the source) of global ``index``.

        Raises:
            DatasetError: ``index`` out of range.
        """
        if not 0 <= index < len(self):
            raise DatasetError(f"mixture: row index {index} out of range (the mixture has {len(self)} rows)")
        s = int(np.searchsorted(self._starts, index, side="right") - 1)
        return s, int(index - self._starts[s])

    def where(self, index: int) -> str:
        """'{file} row {n}' of global ``index``."""
        s, row = self.locate(index)
        return self.sources[s].where(row)

    def iteration_indices(self, iteration: int, *, per_iteration: int, seed: int) -> list[int]:
        """Global indices of ``iteration``'s prompts (``mixture_indices``)."""
        return [self.global_index(s, r) for s, r in mixture_indices(
            iteration, per_iteration=per_iteration, sizes=self.sizes, weights=self.weights, seed=seed)]

    def refill_indices(self, iteration: int, attempt: int, *, per_iteration: int, seed: int) -> list[int]:
        """Global indices of a refill (``mixture_refill_indices``)."""
        return [self.global_index(s, r) for s, r in mixture_refill_indices(
            iteration, attempt, per_iteration=per_iteration, sizes=self.sizes, weights=self.weights, seed=seed)]

    def entries(self, indices: Sequence[int]) -> list[tuple[int, dict[str, Any]]]:
        """(global index, entry) pairs in the order given; see ``FileDataset.entries``.

        Raises:
            DatasetError: an index out of range or a bad row.
        """
        idx = [int(i) for i in indices]
        located = [self.locate(i) for i in idx]
        got: dict[int, dict[str, Any]] = {}
        for s in sorted({s for s, _ in located}):
            for local, entry in self.sources[s].entries([r for k, r in located if k == s]):
                got[self.global_index(s, local)] = entry
        return [(i, got[i]) for i in idx]

    def fingerprint(self) -> str:
        """The sources' fingerprints joined with ``+``, in source order."""
        return "+".join(s.fingerprint() for s in self.sources)


def open_data(path: str | None = None, *, format: str = "auto", columns: Mapping[str, str] | None = None,
              sources: Sequence[Mapping[str, Any]] | None = None, data_source: str | None = None,
              require_answer: bool = True):
    """The dataset of the ``data`` config: ``FileDataset(path, ...)``, or a ``MixtureDataset``
    of ``sources`` (each {path, weight, data_source, columns, format}; ``format`` and ``columns``
    given here are the defaults of each source). Both have ``len()``, ``entries``,
    ``iteration_indices``, ``refill_indices``, ``where`` and ``fingerprint``.
    ``require_answer`` False: rows without a reference answer are accepted (``FileDataset``).

    Raises:
        DatasetError: both or neither of ``path`` and ``sources``; any open-time problem.
    """
    if (path is None) == (not sources):
        raise DatasetError("give exactly one of data.path and data.sources")
    if sources:
        return MixtureDataset(sources, format=format, columns=columns, require_answer=require_answer)
    return FileDataset(path, format=format, columns=columns, data_source=data_source, require_answer=require_answer)


def data_fingerprint(path: str | None = None, *, format: str = "auto", sources: Sequence[Mapping[str, Any]] | None = None,
                     key: str = "data.path") -> str:
    """The fingerprint of the ``data`` config's files without reading them (fsspec ``info``
    only): ``fingerprint_files`` of ``path``, or of each source joined with ``+``; equal to
    ``open_data(...).fingerprint()``. For the prompts stage's config hash. ``key``: the config key
    ``path`` came from, named by its errors (a source's are ``data.sources[k].path``).

    Raises:
        DatasetError: both or neither of ``path`` and ``sources``; a path that resolves to no
            files (see ``resolve_files``).
    """
    if (path is None) == (not sources):
        raise DatasetError("give exactly one of data.path and data.sources")
    if sources:
        return "+".join(fingerprint_files(resolve_files(s["path"], s.get("format") or format, key=f"data.sources[{k}].path"))
                        for k, s in enumerate(sources))
    return fingerprint_files(resolve_files(path, format, key=key))


def source_dicts(data) -> list[dict[str, Any]] | None:
    """``data.sources`` as the dicts ``MixtureDataset`` takes (None: no mixture); keys left unset
    (None) fall back to ``data.format`` / ``data.columns``."""
    if not data.sources:
        return None
    return [{k: v for k, v in s.model_dump().items() if v is not None} for s in data.sources]


def open_data_config(data, *, require_answer: bool = True):
    """``open_data`` of a ``rft_core.config.DataConfig`` with ``source: files``: its ``path`` or
    its ``sources`` mixture, with its ``format`` and ``columns`` (``require_answer``: as ``open_data``).

    Raises:
        DatasetError: ``data.source`` is not ``files``, or anything ``open_data`` raises.
    """
    if data.source != "files":
        raise DatasetError(f"data.source is {data.source!r}; only data.source=files reads files")
    return open_data(data.path, format=data.format, columns=data.columns or None, sources=source_dicts(data),
                     require_answer=require_answer)


def dataset_fingerprint(data) -> str | None:
    """The fingerprint of a ``DataConfig``'s files (``data_fingerprint``: fsspec ``info`` only,
    no row is read), or None when ``data.source`` is not ``files`` (a generated task is a pure
    function of its config). What flows put in ``PromptsInput.data_fingerprint``.

    Raises:
        DatasetError: a path that resolves to no files.
    """
    if data.source != "files":
        return None
    return data_fingerprint(data.path, format=data.format, sources=source_dicts(data))


def heldout_fingerprint(data, eval) -> str | None:
    """The fingerprint of the held-out file ``eval.path`` (read with ``data.format``), or None
    when it is not set. What flows put in ``EvalPromptsInput.data_fingerprint``.

    Raises:
        DatasetError: ``eval.path`` resolves to no files.
    """
    if eval.path is None:
        return None
    return data_fingerprint(eval.path, format=data.format, key="eval.path")
