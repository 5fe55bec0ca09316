"""Reading users' dataset files into Arrow: Parquet lazily by row group, JSON Lines, JSON arrays,
CSV and ``datasets.save_to_disk`` folders (read with pyarrow: no ``datasets`` needed) into
(columnar) Arrow tables, through fsspec.

Each file becomes a ``Part``: its schema, its row count, the rows of given local indices, and
its rows batch by batch. Parquet parts read only their footer when opened and later only the
row groups (and, inside a row group, the record batches) that hold the requested rows, so a
file of millions of rows costs memory in proportion to one batch, not to the file.

Unreadable input raises ``DatasetError`` naming the file and, where the format has one, the
row, line and byte offset (unparsable JSON) or the column (mixed types).
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from rft_core.data.prompts import DatasetError

BATCH_ROWS = 8_192  # rows decoded at a time (Parquet record batches, full scans): bounds memory
JSON_BLOCK_BYTES = 1 << 25  # pyarrow JSON block: a JSON line must fit in one block


class Part:
    """One file of a dataset.

    Attributes:
        uri: the file, as shown in messages.
        base_dir: the folder that relative image/video paths of this file are relative to.
        schema: its Arrow schema.
        num_rows: its row count.
    """

    uri: str
    base_dir: str
    schema: pa.Schema
    num_rows: int

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]:
        """The rows at sorted, unique local indices ``local`` (int64), as dicts, in that order."""
        raise NotImplementedError

    def batches(self, batch_rows: int = BATCH_ROWS) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(first local row, rows as dicts) for consecutive batches of the whole file."""
        raise NotImplementedError


class TablePart(Part):
    """A file held as one Arrow table (JSON Lines, JSON, CSV, a ``save_to_disk`` folder)."""

    def __init__(self, table: pa.Table, *, uri: str, base_dir: str) -> None:
        self.table, self.uri, self.base_dir = table, uri, base_dir
        self.schema, self.num_rows = table.schema, table.num_rows

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]:
        return self.table.take(pa.array(local, pa.int64())).to_pylist()

    def batches(self, batch_rows: int = BATCH_ROWS):
        for start in range(0, self.num_rows, batch_rows):
            yield start, self.table.slice(start, batch_rows).to_pylist()


class ParquetPart(Part):
    """A Parquet file read lazily: the footer when opened, then only the needed row groups."""

    def __init__(self, fs, path: str, *, uri: str, base_dir: str) -> None:
        import pyarrow.parquet as pq

        self._fs, self._path, self.uri, self.base_dir = fs, path, uri, base_dir
        try:
            with self._open() as f:
                self._meta = pq.read_metadata(f)
                self.schema = pq.read_schema(f)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DatasetError(f"{uri}: not a readable Parquet file (truncated or another format?): {exc}") from exc
        sizes = [self._meta.row_group(k).num_rows for k in range(self._meta.num_row_groups)]
        self._rg_start = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_rows = int(self._rg_start[-1])

    def _open(self):
        return self._fs.open(self._path, "rb")

    def _iter(self, row_groups: list[int], batch_rows: int):
        import pyarrow.parquet as pq

        with self._open() as f:
            pf = pq.ParquetFile(f, metadata=self._meta)
            try:
                yield from pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, use_threads=False)
            except (pa.ArrowException, OSError) as exc:
                raise DatasetError(f"{self.uri}: row group(s) {row_groups} cannot be read (corrupt file?): {exc}") from exc

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]:
        groups = np.searchsorted(self._rg_start, local, side="right") - 1
        out: list[dict[str, Any]] = []
        for rg in np.unique(groups):
            want = local[groups == rg] - self._rg_start[rg]
            start = 0
            for batch in self._iter([int(rg)], BATCH_ROWS):
                end = start + batch.num_rows
                sel = want[(want >= start) & (want < end)]
                if len(sel):
                    out.extend(batch.take(pa.array(sel - start, pa.int64())).to_pylist())
                start = end
                if start > want[-1]:
                    break  # the rest of the row group holds no wanted row
        return out

    def batches(self, batch_rows: int = BATCH_ROWS):
        start = 0
        for batch in self._iter(list(range(self._meta.num_row_groups)), batch_rows):
            yield start, batch.to_pylist()
            start += batch.num_rows


# --- JSON ------------------------------------------------------------------------------------

