"""Train on your own data: prompts and references from files (issue 17).

``rft_core.data.mixture.open_data`` maps the ``data`` config onto a dataset object:

```yaml
data:
  source: files
  path: data/train.parquet     # a file, a glob, a folder, a datasets.save_to_disk folder, any fsspec URI
  format: auto                 # auto | parquet | jsonl | json | csv | hf_disk
  columns: {prompt: question, answer: reward_model.ground_truth}   # optional, see rft_core.data.columns
  sources: [{path: a.jsonl, weight: 3}, {path: b.parquet, weight: 1, data_source: gsm8k}]   # or a mixture
```

A ``FileDataset`` has ``len()``, ``entries(indices)`` (the ``(index, entry)`` pairs that
``rft_core.data.prompts.build_prompts`` takes; only the rows asked for are read and checked),
``iteration_indices``/``refill_indices`` (the seeded data order of ``rft_core.data.prompts``)
and ``fingerprint()`` (changes when a file does). Opening checks what is cheap: the files exist
and parse, the columns exist and have usable types; ``rft_core.data.validate`` checks every row,
column-wise, before a training run starts (and for ``rft data check``).

Every error of opening a dataset names the config key its path came from (``key``:
``data.path``, ``eval.path``, ``data.sources[k].path``): ``eval.path 'test.jsonl': no such file
or folder``, or the key before the file's own message (``data.sources[1].path: b.jsonl line 3
(row 2): not valid JSON ...``).

Formats by extension: ``.parquet``/``.pq``, ``.jsonl``/``.ndjson``, ``.json`` (an array of
objects, or JSON Lines when it does not start with ``[``), ``.csv``; compressed variants
(``.jsonl.gz`` ...) through fsspec; a folder with ``state.json`` + ``dataset_info.json`` is a
``datasets.save_to_disk`` folder. Rows are numbered from 0 within each file in messages; a row
of a JSON Lines file is also named by its 1-based line, as an editor shows it (blank lines,
which the reader skips, counted): ``data.jsonl line 4 (row 3)``.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from rft_core.data.columns import Layout, field_type, read_remote, resolve_layout, row_entry
from rft_core.data.prompts import DatasetError, iteration_indices, refill_indices
from rft_core.data.readers import (ParquetPart, Part, TablePart, base_dir_of, is_hf_disk, is_local_fs, read_hf_disk,
                                   read_json, read_jsonl, read_table)

FORMATS = ("parquet", "jsonl", "json", "csv", "hf_disk")
EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv"}
_GLOB_CHARS = "*?["


def format_of(name: str) -> str | None:
    """The format of a file name by its extension (a compression suffix is looked through:
    ``a.jsonl.gz`` is jsonl), or None."""
    from fsspec.utils import infer_compression

    stem = name
    if infer_compression(name):
        stem = os.path.splitext(name)[0]
    return EXTENSIONS.get(os.path.splitext(stem)[1].lower())


@dataclass(frozen=True)
class DataFiles:
    """What a dataset path resolves to.

    Attributes:
        fs: the fsspec filesystem.
        paths: the data files (for ``hf_disk``: the folder), sorted.
        format: one of ``FORMATS``.
        path: the path as given.
        key: the config key it came from (``data.path``, ``eval.path``, ``data.sources[k].path``).
    """

    fs: Any
    paths: tuple[str, ...]
    format: str
    path: str
    key: str = "data.path"

    def uri(self, p: str) -> str:
        """``p`` as shown to users: a local path, or the URI with its protocol."""
        return p if is_local_fs(self.fs) else self.fs.unstrip_protocol(p)


def _visible(root: str, p: str) -> bool:
    rel = p[len(root):].lstrip("/")
    return not any(part.startswith((".", "_")) for part in rel.split("/"))


def format_key(key: str) -> str:
    """The config key that sets the format of the path at ``key``: ``data.sources[k].format``
    for a source of a mixture (``data.format`` when it is unset), else ``data.format`` (the
    held-out ``eval.path`` is read with ``data.format`` too)."""
    return f"{key[:-len('.path')]}.format (or data.format)" if key.startswith("data.sources[") else "data.format"


def resolve_files(path: str, format: str = "auto", *, key: str = "data.path") -> DataFiles:
    """The files of ``path`` (file, glob, folder, ``save_to_disk`` folder; any fsspec URI) and
    their format (``auto``: from the extensions, or the folder's ``state.json``).

    Args:
        key: the config key ``path`` came from (``data.path``, ``eval.path``,
            ``data.sources[k].path``); every error names it: ``eval.path 'test.jsonl': no such
            file or folder``.
    Raises:
        DatasetError: unknown format, nothing at ``path``, a glob matching nothing, a folder
            without data files, an extension that says no format, or several formats mixed.
    """
    import fsspec

    where = f"{key} {str(path)!r}"
    if format not in ("auto", *FORMATS):
        raise DatasetError(f"{format_key(key)} {format!r} is not one of {['auto', *FORMATS]} (reading {where})")
    try:
        fs, root = fsspec.core.url_to_fs(str(path))
    except (ValueError, ImportError) as exc:
        raise DatasetError(f"{where}: {exc}") from exc
    root = root.rstrip("/") or root
    if any(c in root for c in _GLOB_CHARS):
        paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
        if not paths:
            raise DatasetError(f"{where} matches no files")
    elif fs.isdir(root):
        if format in ("auto", "hf_disk") and is_hf_disk(fs, root):
            return DataFiles(fs, (root,), "hf_disk", str(path), key)
        if format == "hf_disk":
            raise DatasetError(f"{where}: not a datasets.save_to_disk folder (no state.json + dataset_info.json)")
        paths = sorted(p for p in fs.find(root) if _visible(root, p)
                       and (format != "auto" or format_of(p) is not None))
        if not paths:
            raise DatasetError(f"{where}: the folder holds no data files ({', '.join(EXTENSIONS)})")
    elif fs.isfile(root):
        paths = [root]
    else:
        raise DatasetError(f"{where}: no such file or folder")
    if format == "hf_disk":
        raise DatasetError(f"{where}: format hf_disk needs a datasets.save_to_disk folder, not files")
    if format == "auto":
        fmts = {p: format_of(p) for p in paths}
        unknown = [p for p, f in fmts.items() if f is None]
        if unknown:
            raise DatasetError(f"{where}: cannot tell the format of {unknown[0]!r} from its extension; set "
                               f"{format_key(key)} to one of {list(FORMATS)}")
        if len(set(fmts.values())) > 1:
            raise DatasetError(f"{where}: files of several formats {sorted(set(fmts.values()))}; keep one format per "
                               "path (a mixture takes several paths: data.sources)")
        format = next(iter(fmts.values()))
    return DataFiles(fs, tuple(paths), format, str(path), key)


_BLANK_LINE = re.compile(rb"\n[ \t\r]*(?=\n)")  # a newline, then a line of only JSON whitespace
_BLANK_FIRST = re.compile(rb"\A[ \t\r]*\n")


def jsonl_blank_lines(raw: bytes, num_rows: int) -> np.ndarray | None | bool:
    """Where the rows of a JSON Lines file (``raw``: its bytes) sit among its lines: the reader
    (pyarrow) skips blank and whitespace-only lines, so a row's line is its index + 1 + the
    blank lines before it. Returns None when no line is blank (row r is line r + 1); else, per
    blank line in order, how many rows come before it (``jsonl_line`` takes it); False when the
    lines do not add up to ``num_rows`` rows (then rows are named by index only).

    Costs one ``bytes.count`` when no line is blank, else a regex scan for newlines followed by
    a blank line (the C search jumps from newline to newline); nothing per row is stored.
    """
    n_lines = raw.count(b"\n") + (1 if raw and not raw.endswith(b"\n") else 0)
    if n_lines == num_rows:
        return None
    blank, newlines, pos = [], 0, 0
    if _BLANK_FIRST.match(raw):
        blank.append(1)
    for m in _BLANK_LINE.finditer(raw):
        newlines += raw.count(b"\n", pos, m.start())
        pos = m.start()
        blank.append(newlines + 2)  # the line after the newline at m.start()
    last = raw[raw.rfind(b"\n") + 1:]
    if n_lines - len(blank) - (1 if last and not last.strip(b" \t\r") else 0) != num_rows:
        return False
    lines = np.asarray(blank, dtype=np.int64)
    return lines - 1 - np.arange(len(lines), dtype=np.int64)


def jsonl_line(blank: np.ndarray | None, rows):  # blank: jsonl_blank_lines' array or None
    """The 1-based line of row ``rows`` (an int, or a numpy array of them) of a JSON Lines file,
    given ``jsonl_blank_lines``' result for it."""
    return rows + 1 if blank is None else rows + 1 + np.searchsorted(blank, rows, side="right")


def _read_raw(fs, path: str, uri: str) -> bytes:
    from fsspec.utils import infer_compression

    try:
        with fs.open(path, "rb", compression=infer_compression(path)) as f:
            return f.read()
    except (OSError, ValueError, EOFError) as exc:
        raise DatasetError(f"{uri}: cannot read: {exc}") from exc


def _is_json_lines(fmt: str, raw: bytes) -> bool:
    """JSON Lines: the jsonl format, or a .json file that does not start with ``[`` (as ``read_json``)."""
    if fmt == "jsonl":
        return True
    start = raw.lstrip()[:1]
    if start == b"\xef":  # UTF-8 byte order mark
        start = raw.lstrip()[3:4]
    return fmt == "json" and start != b"["


def _text_part(files: DataFiles, p: str) -> tuple[Part, np.ndarray | None | bool]:
    """A JSON Lines / JSON / CSV file as a ``TablePart``, and where its rows sit among its lines
    (``jsonl_blank_lines``; False: not a JSON Lines file, rows are named by index only)."""
    uri = files.uri(p)
    if files.format == "csv":
        return TablePart(read_table(files.fs, p, files.format, uri), uri=uri, base_dir=base_dir_of(files.fs, p)), False
    raw = _read_raw(files.fs, p, uri)
    table = (read_jsonl if files.format == "jsonl" else read_json)(raw, uri)
    lines = jsonl_blank_lines(raw, table.num_rows) if _is_json_lines(files.format, raw) else False
    return TablePart(table, uri=uri, base_dir=base_dir_of(files.fs, p)), lines


def _open_parts(files: DataFiles) -> tuple[list[Part], list[np.ndarray | None | bool]]:
    """The parts of ``files`` and, per part, its rows' lines (see ``_text_part``)."""
    if files.format == "hf_disk":
        uri = files.uri(files.paths[0])
        return [TablePart(read_hf_disk(uri), uri=uri, base_dir=base_dir_of(files.fs, f"{files.paths[0]}/state.json"))], [False]
    if files.format == "parquet":
        return ([ParquetPart(files.fs, p, uri=files.uri(p), base_dir=base_dir_of(files.fs, p)) for p in files.paths],
                [False] * len(files.paths))
    parts, lines = zip(*(_text_part(files, p) for p in files.paths))
    return list(parts), list(lines)


def _same_layout(first: Part, first_layout: Layout, part: Part, layout: Layout) -> None:
    """Every file of a path must map the same columns with the same types."""
    if layout.columns != first_layout.columns:
        raise DatasetError(f"{part.uri}: columns {layout.columns} differ from {first.uri}'s {first_layout.columns}")
    for key, col in layout.columns.items():
        a, b = field_type(first.schema, col), field_type(part.schema, col)
        if a != b and not (str(a).replace("large_", "") == str(b).replace("large_", "")):
            raise DatasetError(f"{part.uri}: column {col!r} ({key}) has type {b}, but {a} in {first.uri} (mixed types)")


def _stem(path: str) -> str:
    """A dataset name from its path: the file or folder name up to its first dot, with
    characters other than letters, digits, ``-`` and ``_`` replaced by ``_``."""
    name = os.path.basename(str(path).rstrip("/")).split(".")[0]
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "data"


class FileDataset:
    """The rows of one path (file, glob, folder, ``save_to_disk`` folder, fsspec URI).

    Args:
        path: where the data is.
        format: ``auto`` or one of ``FORMATS``.
        columns: our key -> the file's column (dotted for nested); see ``rft_core.data.columns``.
        data_source: label for every row (overrides the file's ``data_source`` column, which is
            then kept in ``metadata``); None: the row's column, else ``name``.
        name: the dataset's name (default: the file or folder name without extensions); the
            label of rows without one, and a good ``build_prompts`` ``data_source`` argument.
        require_answer: False when the grader reads no reference answer
            (``RewardConfig.needs_reference``): rows without one get the answer ``""``.
        key: the config key ``path`` came from (``data.path``, ``eval.path``,
            ``data.sources[k].path``): every error of opening names it.
    Raises:
        DatasetError: see ``resolve_files``, the readers, and ``resolve_layout``; or no rows.
            The message starts with ``key``.
    """

    def __init__(self, path: str, *, format: str = "auto", columns: Mapping[str, str] | None = None,
                 data_source: str | None = None, name: str | None = None, require_answer: bool = True,
                 key: str = "data.path") -> None:
        self.files = resolve_files(path, format, key=key)
        self.path, self.format, self.key = str(path), self.files.format, key
        self.name = name or _stem(path)
        self.data_source = data_source
        self.require_answer = require_answer
        try:
            self.parts, self._lines = _open_parts(self.files)
            self._starts = np.concatenate([[0], np.cumsum([p.num_rows for p in self.parts], dtype=np.int64)])
            if len(self) == 0:
                raise DatasetError(f"{self.path}: no rows")
            self.layouts = [resolve_layout(p.schema, columns, where=p.uri, require_answer=require_answer)
                            for p in self.parts]
            for part, layout in zip(self.parts[1:], self.layouts[1:]):
                _same_layout(self.parts[0], self.layouts[0], part, layout)
        except DatasetError as exc:  # the file's own message (file, line, column), after the key it came from
            raise DatasetError(f"{key}: {exc}") from exc

    @property
    def layout(self) -> Layout:
        """The column layout (the same for every file)."""
        return self.layouts[0]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, row within that file) of global row ``index``."""
        if not 0 <= index < len(self):
            raise DatasetError(f"{self.path}: row index {index} out of range (the dataset has {len(self)} rows)")
        k = int(np.searchsorted(self._starts, index, side="right") - 1)
        return k, int(index - self._starts[k])

    def where(self, index: int) -> str:
        """'{file} row {n}' of global row ``index`` ('{file} line {l} (row {n})' in a JSON Lines file)."""
        return self.where_in(*self.locate(index))

    def line_of(self, k: int, row: int) -> int | None:
        """The 1-based line of ``row`` (0-based) of file ``k`` when it is a JSON Lines file, else None."""
        blank = self._lines[k]
        return None if blank is False else int(jsonl_line(blank, row))

    def where_in(self, k: int, row: int) -> str:
        """How messages name ``row`` (0-based) of file ``k``: '{file} row {n}', or
        '{file} line {l} (row {n})' in a JSON Lines file (``l``: 1-based, blank lines counted)."""
        line = self.line_of(k, row)
        return f"{self.parts[k].uri} row {row}" if line is None else f"{self.parts[k].uri} line {line} (row {row})"

    def _entry(self, k: int, row: int, values: dict[str, Any]) -> dict[str, Any]:
        part = self.parts[k]
        return row_entry(values, self.layouts[k], where=self.where_in(k, row), base_dir=part.base_dir,
                         data_source=self.name, data_source_override=self.data_source,
                         require_answer=self.require_answer)

    def entries(self, indices: Sequence[int]) -> list[tuple[int, dict[str, Any]]]:
        """``(index, entry)`` for each global row index, in the order given (repeats allowed),
        reading only those rows; image and video URIs that are not local files are read into
        bytes (``rft_core.data.images`` / ``video`` read local paths themselves).

        Raises:
            DatasetError: an index out of range, or a bad row (see ``row_entry``); the first one.
        """
        idx = np.asarray(list(indices), dtype=np.int64)
        for i in idx:
            self.locate(int(i))
        by_index: dict[int, dict[str, Any]] = {}
        for k, part in enumerate(self.parts):
            lo, hi = self._starts[k], self._starts[k + 1]
            local = np.unique(idx[(idx >= lo) & (idx < hi)]) - lo
            if len(local):
                for row, values in zip(local, part.rows(local)):
                    entry = self._entry(k, int(row), values)
                    for key in ("images", "videos"):
                        entry[key] = [read_remote(x, where=f"{self.where_in(k, int(row))} {key[:-1]} {j}")
                                      for j, x in enumerate(entry[key])]
                    by_index[int(row + lo)] = entry
        return [(int(i), by_index[int(i)]) for i in idx]

    def iteration_indices(self, iteration: int, *, per_iteration: int, seed: int) -> list[int]:
        """The rows of ``iteration`` (1-based): ``rft_core.data.prompts.iteration_indices`` over
        ``len(self)`` rows."""
        return iteration_indices(iteration, per_iteration=per_iteration, size=len(self), seed=seed)

    def refill_indices(self, iteration: int, attempt: int, *, per_iteration: int, seed: int) -> list[int]:
        """Dynamic-sampling refill rows: ``rft_core.data.prompts.refill_indices`` over ``len(self)``."""
        return refill_indices(iteration, attempt, per_iteration=per_iteration, size=len(self), seed=seed)

    def fingerprint(self) -> str:
        """See ``fingerprint_files``."""
        return fingerprint_files(self.files)


_VERSION_KEYS = ("ETag", "etag", "md5Hash", "crc32c", "checksum", "mtime", "LastModified", "last_modified", "updated",
                 "created")


def fingerprint_files(files: DataFiles) -> str:
    """One string that changes when any file of ``files`` changes: for each file (every file
    inside a ``save_to_disk`` folder) its path relative to the files' common folder (so moving
    the dataset keeps it), size and version from fsspec ``info`` (an ETag, MD5 or CRC where the
    store has one, else the modification time; ``fs.ukey`` otherwise), hashed with sha256.
    Format ``{n files}f-{total bytes}B-{16 hex}``.

    Raises:
        DatasetError: a file's ``info`` cannot be read.
    """
    fs = files.fs
    if files.format == "hf_disk":
        paths, root = sorted(fs.find(files.paths[0])), files.paths[0]
    else:
        paths = list(files.paths)
        root = posixpath.dirname(paths[0]) if len(paths) == 1 else posixpath.commonpath(paths)
    items, total = [], 0
    for p in paths:
        try:
            info = fs.info(p)
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{files.key}: {files.uri(p)}: cannot read file info: {exc}") from exc
        version = next((info[k] for k in _VERSION_KEYS if info.get(k) is not None), None)
        items.append([posixpath.relpath(p, root), info.get("size"), str(version) if version is not None else fs.ukey(p)])
        total += int(info.get("size") or 0)
    digest = hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]
    return f"{len(paths)}f-{total}B-{digest}"