def _json_kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _kinds(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(dotted path, JSON kind) of ``value`` and everything inside it (nulls skipped; list items
    share the path ``name[]``)."""
    kind = _json_kind(value)
    if kind is None:
        return
    yield path, kind
    if kind == "object":
        for k, v in value.items():
            yield from _kinds(v, f"{path}.{k}" if path else str(k))
    elif kind == "array":
        for v in value:
            yield from _kinds(v, f"{path}[]")


class _KindTracker:
    """First JSON kind seen at each path; reports the first row that disagrees."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, int]] = {}

    def conflict(self, obj: dict, row: int) -> str | None:
        for path, kind in _kinds(obj, ""):
            if not path:
                continue
            first = self.seen.setdefault(path, (kind, row))
            if first[0] != kind:
                return f"column {path!r}: mixed types, {kind} here but {first[0]} in row {first[1]}"
        return None


def _decode_error(uri: str, exc: json.JSONDecodeError, text: str, base: int, extra: str = "") -> DatasetError:
    offset = base + len(text[:exc.pos].encode("utf-8"))
    return DatasetError(f"{uri}{extra}: not valid JSON at byte offset {offset}: {exc.msg}")


def _diagnose_jsonl(uri: str, raw: bytes, cause: Exception) -> DatasetError:
    """The first unparsable line, non-object line or mixed-type column of a JSON Lines file."""
    tracker, offset, row = _KindTracker(), 0, -1
    for lineno, line in enumerate(io.BytesIO(raw), 1):
        if line.strip():
            row += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return DatasetError(f"{uri} line {lineno} (row {row}): not UTF-8 at byte offset {offset + exc.start}")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                return _decode_error(uri, exc, text, offset, f" line {lineno} (row {row})")
            if not isinstance(obj, dict):
                return DatasetError(f"{uri} line {lineno} (row {row}): a JSON Lines row must be an object, got {_json_kind(obj)}")
            problem = tracker.conflict(obj, row)
            if problem:
                return DatasetError(f"{uri} row {row} (line {lineno}) {problem}")
        offset += len(line)
    return DatasetError(f"{uri}: cannot read as JSON Lines: {cause}")


def read_jsonl(raw: bytes, uri: str) -> pa.Table:
    """A JSON Lines file (one object per line; blank lines skipped) as an Arrow table.

    Raises:
        DatasetError: a line that is not JSON (line, row, byte offset), not an object, or a
            column whose values have different JSON types (row, column, both types).
    """
    import pyarrow.json as pj

    try:
        return pj.read_json(io.BytesIO(raw), read_options=pj.ReadOptions(block_size=max(1 << 20, min(len(raw) + 1, JSON_BLOCK_BYTES))))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise _diagnose_jsonl(uri, raw, exc) from exc


def read_json(raw: bytes, uri: str) -> pa.Table:
    """A JSON file holding an array of objects as an Arrow table; a file whose first character
    is not ``[`` is read as JSON Lines.

    Raises:
        DatasetError: unparsable JSON (byte offset, line, column), a top-level value that is not
            an array, an item that is not an object, or mixed types in a column.
    """
    start = raw.lstrip()[:1]
    if start == b"\xef":  # UTF-8 byte order mark
        start = raw.lstrip()[3:4]
    if start != b"[":
        return read_jsonl(raw, uri)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{uri}: not UTF-8 at byte offset {exc.start}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _decode_error(uri, exc, text, 0, f" (line {exc.lineno}, column {exc.colno})") from exc
    tracker = _KindTracker()
    for row, obj in enumerate(data):
        if not isinstance(obj, dict):
            raise DatasetError(f"{uri} row {row}: an item of the JSON array must be an object, got {_json_kind(obj)}")
        problem = tracker.conflict(obj, row)
        if problem:
            raise DatasetError(f"{uri} row {row} {problem}")
    try:
        return pa.Table.from_pylist(data)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DatasetError(f"{uri}: cannot convert to a table: {exc}") from exc


# --- CSV -------------------------------------------------------------------------------------

def _diagnose_csv(uri: str, raw: bytes, cause: Exception) -> DatasetError:
    text = raw.decode("utf-8-sig", errors="replace")
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    for row, fields in enumerate(reader):
        if header is not None and fields and len(fields) != len(header):
            return DatasetError(f"{uri} row {row} (line {reader.line_num}): {len(fields)} fields, the header has "
                                f"{len(header)} ({header})")
    return DatasetError(f"{uri}: cannot read as CSV: {cause}")


def read_csv(raw: bytes, uri: str) -> pa.Table:
    """A CSV file with a header row as an Arrow table of strings (every column is text, so an
    answer keeps its digits as written: ``007``, ``0.50``); quoted newlines are allowed.

    Raises:
        DatasetError: no header, or a row with another number of fields (row, line).
    """
    import pyarrow.csv as pc

    parse = pc.ParseOptions(newlines_in_values=True)
    try:
        names = pc.open_csv(io.BytesIO(raw), parse_options=parse).schema.names
        types = {n: pa.string() for n in names}
        return pc.read_csv(io.BytesIO(raw), parse_options=parse, convert_options=pc.ConvertOptions(column_types=types))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise _diagnose_csv(uri, raw, exc) from exc


# --- datasets.save_to_disk --------------------------------------------------------------------

def is_hf_disk(fs, root: str) -> bool:
    """True for a ``datasets.save_to_disk`` folder (a Dataset or a DatasetDict)."""
    return fs.isfile(f"{root}/dataset_dict.json") or (fs.isfile(f"{root}/state.json") and fs.isfile(f"{root}/dataset_info.json"))


def _read_arrow_stream(fs, path: str, uri: str) -> pa.Table:
    """One Arrow IPC stream file of a ``save_to_disk`` folder: memory-mapped when local."""
    try:
        if is_local_fs(fs):
            return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()
        return pa.ipc.open_stream(pa.py_buffer(fs.cat_file(path))).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DatasetError(f"{uri}: not a readable Arrow stream file of a datasets.save_to_disk folder: {exc}") from exc


def is_local_fs(fs) -> bool:
    """True when the fsspec filesystem ``fs`` is the local disk (protocol ``file`` or ``local``)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def read_hf_disk(uri: str) -> pa.Table:
    """The Arrow table of a ``datasets.save_to_disk`` Dataset folder, read with pyarrow alone
    (``datasets`` need not be installed): the Arrow IPC stream files that ``state.json`` lists
    under ``_data_files``, in order, memory-mapped when local. This is the table
    ``datasets.load_from_disk(uri).data.table`` holds. A folder written by an old ``datasets``
    that kept an indices mapping (``_indices_data_files``) gives its rows in that mapping's order.

    Raises:
        DatasetError: unreadable folder or file, or a DatasetDict (the message lists its splits:
            point the path at one split's folder).
    """
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(uri)
    root = root.rstrip("/")
    try:
        if fs.isfile(f"{root}/dataset_dict.json"):
            splits = sorted(json.loads(fs.cat_file(f"{root}/dataset_dict.json"))["splits"])
            raise DatasetError(f"{uri} is a DatasetDict with splits {splits}; set the path to one split's folder, "
                               f"e.g. {uri.rstrip('/')}/{splits[0]}")
        state = json.loads(fs.cat_file(f"{root}/state.json"))
        files = [f["filename"] for f in state["_data_files"]]
    except DatasetError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise DatasetError(f"{uri}: not a readable datasets.save_to_disk folder (state.json, dataset_dict.json): "
                           f"{type(exc).__name__}: {exc}") from exc
    if not files:
        raise DatasetError(f"{uri}: state.json lists no data files")
    tables = [_read_arrow_stream(fs, f"{root}/{name}", f"{uri.rstrip('/')}/{name}") for name in files]
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as exc:
        raise DatasetError(f"{uri}: its data files have different schemas: {exc}") from exc
    indices = [f["filename"] for f in state.get("_indices_data_files") or []]
    if indices:
        order = pa.concat_tables([_read_arrow_stream(fs, f"{root}/{n}", f"{uri.rstrip('/')}/{n}") for n in indices])
        table = table.take(order.column(0))
    return table


def read_table(fs, path: str, fmt: str, uri: str) -> pa.Table:
    """A JSON Lines, JSON or CSV file (fsspec-compressed ones too: ``.gz``, ``.zst`` ...) as an
    Arrow table.

    Raises:
        DatasetError: unreadable file or bad content (see the readers).
    """
    from fsspec.utils import infer_compression

    try:
        with fs.open(path, "rb", compression=infer_compression(path)) as f:
            raw = f.read()
    except (OSError, ValueError, EOFError) as exc:
        raise DatasetError(f"{uri}: cannot read: {exc}") from exc
    reader = {"jsonl": read_jsonl, "json": read_json, "csv": read_csv}[fmt]
    return reader(raw, uri)


def base_dir_of(fs, path: str) -> str:
    """The folder of ``path`` as a local path or a URI (for relative media paths)."""
    parent = fs._parent(path)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return os.path.abspath(parent)
    return fs.unstrip_protocol(parent)
